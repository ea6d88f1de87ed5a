"""Diffusion fine-tune memory per rank and speed, every tiny family (SD 1.5, SDXL, SD3, FLUX): all roles
ZeRO-3 vs the seed baseline (diffusers' scripts: only the denoiser sharded, the frozen vae and text
encoders full copies on every rank), same seed and data.

Runs the real recipe (`sd_finetune`, each family's tiny model) in one process per world size: every run of
a world size is a recipe run inside the same launch (recipes compose on the same ranks), so the launcher
and imports are paid once. Per run it reads summary.json: per-rank memory report rows, the planner's bytes
for the same placements, the median step time.

    python -m benchmarks.sd_memory_speed     # N=2 timing of 4 families + SD memory at N=1,4: ~2 min on idle cores

Layouts: ``zero3_gather`` (the recipe default: every role ZeRO-3, each frozen role gathered whole once per
call, ``gather_forward``), ``zero3`` (the same sharding, frozen roles fetched layer by layer; SD only) and
``seed_baseline``. Within a family the layouts run back to back, their order alternating between families.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("sd", "sdxl", "sd3", "flux")
DENOISER = {"sd": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
# mode name -> (recipe mode, overrides given the family's frozen roles)
MODES = {
    "zero3_gather": ("zero3", True),
    "zero3": ("zero3", False),
    "seed_baseline": ("seed_baseline", None),
}
# no EMA, validation, evaluation, checkpoints or exports (the tiny configs' keys of those back to their defaults;
# model.tiny_family, which applies only without model.pretrained, too)
QUIET = ["ema.enabled=false", "validation.enabled=false", "validation.guidance_scale=null", "eval.heldout_size=0",
         "checkpoint.every=0", "export.enabled=false", "export.roles=[]", "tensorboard=false", "plot=false",
         "model.tiny_family=sd"]
ROOT = Path(__file__).resolve().parents[1]


def overrides(family: str, mode: str, model_dir: str, data_dir: str, out: str, steps: int) -> list[str]:
    recipe_mode, gather = MODES[mode]
    encoders = {"sd": 1, "sdxl": 2, "sd3": 3, "flux": 2}[family]
    frozen = ["vae", "text_encoder", *(f"text_encoder_{i}" for i in range(2, encoders + 1))]
    extra = [f"roles.{r}.gather_forward={str(gather).lower()}" for r in frozen] if gather is not None else []
    return [*QUIET, f"output_dir={out}", f"mode={recipe_mode}", f"max_steps={steps}", f"model.pretrained={model_dir}",
            f"data.source={data_dir}", "data.resolution=32", *extra]


def figures(summary: dict) -> dict:
    """Per role, the largest per-rank figures over ranks (params held, model-state bytes) and the planner's
    bytes for the same placement; totals over roles."""
    per_rank = summary["memory"]["per_rank"]
    planned = (summary["memory"].get("planned_vs_measured") or {}).get("roles", {})
    out: dict = {"roles": {}}
    for row0 in per_rank[0]["roles"]:
        role = row0["role"]
        rows = [next(r for r in rank["roles"] if r["role"] == role) for rank in per_rank]
        out["roles"][role] = {
            "trainable": bool(row0["trainable"]), "stage": row0["stage"],
            "params_local": max(r["params_local"] for r in rows), "params_total": row0["params_total"],
            "params_persistent": max(r["params_persistent"] for r in rows),
            "bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in rows),
            "planned_bytes": (planned.get(role, {}).get("planned") or {}).get("total"),
        }
    roles = out["roles"].values()
    out["total_bytes"] = sum(r["bytes"] for r in roles)
    out["planned_total_bytes"] = sum(r["planned_bytes"] or 0 for r in roles)
    out["total_params_local"] = sum(r["params_local"] for r in roles)
    out["frozen_params_local"] = sum(r["params_local"] for r in roles if not r["trainable"])
    out["frozen_params_total"] = sum(r["params_total"] for r in roles if not r["trainable"])
    return out


def worker(spec_path: str) -> None:
    """On every rank: run each (family, mode) of the spec through the recipe; rank 0 emits the figures."""
    from multiengine.recipes.language.config import load_config, load_recipe

    from benchmarks.common import emit

    spec = json.loads(Path(spec_path).read_text())
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for family, mode in spec["runs"]:
        out = os.path.join(spec["workdir"], f"{family}_{mode}_n{world}")
        cfg = load_config("sd_finetune", "tiny" if family == "sd" else f"tiny_{family}",
                          overrides(family, mode, spec["models"][family], spec["data"], out, spec["steps"]))
        start = time.perf_counter()
        load_recipe("sd_finetune").main(cfg)
        took = time.perf_counter() - start
        if int(os.environ["RANK"]) == 0:
            summary = json.loads(Path(out, "summary.json").read_text())
            results[f"{family}_{mode}_n{world}"] = {
                "family": family, "mode": mode, "world_size": world, "steps": spec["steps"],
                "step_time_s_median": summary["metrics"]["step_time_s_median"],
                "final_loss": summary["metrics"]["final_loss"], "run_wall_s": took, **figures(summary)}
    if int(os.environ["RANK"]) == 0:
        emit(results)


def plot_memory(results: dict, path: Path) -> Path | None:
    """SD 1.5: per-rank parameters held (unet + vae + text_encoder) against world size, one line per layout."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    for mode, style in (("seed_baseline", "o--"), ("zero3_gather", "s-")):
        runs = sorted((r for r in results.values() if r["family"] == "sd" and r["mode"] == mode),
                      key=lambda r: r["world_size"])
        ax.plot([r["world_size"] for r in runs], [r["total_params_local"] / 1e6 for r in runs], style,
                label="seed baseline (frozen roles whole)" if mode == "seed_baseline" else "all roles ZeRO-3")
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("parameters held per rank (M)")
    ax.set_title("tiny SD 1.5: unet + vae + text_encoder")
    ax.set_xticks(sorted({r["world_size"] for r in results.values() if r["family"] == "sd"}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plan(worlds: list[int], families: list[str]) -> dict[int, list[tuple[str, str]]]:
    """(family, mode) runs per world size. N=2 times every family, layouts back to back in alternating
    order (a slow drift of the machine's load favours neither layout); other N: SD memory only."""
    out: dict[int, list[tuple[str, str]]] = {}
    for n in worlds:
        if n == 2:
            runs = []
            for i, family in enumerate(families):
                modes = ["seed_baseline", "zero3_gather"] + (["zero3"] if family == "sd" else [])
                runs += [(family, m) for m in (modes if i % 2 == 0 else modes[::-1])]
            out[n] = runs
        elif "sd" in families:
            out[n] = [("sd", "seed_baseline"), ("sd", "zero3_gather")]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps of the N=2 timing runs "
                        "(the first is excluded from the median)")
    parser.add_argument("--memory-steps", type=int, default=1,
                        help="steps of the N!=2 memory runs (one creates the optimizer state)")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families={args.families!r}: unknown {unknown}; use some of {','.join(FAMILIES)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    from multiengine.pipelines.diffusion.data import make_shapes_dataset
    from multiengine.recipes.sd_finetune import build_tiny_model

    from benchmarks.common import run_ranks, table, write_results

    started = time.perf_counter()
    results: dict[str, dict] = {}
    launches = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        models = {f: build_tiny_model(str(workdir / f"tiny_{f}"), 0, 32, f) for f in families}
        data = make_shapes_dataset(str(workdir / "data"), n=128, resolution=32, seed=0)
        for n, runs in plan(worlds, families).items():
            steps = args.steps if n == 2 else args.memory_steps
            spec = workdir / f"spec_n{n}.json"
            spec.write_text(json.dumps({"runs": runs, "models": models, "data": data, "steps": steps,
                                        "workdir": str(workdir)}))
            t0 = time.perf_counter()
            results.update(run_ranks("benchmarks.sd_memory_speed", n, ["--worker", str(spec)]))
            launches[n] = time.perf_counter() - t0
    took = time.perf_counter() - started
    # CPU seconds of every rank: on 2 idle cores the wall time is about half of it plus the serial parts,
    # a better guide than the wall time of a loaded machine
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime

    rows = []
    for r in sorted(results.values(), key=lambda r: (FAMILIES.index(r["family"]), r["world_size"], r["mode"])):
        den = r["roles"][DENOISER[r["family"]]]
        rows.append([r["family"], r["mode"], r["world_size"], f"{den['params_local']:,}/{den['params_total']:,}",
                     f"{r['frozen_params_local']:,}/{r['frozen_params_total']:,}",
                     round(r["total_bytes"] / 2**20, 2), round(r["planned_total_bytes"] / 2**20, 2),
                     round(1000 * r["step_time_s_median"], 1) if r["world_size"] == 2 else "-"])
    print(table(["family", "mode", "N", "denoiser here/total", "frozen roles here/total", "model-state MiB/rank",
                 "planned MiB/rank", "median step ms"], rows))
    ratios: dict[str, dict] = {}
    for family in families:
        s, g, z = (results.get(f"{family}_{m}_n2") for m in ("seed_baseline", "zero3_gather", "zero3"))
        if not (s and g):
            continue
        fam = {"step_time_zero3_gather_over_seed": g["step_time_s_median"] / s["step_time_s_median"],
               "model_bytes_zero3_over_seed": g["total_bytes"] / s["total_bytes"],
               "frozen_local_fraction_n2": g["frozen_params_local"] / g["frozen_params_total"]}
        if z:
            fam["step_time_zero3_layerwise_over_seed"] = z["step_time_s_median"] / s["step_time_s_median"]
        ratios[family] = fam
    print("\nN=2, all sharded / seed baseline:")
    print(table(["family", "step time zero3_gather/seed", "zero3 (layerwise)/seed", "model-state bytes/rank",
                 "frozen params held/total"],
                [[f, round(v["step_time_zero3_gather_over_seed"], 3),
                  round(v.get("step_time_zero3_layerwise_over_seed"), 3) if "step_time_zero3_layerwise_over_seed"
                  in v else "-", round(v["model_bytes_zero3_over_seed"], 3), round(v["frozen_local_fraction_n2"], 3)]
                 for f, v in ratios.items()]))
    print(f"\ntook {took:.0f} s (" + ", ".join(f"N={n}: {t:.0f} s" for n, t in launches.items())
          + f"); ranks' CPU time {cpu:.0f} s")
    plot = None
    if "sd" in families and len({r["world_size"] for r in results.values() if r["family"] == "sd"}) > 1:
        plot = plot_memory(results, ROOT / "docs" / "img" / "sd_memory_vs_world.png")
        if plot:
            print(f"plot: {plot}")
    path = write_results("sd_memory_speed", {"runs": results, "ratios": ratios, "took_s": took, "ranks_cpu_s": cpu,
                                             "launch_s": {str(n): t for n, t in launches.items()}},
                         command="python -m benchmarks.sd_memory_speed " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

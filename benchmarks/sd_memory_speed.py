"""SD fine-tune memory per rank and speed: all three roles ZeRO-3 vs the seed baseline (diffusers'
example: only the unet sharded, vae and text_encoder full copies on every rank), same seed and data.

Runs the real recipe (`multiengine run sd_finetune`) with its tiny model for each configuration and
reads each run's summary.json (per-rank memory report rows, peak RSS, step times).

    python -m benchmarks.sd_memory_speed                 # N=2 timing + N=1,2,4 memory, under 5 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# name -> (recipe mode, extra overrides). zero3_gather: the frozen vae/text_encoder are still ZeRO-3
# sharded but gathered whole once per call (RoleSpec.gather_forward) instead of layer by layer.
MODES = {
    "zero3": ("zero3", ["roles.vae.gather_forward=false", "roles.text_encoder.gather_forward=false"]),
    "zero3_gather": ("zero3", ["roles.vae.gather_forward=true", "roles.text_encoder.gather_forward=true"]),
    "seed_baseline": ("seed_baseline", []),
}
ROLES = ("unet", "vae", "text_encoder")


def run(name: str, nproc: int, steps: int, workdir: Path, model_dir: str) -> dict:
    mode, extra = MODES[name]
    out = workdir / f"{name}_n{nproc}"
    cmd = [sys.executable, "-m", "multiengine.recipes.cli", "run", "sd_finetune", "--config", "tiny",
           "--nproc-per-node", str(nproc), f"output_dir={out}", f"mode={mode}", f"max_steps={steps}", *extra,
           f"model.pretrained={model_dir}", f"data.source={workdir / 'data'}", "ema.enabled=false",
           "validation.every=-1", "eval.heldout_size=0", "checkpoint.every=0", "export.enabled=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "summary.json").read_text())


def per_rank_figures(summary: dict) -> dict:
    """Largest per-rank figure over ranks, per role: params held, model-state bytes, peak RSS."""
    out = {}
    for role in ROLES:
        rows = [next(r for r in rank["roles"] if r["role"] == role) for rank in summary["memory"]["per_rank"]]
        out[role] = {
            "params_local": max(r["params_local"] for r in rows),
            "params_total": rows[0]["params_total"],
            "params_persistent": max(r["params_persistent"] for r in rows),
            "bytes": max(r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in rows),
        }
    out["total_bytes"] = sum(out[r]["bytes"] for r in ROLES)
    out["total_params_local"] = sum(out[r]["params_local"] for r in ROLES)
    out["peak_rss_bytes"] = max(rank["peak_rss_bytes"] for rank in summary["memory"]["per_rank"])
    return out


def plot_memory(results: dict, path: Path) -> Path | None:
    """Per-rank parameters held (all three roles) against world size, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    for mode, style in (("seed_baseline", "o--"), ("zero3", "s-")):
        runs = sorted((r for r in results.values() if r["mode"] == mode), key=lambda r: r["world_size"])
        worlds = [r["world_size"] for r in runs]
        ax.plot(worlds, [r["total_params_local"] / 1e6 for r in runs], style, label=mode)
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("parameters held per rank (M)")
    ax.set_title("tiny SD: unet + vae + text_encoder")
    ax.set_xticks(sorted({r["world_size"] for r in results.values()}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="training steps of the N=2 timing runs")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps of the N=1 and N=4 memory runs")
    parser.add_argument("--worlds", default="1,2,4")
    args = parser.parse_args()
    from multiengine.pipelines.diffusion.data import make_shapes_dataset
    from multiengine.pipelines.diffusion.tiny import build_tiny_sd

    from benchmarks.common import table, write_results

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_sd(str(workdir / "tiny_sd"), seed=0, resolution=32)
        make_shapes_dataset(str(workdir / "data"), n=128, resolution=32, seed=0)
        for nproc in [int(w) for w in args.worlds.split(",")]:
            steps = args.steps if nproc == 2 else args.memory_steps
            for name in MODES:
                if name == "zero3_gather" and nproc != 2:
                    continue  # same memory as zero3 between calls; only its speed is in question
                summary = run(name, nproc, steps, workdir, model_dir)
                results[f"{name}_n{nproc}"] = {
                    "mode": name, "world_size": nproc, "steps": steps,
                    "step_time_s_median": summary["metrics"]["step_time_s_median"],
                    "final_loss": summary["metrics"]["final_loss"],
                    **per_rank_figures(summary),
                }
    rows = []
    for r in results.values():
        rows.append([r["mode"], r["world_size"], *(f"{r[role]['params_local']:,}/{r[role]['params_total']:,}"
                                                   for role in ROLES),
                     round(r["total_bytes"] / 2**20, 2), round(r["peak_rss_bytes"] / 2**20),
                     round(1000 * r["step_time_s_median"], 1) if r["world_size"] == 2 else "-"])
    print(table(["mode", "N", "unet params here/total", "vae", "text_encoder", "model-state MiB/rank",
                 "peak RSS MiB", "median step ms"], rows))
    z, s, g = results.get("zero3_n2"), results.get("seed_baseline_n2"), results.get("zero3_gather_n2")
    ratios = {}
    if g and s:
        ratios["step_time_zero3_gather_over_seed"] = g["step_time_s_median"] / s["step_time_s_median"]
        print(f"N=2: step time zero3_gather/seed = {ratios['step_time_zero3_gather_over_seed']:.3f}")
    if z and s:
        ratios = {"step_time_zero3_over_seed": z["step_time_s_median"] / s["step_time_s_median"],
                  "model_bytes_zero3_over_seed": z["total_bytes"] / s["total_bytes"],
                  "peak_rss_zero3_over_seed": z["peak_rss_bytes"] / s["peak_rss_bytes"]}
        frozen_fraction = {r: z[r]["params_local"] / z[r]["params_total"] for r in ("vae", "text_encoder")}
        ratios["frozen_local_fraction_n2"] = frozen_fraction
        print(f"\nN=2: step time zero3/seed = {ratios['step_time_zero3_over_seed']:.3f} (target <= 1.15: "
              f"{'met' if ratios['step_time_zero3_over_seed'] <= 1.15 else 'MISSED'}); model-state bytes "
              f"zero3/seed = {ratios['model_bytes_zero3_over_seed']:.3f}; frozen roles held here: "
              + ", ".join(f"{k} {v:.3f}" for k, v in frozen_fraction.items()))
    plot = plot_memory(results, Path(__file__).resolve().parents[1] / "docs" / "img" / "sd_memory_vs_world.png")
    if plot:
        print(f"plot: {plot}")
    path = write_results("sd_memory_speed", {"runs": results, "ratios": ratios},
                         command="python -m benchmarks.sd_memory_speed " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

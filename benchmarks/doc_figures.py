"""The figures docs/rlhf.md quotes for the shipped tiny RLHF commands, regenerated.

Runs each command exactly as the docs write it, in a scratch working directory (so `outputs/...` is a fresh
folder and a run of the same recipe elsewhere is never reused), one after the other; reads its summary.json
and stores the figures with the date, the wall time, the load average and the code version in
benchmarks/results/doc_figures.json. `--write` rewrites the marked blocks of docs/rlhf.md
(`<!-- figures:NAME -->` ... `<!-- /figures:NAME -->`) from the stored results and copies the runs'
curves.png to docs/img; tests/unit/test_doc_figures.py checks that the docs equal what the results render.

    python -m benchmarks.doc_figures --write                  # every run (about 15 min on 2 CPU ranks), then the docs
    python -m benchmarks.doc_figures --only ppo --write       # the README job only (3-5 min)
    python -m benchmarks.doc_figures --only dr_grpo --workdir /tmp/figs   # needs grpo's SFT export in /tmp/figs
    python -m benchmarks.doc_figures --render --write         # the docs from the stored results, no run
    python -m benchmarks.doc_figures --check                  # exit 1 when the docs differ from the stored results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "rlhf.md"
IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "benchmarks" / "results" / "doc_figures.json"
SCRIPT = "python -m benchmarks.doc_figures"


@dataclass(frozen=True)
class Run:
    name: str
    label: str  # the row's name in the docs' tables
    command: str  # exactly as the docs write it
    note: str  # what the wall time includes
    out: str  # its output_dir, relative to the working directory
    needs: str = ""  # a run whose outputs this one reads
    image: str = ""  # docs/img/<image> <- the run's curves.png


G = "multiengine run rlhf_grpo --config tiny --nproc-per-node 2"
D = "multiengine run rlhf_dpo --config tiny --nproc-per-node 2"
RUNS = [
    Run("ppo", "PPO", "multiengine run rlhf_e2e --config tiny --nproc-per-node 2", "SFT, reward model, PPO",
        "outputs/rlhf_e2e", image="rlhf_tiny_curves.png"),
    Run("grpo", "GRPO", G, "SFT first", "outputs/rlhf_grpo", image="rlhf_grpo_tiny_curves.png"),
    Run("grpo_e2e", "GRPO (e2e)", "multiengine run rlhf_e2e --config tiny --nproc-per-node 2 algorithm=grpo",
        "steps 1, 2 reused", "outputs/rlhf_e2e", needs="ppo"),
    *(Run(algo, label, f"{G} grpo.algorithm={algo} output_dir=outputs/rlhf_grpo_{algo} "
                       "roles.actor.model=outputs/rlhf_grpo/sft/export/actor", "SFT reused",
          f"outputs/rlhf_grpo_{algo}", needs="grpo", image=f"rlhf_{algo}_tiny_curves.png")
      for algo, label in (("dr_grpo", "Dr. GRPO"), ("rloo", "RLOO"), ("reinforce_pp", "REINFORCE++"))),
    Run("dpo", "DPO", D, "SFT first", "outputs/rlhf_dpo", image="rlhf_dpo_tiny_curves.png"),
    Run("ipo", "IPO", f"{D} dpo.loss=ipo output_dir=outputs/rlhf_ipo "
                      "roles.actor.model=outputs/rlhf_dpo/sft/export/actor",
        "SFT reused", "outputs/rlhf_ipo", needs="dpo", image="rlhf_ipo_tiny_curves.png"),
]
BY_NAME = {r.name: r for r in RUNS}


# ---------------------------------------------------------------- running


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "deepspeed", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            continue
    return out


def _code_version() -> dict[str, Any]:
    """The commit, and whether the library or the recipes had uncommitted changes when the run started."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else ""
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": bool(git("status", "--porcelain", "--untracked-files=no", "engines", "pipelines",
                                    "recipes"))}


def _multiengine() -> str:
    """The console script of the interpreter running this, not whichever `multiengine` PATH finds first."""
    beside = Path(sys.executable).with_name("multiengine")
    return str(beside) if beside.exists() else (shutil.which("multiengine") or "multiengine")


def _figures(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers the docs quote, from a run's summary.json."""
    if run.name in ("ppo", "grpo_e2e"):
        steps, algo = summary["steps"], summary["algorithm"]
        final = steps[algo]
        return {"e2e": summary["figures"], "sft": steps["sft"]["metrics"],
                "reward": steps.get("reward", {}).get("metrics", {}), "final": _metrics(final),
                "stage": _stage(final)}
    return {"final": _metrics(summary), "stage": _stage(summary)}


def _metrics(summary: dict[str, Any]) -> dict[str, Any]:
    # the last step's own metrics are in metrics.jsonl already; keep the summary small
    return {k: v for k, v in summary["metrics"].items() if k != "final"}


def _stage(summary: dict[str, Any]) -> int | None:
    return summary.get("roles", {}).get("actor", {}).get("stage")


def run_one(run: Run, workdir: Path) -> dict[str, Any]:
    if run.needs and not (workdir / BY_NAME[run.needs].out / "summary.json").is_file():
        raise SystemExit(f"{run.name} reads the outputs of {run.needs}, which {workdir} does not hold: "
                         f"add --only {run.needs} (it runs first) or pass the --workdir of an earlier run")
    argv = shlex.split(run.command)
    argv[0] = _multiengine()
    load_before = os.getloadavg()
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:  # the 1-minute load average while the run goes
        while not done.wait(10):
            samples.append(os.getloadavg()[0])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.monotonic()
    print(f"[{run.name}] {run.command}  (in {workdir})", flush=True)
    proc = subprocess.run(argv, cwd=workdir, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{run.command} exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    summary = json.loads((workdir / run.out / "summary.json").read_text())
    if run.image and summary.get("plot") and Path(workdir, summary["plot"]).is_file():
        # kept beside the results until --write copies it into docs/img
        shutil.copyfile(Path(workdir, summary["plot"]), workdir / f"{run.name}_curves.png")
    result = {"command": run.command, "date": datetime.date.today().isoformat(), "wall_s": round(wall, 1),
              "load_before": [round(x, 1) for x in load_before],
              "load_during": [round(min(samples or [load_before[0]]), 1), round(max(samples or [load_before[0]]), 1)],
              "versions": _versions(), "code": _code_version(), "figures": _figures(run, summary)}
    print(f"[{run.name}] {_duration(wall)}: {json.dumps(result['figures'].get('e2e') or _headline(result))}",
          flush=True)
    return result


def _headline(result: dict[str, Any]) -> dict[str, Any]:
    m = result["figures"]["final"]
    return {k: m.get(k) for k in ("eval/before/judge", "eval/after/judge", "eval/after/kl", "eval/after/accuracy")}


# ---------------------------------------------------------------- rendering


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def _load(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _f(value: Any, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _signed(value: float) -> str:
    return f"{value:+.2f}".replace("-", "−")


def _judge(result: dict[str, Any]) -> tuple[float, float, float]:
    m = result["figures"]["final"]
    return m["eval/before/judge"], m["eval/after/judge"], m["eval/after/kl"]


def _step_s(result: dict[str, Any]) -> float:
    m = result["figures"]["final"]
    return m.get("time/step_s_mean") or m["step_time_s_mean"]


def _dates(results: dict[str, dict[str, Any]], names: list[str]) -> str:
    by_date: dict[str, list[str]] = {}
    for name in names:
        by_date.setdefault(results[name]["date"], []).append(BY_NAME[name].label)
    if len(by_date) == 1:
        return f"on {next(iter(by_date))}"
    return "on " + ", ".join(f"{d} ({', '.join(labels)})" for d, labels in sorted(by_date.items()))


def _versions_text(result: dict[str, Any]) -> str:
    v = result["versions"]
    return f"DeepSpeed {v.get('deepspeed', '?')} CPU accelerator, torch {v.get('torch', '?')}"


def render_rlhf_e2e(results: dict[str, dict[str, Any]]) -> str:
    r = results["ppo"]
    f, sft, rm, final = (r["figures"][k] for k in ("e2e", "sft", "reward", "final"))
    steps, length = final.get("steps"), final.get("eval/after/response_length", 0)
    tokens_s, ms_token = final["gen/tokens_per_s_mean"] / 1000, final["gen/ms_per_token_mean"]
    rows = [
        ("step 1: held-out loss (random init → SFT)",
         f"{_f(sft.get('eval/before/heldout_loss'), 2)} → {_f(f['sft/heldout_loss'], 2)} "
         "(word entropy of the task ≈ 2.2)"),
        ("step 1: judge score of sampled answers", f"{_f(sft.get('eval/before/judge'), 2)} → **{_f(f['sft/judge'])}**"),
        (f"step 2: held-out pair accuracy ({rm.get('heldout_pairs', 0):.0f} pairs)",
         f"{_f(f['reward/heldout_accuracy_before'])} → **{_f(f['reward/heldout_accuracy'])}**"),
        (f"step 3: judge score of sampled answers, SFT → PPO ({steps} steps)",
         f"**{_f(f['ppo/judge_before'])} → {_f(f['ppo/judge_after'])}**"),
        ("step 3: reward-model score, SFT → PPO",
         f"{_f(f['ppo/reward_before'], 2)} → {_f(f['ppo/reward_after'], 2)}"),
        (f"step 3: KL(π ‖ π_ref) after PPO (exact, per answer of ~{length:.0f} tokens)",
         f"{_f(f['ppo/kl_after'], 2)} nats"),
        ("time per step: SFT / reward model / PPO",
         f"{_f(f['sft/step_s_mean'])} s / {_f(f['reward/step_s_mean'])} s / {_f(f['ppo/step_s_mean'], 2)} s"),
        ("PPO step split: generation / experience / training",
         " / ".join(f"{1000 * f[f'ppo/{k}_s_mean']:.0f} ms" for k in ("generation", "experience", "train"))),
        ("generation throughput (gathered, 2 ranks)",
         f"{tokens_s:.1f}k tokens/s, {ms_token:.1f} ms per decoding step"),
        ("whole run", f"{_duration(r['wall_s'])} (load {r['load_during'][0]:.1f}–{r['load_during'][1]:.1f})"),
    ]
    code = r["code"]
    head = (f"Measured on {r['date']} with `{r['command']}` (2 CPU ranks on a 2-core machine shared with other jobs, "
            f"load average {_load(r['load_before'])} at the start, {_versions_text(r)}, fp32, "
            f"PPO actor at ZeRO-{r['figures']['stage']}; "
            f"commit {code['commit']}{' with uncommitted changes' if code['uncommitted'] else ''}), "
            f"regenerated by `{SCRIPT} --only ppo --write`. Times depend on the machine's load: the run took "
            f"{_duration(r['wall_s'])} here.")
    table = "| | figure |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    return f"{_wrap(head)}\n\n{table}"


ALGO_ROWS = [  # run, recipe cell, roles, reward, batch per rank
    ("ppo", "`rlhf_ppo` (via `rlhf_e2e`)", "actor, critic, ref, reward", "learned reward model", "32 prompts"),
    ("grpo", "`rlhf_grpo`", "actor, ref", "the judge (`builtin:judge`)", "8 prompts × 8 answers"),
    ("grpo_e2e", "`rlhf_e2e algorithm=grpo`", "actor, ref, reward", "learned reward model", "8 prompts × 8 answers"),
    ("dr_grpo", "`rlhf_grpo grpo.algorithm=dr_grpo`", "actor, ref", "the judge", "8 × 8"),
    ("rloo", "`rlhf_grpo grpo.algorithm=rloo`", "actor, ref", "the judge", "8 × 8"),
    ("reinforce_pp", "`rlhf_grpo grpo.algorithm=reinforce_pp`", "actor, ref", "the judge", "8 × 8"),
    ("dpo", "`rlhf_dpo`", "actor, ref", "30k judged pairs, offline", "32 pairs"),
    ("ipo", "`rlhf_dpo dpo.loss=ipo`", "actor, ref", "30k judged pairs, offline", "32 pairs"),
]
LABELS = {"dpo": "DPO (+ chosen NLL)", "ipo": "IPO (+ chosen NLL)"}


def render_algorithms(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| algorithm | recipe | roles | judge, SFT → after | KL after | reward | steps × batch per rank |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, recipe, roles, reward, batch in ALGO_ROWS:
        r = results[name]
        before, after, kl = _judge(r)
        lines.append(f"| {LABELS.get(name, BY_NAME[name].label)} | {recipe} | {roles} | {_f(before)} → **{_f(after)}** "
                     f"| {_f(kl, 2)} | {reward} | {r['figures']['final']['steps']} × {batch} |")
    names = [row[0] for row in ALGO_ROWS]
    return ("\n".join(lines) + f"\n\nMeasured {_dates(results, names)} with the commands below, regenerated by "
            f"`{SCRIPT} --write`.")


def render_algorithm_times(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | exact command | date | wall time | load average (1/5/15 min, before) | time per step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for run in RUNS:
        r = results[run.name]
        stage = r["figures"]["stage"]
        lines.append(f"| {run.label} | `{run.command}` ({run.note}) | {r['date']} | {_duration(r['wall_s'])} "
                     f"| {_load(r['load_before'])} | {_step_s(r):.2f} s (ZeRO-{stage}) |")
    first = results[RUNS[0].name]
    head = (f"Measured on the 2-core machine shared with other jobs ({_versions_text(first)}, fp32); wall times "
            "include the process start and, where noted, training the SFT actor first:")
    return f"{_wrap(head)}\n\n" + "\n".join(lines)


def render_dpo(results: dict[str, dict[str, Any]]) -> str:
    r = results["dpo"]
    m = r["figures"]["final"]
    before, after, kl = _judge(r)
    return (f"held-out accuracy {_f(m.get('eval/before/accuracy'), 0)} → {_f(m['eval/after/accuracy'])}, margin "
            f"{_f(m['eval/after/margin'], 2)} (chosen {_signed(m['eval/after/chosen_reward'])}, rejected "
            f"{_signed(m['eval/after/rejected_reward'])}),\n  judge {_f(before)} → {_f(after)}, KL {_f(kl, 2)} "
            f"(measured {r['date']})")


def render_ipo(results: dict[str, dict[str, Any]]) -> str:
    r = results["ipo"]
    m = r["figures"]["final"]
    before, after, kl = _judge(r)
    return (f"held-out accuracy {_f(m['eval/after/accuracy'])}, implicit reward margin `β·h` "
            f"{_f(m['eval/after/margin'], 2)} (its target is `β/(2β)` = 0.5),\n  KL {_f(kl, 2)}, judge {_f(before)} → "
            f"{_f(after)} (measured {r['date']})")


BLOCKS = {  # marker name -> (renderer, the runs it reads)
    "rlhf_e2e": (render_rlhf_e2e, ["ppo"]),
    "algorithms": (render_algorithms, [row[0] for row in ALGO_ROWS]),
    "algorithm_times": (render_algorithm_times, [r.name for r in RUNS]),
    "dpo": (render_dpo, ["dpo"]),
    "ipo": (render_ipo, ["ipo"]),
}


def _wrap(text: str, width: int = 110) -> str:
    out, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*out, line])


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- figures:{name} -->)(.*?)(<!-- /figures:{name} -->)", re.S)


def render_doc(text: str, results: dict[str, dict[str, Any]]) -> str:
    """`text` with every marked block replaced by its rendering; a block (inline or on its own lines) keeps
    its layout: newlines right inside the markers stay."""
    for name, (render, _) in BLOCKS.items():
        pattern = block_pattern(name)
        match = pattern.search(text)
        if match is None:
            raise SystemExit(f"{DOC} has no <!-- figures:{name} --> block")
        inner = match.group(2)
        pad = ("\n" if inner.startswith("\n") else "", "\n" if inner.endswith("\n") else "")
        body = render(results)
        text = text[:match.start(2)] + pad[0] + body + pad[1] + text[match.end(2):]
    return text


def load_results() -> dict[str, dict[str, Any]]:
    return json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), help="these runs (default: all)")
    parser.add_argument("--workdir", help="where the runs write outputs/ (default: a new temporary folder)")
    parser.add_argument("--render", action="store_true", help="no run: render the stored results")
    parser.add_argument("--write", action="store_true", help="rewrite the docs' blocks and curves")
    parser.add_argument("--check", action="store_true", help="exit 1 when the docs differ from the stored results")
    args = parser.parse_args(argv)
    results = load_results()
    workdir = Path(args.workdir).resolve() if args.workdir else None  # with --render: where to find the curves
    if not (args.render or args.check):
        workdir = workdir or Path(tempfile.mkdtemp(prefix="doc_figures_")).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        for run in [r for r in RUNS if not args.only or r.name in args.only]:
            results[run.name] = run_one(run, workdir)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")  # each run as soon as it ends
    missing = sorted({n for _, names in BLOCKS.values() for n in names} - set(results))
    if missing:
        print(f"no stored results for {missing}: run them ({SCRIPT} --only {' '.join(missing)})", file=sys.stderr)
        return 1
    text = DOC.read_text(encoding="utf-8")
    new = render_doc(text, results)
    if args.check:
        if new != text:
            print(f"{DOC} differs from the stored results: {SCRIPT} --render --write", file=sys.stderr)
            return 1
        return 0
    if args.write:
        DOC.write_text(new, encoding="utf-8")
        for run in RUNS:
            src = workdir / f"{run.name}_curves.png" if workdir else None
            if run.image and src is not None and src.is_file():
                shutil.copyfile(src, IMG / run.image)
        print(f"wrote {DOC.relative_to(ROOT)}")
    else:
        for name, (render, _) in BLOCKS.items():
            print(f"--- {name}\n{render(results)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

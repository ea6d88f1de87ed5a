"""Each config change of issue 13 measured on its own: the PPO step under the factories' old settings
(`legacy`), under `legacy` plus ONE change, under today's defaults (`default`), and written on raw
DeepSpeed (`raw`), all built in one process per ZeRO stage and run interleaved (round after round over
every variant, same prompts), so every variant sees the same load.

Variants (benchmarks/variants.py): +mel_off (memory_efficient_linear false), +buckets (today's "auto"
reduce/prefetch buckets), +persist1e4 (persistence threshold raised to >= 1e4), +overlap (overlap_comm
true), +local_size (LOCAL_SIZE exported: no numactl launch per ZeRO-3 gradient bucket), +ds_adam
(DeepSpeed's CPU Adam); default@persist1e4 / default@persist_ds (today's defaults with a 1e4 floor on
the persistence threshold / DeepSpeed's 1e5), default+overlap / default-overlap (overlap_comm flipped
on / off), default+adamw (torch AdamW).

    python -m benchmarks.config_ablation     # ZeRO-3 and ZeRO-2, both shapes (5.5 min here at load average 6)
    python -m benchmarks.config_ablation --stages 3 --shapes small --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

STAGE_VARIANTS = {
    3: ["legacy", "+mel_off", "+buckets", "+persist1e4", "+overlap", "+local_size", "+ds_adam", "default"],
    # memory_efficient_linear, LOCAL_SIZE and the persistence threshold only act where a ZeRO-3 model exists
    2: ["legacy", "+buckets", "+overlap", "+ds_adam", "default"],
}


def worker(stage: int, shapes: list[str], variants: list[str], rounds: int, warmup: int, model_dir: str) -> None:
    import torch.distributed as dist

    from benchmarks import ppo_harness as H
    from benchmarks.common import emit
    from benchmarks.variants import VARIANTS

    config = "zero3_gather" if stage == 3 else "zero2"
    built: dict[str, Any] = {name: H.Ours(config, model_dir, VARIANTS[name]) for name in variants}
    built["raw"] = H.Raw(stage, model_dir)
    out = {"stage": stage, "buckets": {k: v.buckets() for k, v in built.items() if hasattr(v, "buckets")},
           "shapes": {}}
    for shape in shapes:
        timings = H.interleaved(built, shape, warmup=warmup, rounds=rounds)
        out["shapes"][shape] = {"medians": timings.medians(), "runs": timings.runs,
                                "vs_legacy": timings.paired_ratios("legacy"), "vs_raw": timings.paired_ratios("raw")}
    if dist.get_rank() == 0:
        emit(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="3,2")
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--variants", default="", help="comma list (default: every variant that acts at the stage)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--worker", nargs=2, metavar=("STAGE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if args.worker:
        stage = int(args.worker[0])
        variants = args.variants.split(",") if args.variants else STAGE_VARIANTS[stage]
        worker(stage, shapes, variants, args.rounds, args.warmup, args.worker[1])
        return
    from benchmarks.common import run_ranks, table, write_results
    from benchmarks.ppo_harness import CPU_PHASES, PHASES, tiny_lm

    load_start = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny_opt")
        tiny_lm(model_dir)
        for stage in (int(s) for s in args.stages.split(",")):
            extra = ["--variants", args.variants] if args.variants else []
            results.append(run_ranks("benchmarks.config_ablation", 2,
                                     ["--shapes", args.shapes, "--rounds", str(args.rounds), "--warmup",
                                      str(args.warmup), *extra, "--worker", str(stage), model_dir]))
    load_end = os.getloadavg()
    rows, cpu_rows = [], []
    for r in results:
        for shape, s in r["shapes"].items():
            for name, m in s["medians"].items():
                rows.append([f"zero{r['stage']}", shape, name, *(1000 * m[p] for p in PHASES),
                             *(s["vs_legacy"][name][p] for p in PHASES), s["vs_raw"][name]["total"]])
                cpu_rows.append([f"zero{r['stage']}", shape, name, *(1000 * m[p] for p in CPU_PHASES),
                                 *(s["vs_legacy"][name][p] for p in CPU_PHASES), s["vs_raw"][name]["cpu_total"]])
    print("wall time")
    print(table(["stage", "shape", "variant", "gen ms", "exp ms", "train ms", "total ms", "gen /legacy",
                 "exp /legacy", "train /legacy", "total /legacy", "total /raw"], rows))
    print("\nCPU time of rank 0 (work done, waits excluded: readable on a loaded machine)")
    print(table(["stage", "shape", "variant", "gen ms", "exp ms", "train ms", "total ms", "gen /legacy",
                 "exp /legacy", "train /legacy", "total /legacy", "total /raw"], cpu_rows))
    print(f"\nms: medians of {args.rounds} interleaved rounds after {args.warmup} warm-up step(s) per variant; ratios:"
          f" median over rounds of the ratio within a round; 2 CPU ranks; load average (1 min) {load_start[0]:.2f} at"
          f" start, {load_end[0]:.2f} at end")
    path = write_results("config_ablation", {"world_size": 2, "results": results, "load_average_start": load_start,
                                             "load_average_end": load_end},
                         command="python -m benchmarks.config_ablation " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""rlhf_grpo's DAPO/GSPO variants, dynamic sampling and multi-turn tool episodes in one 2-rank launch, in
process (checked_config + main, as the CLI runs them): a DAPO-style run that learns, a dynamic-sampling run
with a checkpoint at step 2 and its resumption, and the arithmetic task with a calculator tool.

argv: out_dir.
"""

import json
import os
import sys

import torch
from common import dump, finish, link_into
from multiengine.recipes.language.config import checked_config, load_recipe

out = sys.argv[1]
EVAL = ["eval.size=64", "eval.batch_size=32"]


def run(folder: str, config: str, *overrides: str, tiny: str = "") -> dict:
    if tiny:
        # the built-in task's data (~1.3 s to write), as the DAPO run built it with the same seed and sizes
        link_into(folder, {"tiny": tiny})
    # no curves.png or TensorBoard events (the CLI tests check both); the metrics come from metrics.jsonl
    cfg = checked_config("rlhf_grpo", config, [f"output_dir={folder}", "plot=false", "tensorboard=false", *overrides])
    load_recipe("rlhf_grpo").main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json
    with open(os.path.join(folder, "summary.json")) as f:
        metrics = json.load(f)["metrics"]
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    return {"metrics": metrics, "train": [x for x in lines if any(k.startswith("train/") for k in x)]}


results = {}
# 1. DAPO-style: token-level loss, clip-higher, dynamic sampling; the tiny SFT actor trained first
dapo = ["grpo.loss_aggregation=token_mean", "grpo.clip_low=0.2", "grpo.clip_high=0.28", "grpo.dynamic_sampling=true",
        "grpo.max_resample_rounds=3"]
results["dapo"] = run(f"{out}/dapo", "tiny", *dapo, "max_steps=12", "checkpoint.every=0", "checkpoint.keep_last=2",
                      "eval.every=0", *EVAL)
actor = f"{out}/dapo/sft/export/actor"
# 2. resume: 4 steps with a checkpoint at 2, then steps 3-4 again from it (GSPO's sequence ratio, 2 epochs so the
#    ratio moves off 1 and clips; pairs of answers, so that equal judge scores, and dropped groups, are common)
variant = [*dapo, "grpo.importance_level=sequence", "grpo.epochs=2", "grpo.n_samples_per_prompt=2",
           "roles.actor.micro_batch_size=8", f"roles.actor.model={actor}", "eval.size=0", "max_steps=4"]
results["full"] = run(f"{out}/full", "tiny", *variant, "checkpoint.every=2", "checkpoint.keep_last=2",
                      tiny=f"{out}/dapo/tiny")
results["resumed"] = run(f"{out}/resumed", "tiny", *variant, "checkpoint.every=0", "checkpoint.keep_last=2",
                         f"resume_from={out}/full/checkpoints/step_00000002", tiny=f"{out}/dapo/tiny")
# 3. multi-turn episodes with the calculator tool (its SFT actor trained first on the task's demonstrations)
results["multiturn"] = run(f"{out}/multiturn", "tiny_multiturn", "max_steps=10", "eval.every=0", "eval.size=128",
                         "eval.batch_size=32")
dump(results)
finish()

"""Every RLHF recipe, at its tiny config's default stages, on tiny models of other families, in one 2-rank
launch: per family rlhf_sft from the family's base model, then rlhf_reward, rlhf_ppo, rlhf_grpo, rlhf_dpo and
distill from its export (distill into a smaller model of the same family). Shortened to what the assertions
need; the data is the built-in task's, the tokenizer the one saved with the base model (chat template).

argv: out_dir, a JSON file {family: {"base": folder, "student": folder}}.
"""

import json
import os
import sys

import torch
from common import dump, finish, link_into
from multiengine.recipes.language.config import checked_config, load_recipe

out = sys.argv[1]
EVAL = ["eval.size=64", "eval.batch_size=32", "eval.every=0"]
# no curves.png or TensorBoard events (about 0.5 s a run; the CLI tests check both)
QUIET = ["checkpoint.every=0", "checkpoint.keep_last=2", "plot=false", "tensorboard=false"]


def run(folder: str, recipe: str, *overrides: str) -> dict:
    tiny = os.path.join(os.path.dirname(folder), "sft", "tiny")
    if os.path.isdir(tiny):
        # the built-in task's data (30k preference pairs, ~1.3 s to write), built by the family's SFT run: the
        # same seed and sizes every recipe would build it with
        link_into(folder, {"tiny": tiny})
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", *QUIET, *overrides])
    load_recipe(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    return {"metrics": summary["metrics"], "stages": {k: v["stage"] for k, v in summary["roles"].items()}}


results = {}
for family, paths in json.load(open(sys.argv[2])).items():
    root = os.path.join(out, family)
    r = results[family] = {}
    r["sft"] = run(f"{root}/sft", "rlhf_sft", f"roles.actor.model={paths['base']}", *EVAL)
    actor = f"{root}/sft/export/actor"
    r["reward"] = run(f"{root}/reward", "rlhf_reward", f"roles.reward.model={actor}", "max_steps=20", "eval.every=0")
    r["ppo"] = run(f"{root}/ppo", "rlhf_ppo", f"roles.actor.model={actor}",
                   f"roles.reward.model={root}/reward/export/reward", "max_steps=2", "ppo.rollout_batch_size=8",
                   "roles.actor.micro_batch_size=8", "roles.critic.micro_batch_size=8", "ppo.epochs=1", *EVAL)
    r["grpo"] = run(f"{root}/grpo", "rlhf_grpo", f"roles.actor.model={actor}", "max_steps=16", *EVAL)
    r["dpo"] = run(f"{root}/dpo", "rlhf_dpo", f"roles.actor.model={actor}", "max_steps=40",
                   "roles.actor.micro_batch_size=16", "roles.actor.warmup_steps=2", "data.heldout_size=64", *EVAL)
    r["distill"] = run(f"{root}/distill", "distill", f"roles.teacher.model={actor}",
                       f"roles.student.model={paths['student']}", "max_steps=8", "roles.student.micro_batch_size=8",
                       "roles.student.warmup_steps=2", *EVAL)
    r["classes"] = {}
    for step, role in (("sft", "actor"), ("reward", "reward"), ("ppo", "critic"), ("grpo", "actor"),
                       ("dpo", "actor"), ("distill", "student")):
        with open(f"{root}/{step}/export/{role}/config.json") as f:
            r["classes"][f"{step}/{role}"] = json.load(f)["architectures"][0]
dump(results)
finish()

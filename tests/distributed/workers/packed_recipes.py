"""The RLHF recipes and distill on tiny Llama, Qwen2 and Gemma models, fp32, each run twice with the same seed:
``roles.<r>.packing=packed`` on every language-model role, then ``=padded`` (test_packed_passes.py compares their
metrics.jsonl), at ZeRO-2 or ZeRO-3 as RUNS says; GRPO once more packed with a token budget on the actor's
update; some once more packed with positions running on across a packed row (engines.packing.pack patched), which
must differ. Shortened to 2-3 steps, on a folder of split files (sft/reward/ppo/eval.jsonl) with long-tailed
prompt and answer lengths, so that short sequences share packed rows. Each run's calls of engines.packing.pack are
counted, with the rows they packed and the rows those became.

argv: out_dir, a JSON file {family: {"base": folder, "student": folder}, "bpe": folder (a Gemma on a sub-word
tokenizer: ppo_bpe's reward model and critic, which read the rollouts re-encoded), "data": folder}.
"""

import dataclasses
import json
import os
import sys

import torch
from common import dump, finish
from multiengine.engines import packing
from multiengine.recipes.language.config import checked_config, load_recipe

out = sys.argv[1]
F = json.load(open(sys.argv[2]))
QUIET = ["checkpoint.every=0", "plot=false", "tensorboard=false", "eval.every=0", f"data.source={F['data']}"]
EVAL = ["eval.size=16", "eval.batch_size=16"]
NO_EVAL = ["eval.size=0"]
# rollouts: answers of 4 tokens after prompts of up to 24, so that rows with short prompts share packed rows
ROLLOUT = ["generation.max_new_tokens=4", "data.max_prompt_len=24"]
# a dense reward (distinct words; a random tiny model's answers score 0 under the judge, which would leave every
# GRPO advantage at 0) and a multi-turn environment: a first turn of an odd number of characters is answered by a
# tool reply (masked out of the update) and a second turn, then that reward; others end at once, so episodes have
# other lengths and short ones share packed rows. A module in each rank's own folder (no rank waits for another).
HELPERS = os.path.join(out, f"rank{os.environ['RANK']}")
os.makedirs(HELPERS, exist_ok=True)
with open(os.path.join(HELPERS, "packing_env.py"), "w") as f:
    f.write("def distinct_words(prompts, responses):\n"
            "    return [len(set(r.split())) / 6.0 for r in responses]\n\n\n"
            "class Env:\n"
            "    def reset(self, prompt):\n        self.turns = 0\n        return prompt\n"
            "    def step(self, turn):\n        self.turns += 1\n"
            "        if self.turns == 1 and len(turn) % 2:\n            return 'apple pear plum', 0.0, False\n"
            "        return None, len(set(turn.split())) / 6.0, True\n")
sys.path.insert(0, HELPERS)
DENSE = "reward.functions=[packing_env:distinct_words]"

# every packed pass of a run goes through engines.packing.pack: counted, with the rows it packed and the rows they
# became
PACK, PACKED = packing.pack, {"calls": 0, "rows": 0, "packed_rows": 0}


def counted(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int = 0) -> packing.Packed:
    p = PACK(input_ids, attention_mask, capacity)
    PACKED["calls"] += 1
    PACKED["rows"] += input_ids.shape[0]
    PACKED["packed_rows"] += p.input_ids.shape[0]
    return p


def running(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int = 0) -> packing.Packed:
    """``pack`` with positions counting on across a packed row: its sequences are not told apart."""
    p = counted(input_ids, attention_mask, capacity)
    return dataclasses.replace(p, position_ids=torch.arange(p.input_ids.shape[1]).expand_as(p.input_ids).clone())

GRPO = ["grpo.rollout_batch_size=4", DENSE, *ROLLOUT, *NO_EVAL]
# advantages not whitened: a policy loss of mean-zero advantages is a difference of O(1) terms ~1000 times its size,
# whose rounding a 1e-5 relative comparison would read
PPO = ["roles.critic.micro_batch_size=4", "ppo.epochs=2", "ppo.whiten_advantages=false", *ROLLOUT, *NO_EVAL]

# name: recipe, the LM roles, overrides (the family's models, the stages, 2-3 steps)
ll, qw, ge = F["llama"]["base"], F["qwen2"]["base"], F["gemma"]["base"]
RUNS = {
    "sft_llama_z2": ("rlhf_sft", ("actor",), [f"roles.actor.model={ll}", "roles.actor.stage=2", "max_steps=3", *EVAL]),
    "sft_qwen2_z3": ("rlhf_sft", ("actor",), [f"roles.actor.model={qw}", "roles.actor.stage=3", "max_steps=3", *EVAL]),
    "reward_llama_z3": ("rlhf_reward", ("reward",), [f"roles.reward.model={ll}", "roles.reward.stage=3",
                                                     "max_steps=3"]),
    "reward_gemma_z2": ("rlhf_reward", ("reward",), [f"roles.reward.model={ge}", "roles.reward.stage=2",
                                                     "max_steps=3"]),
    "dpo_qwen2_z2": ("rlhf_dpo", ("actor", "ref"), [f"roles.actor.model={qw}", "roles.actor.stage=2", "max_steps=3",
                                                    *EVAL]),
    "dpo_llama_z3": ("rlhf_dpo", ("actor", "ref"), [f"roles.actor.model={ll}", "roles.actor.stage=3", "max_steps=3",
                                                    *EVAL]),
    "grpo_gemma_z2": ("rlhf_grpo", ("actor", "ref"), [f"roles.actor.model={ge}", "roles.actor.stage=2",
                                                      "max_steps=2", *GRPO]),
    "grpo_llama_z3": ("rlhf_grpo", ("actor", "ref"), [f"roles.actor.model={ll}", "roles.actor.stage=3",
                                                      "max_steps=2", *GRPO]),
    "multiturn_qwen2_z3": ("rlhf_grpo", ("actor", "ref"), [
        f"roles.actor.model={qw}", "roles.actor.stage=3", "max_steps=2", "grpo.rollout_batch_size=4",
        "grpo.env=packing_env:Env", "grpo.max_turns=2", "grpo.max_total_tokens=48", "reward.functions=[]",
        *ROLLOUT, *NO_EVAL]),
    "ppo_llama_z3": ("rlhf_ppo", ("actor", "critic", "ref", "reward"), [
        f"roles.actor.model={ll}", "roles.reward.model={reward}", "roles.actor.stage=3", "roles.critic.stage=3",
        "max_steps=2", "ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=4",
        *PPO]),
    "ppo_qwen2_z2": ("rlhf_ppo", ("actor", "critic", "ref", "reward"), [
        f"roles.actor.model={qw}", f"roles.reward.model={qw}", "roles.actor.stage=2", "roles.critic.stage=2",
        "max_steps=2", "ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=4",
        *PPO]),
    "ppo_bpe_gemma_z3": ("rlhf_ppo", ("actor", "critic", "ref", "reward"), [
        f"roles.actor.model={ge}", f"roles.reward.model={F['bpe']}", "roles.actor.stage=3", "roles.critic.stage=3",
        "max_steps=2", "ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=4",
        *PPO]),
    "distill_gemma_z2": ("distill", ("teacher", "student"), [
        f"roles.teacher.model={ge}", f"roles.student.model={F['gemma']['student']}", "roles.teacher.stage=2",
        "roles.student.stage=2", "max_steps=3", "roles.student.micro_batch_size=8", *EVAL]),
    "onpolicy_llama_z3": ("distill", ("teacher", "student"), [
        f"roles.teacher.model={ll}", f"roles.student.model={F['llama']['student']}", "roles.teacher.stage=3",
        "roles.student.stage=3", "max_steps=2", "roles.student.micro_batch_size=8", "distill.on_policy_fraction=1.0",
        *EVAL]),
}
EXTRA = {"grpo_llama_z3": ("budget",), **{name: ("running",) for name in ("sft_llama_z2", "dpo_qwen2_z2",
                                                                           "grpo_gemma_z2", "distill_gemma_z2")}}
BUDGET = ["roles.actor.token_budget=96"]


def run(folder: str, recipe: str, overrides: list[str]) -> None:
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", "seed=0", *QUIET, *overrides])
    load_recipe(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes metrics.jsonl


folders, packed = {}, {}
for name, (recipe, roles, overrides) in RUNS.items():
    reward = os.path.join(out, "reward_llama_z3-padded", "export", "reward")
    overrides = [o.format(reward=reward) for o in overrides]
    dtypes = [f"roles.{r}.dtype=fp32" for r in roles]
    for mode in ("padded", "packed", *EXTRA.get(name, ())):
        folder = folders[f"{name}/{mode}"] = os.path.join(out, f"{name}-{mode}")
        how = "padded" if mode == "padded" else "packed"
        PACKED.update(calls=0, rows=0, packed_rows=0)
        packing.pack = running if mode == "running" else counted
        run(folder, recipe, [*overrides, *dtypes, *(f"roles.{r}.packing={how}" for r in roles),
                             *BUDGET * (mode == "budget")])
        packed[f"{name}/{mode}"] = dict(PACKED)
dump({"folders": folders, "packed": packed})
finish()

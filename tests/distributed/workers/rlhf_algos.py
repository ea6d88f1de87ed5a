"""Critic-free RL and DPO on 2 ranks, several registries in one process group (one launch keeps the test short):

  grpo_z2   actor ZeRO-2 (ref asked for ZeRO-2: built at stage 0), a Python reward function from a file;
            2 GRPO steps, then one step each of dr_grpo, rloo and reinforce_pp on the same roles
  grpo_z3   actor and ref ZeRO-3 and no reward role at all, the same steps with the same seed; then a ZeRO-3
            reward model is added to that registry (an incremental build) and GRPO runs with the function plus
            the reward model (weighted sum) for 2 steps
  dpo_z2    policy ZeRO-2, ref ZeRO-3: 2 DPO steps (2 micro-batches of 2 pairs each), held-out accuracy;
            reference log-probs precomputed once vs a ref forward
  dpo_z3    policy and ref ZeRO-3: the same 2 steps

argv: out_dir
"""

from __future__ import annotations

import gc
import os

import torch
from common import dump, gathered_state_dict, out_dir
from multiengine.engines import EngineRegistry, OptimSpec, Placement, barrier, frozen_role, trainable_role
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PairCollator, PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.dpo import DPOSettings, DPOTrainer
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
from multiengine.pipelines.rlhf.preference import PreferenceCollator
from multiengine.pipelines.rlhf.rewards import reward_function, reward_model
from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model
from multiengine.pipelines.rlhf.rollout import RolloutSpec
from transformers import AutoTokenizer

ROOT = out_dir()
ASSETS = os.path.join(ROOT, "assets")
KEYS = ("reward/mean", "reward/std", "judge/mean", "kl", "policy_loss", "kl_loss", "approx_kl", "clip_frac",
        "entropy", "response_length", "reward/group_std", "reward/distinct_words", "reward/reward")

REWARD_FILE = os.path.join(ROOT, "my_rewards.py")

registry0 = EngineRegistry()  # the process group; rank 0 writes the tiny assets and a user's reward file
if registry0.is_main:
    tiny.prepare_builtin(ASSETS, seed=0, hidden=32, layers=2, n_sft=16, n_reward=64, n_ppo=64, n_eval=16)
    # a dense reward (distinct words per answer): a random tiny model's answers score 0 under the judge,
    # which would leave every GRPO advantage at 0
    with open(REWARD_FILE, "w") as f:
        f.write("def distinct_words(prompts, responses):\n"
                "    return [len(set(r.split())) / 6.0 for r in responses]\n")
barrier()
MODEL = os.path.join(ASSETS, "model")
TOK = AutoTokenizer.from_pretrained(MODEL)
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
PROMPTS = load_rlhf_dataset(os.path.join(ASSETS, "data"), "ppo")
PAIRS = load_rlhf_dataset(os.path.join(ASSETS, "data"), "reward")
PROMPT_COLLATE = PromptCollator(TOK, 16)
PAIR_COLLATE = PreferenceCollator(PairCollator(TOK, 16, 8))
GEN = GenerationSettings(max_new_tokens=6)
DENSE = reward_function(f"{REWARD_FILE}:distinct_words")


def decode(ids: torch.Tensor) -> list[str]:
    return TOK.batch_decode(ids.cpu(), skip_special_tokens=True)


def prompts(step: int, rank: int) -> dict:
    start = (step * 2 + rank) * 2  # 2 prompts per rank per step, disjoint across ranks and steps
    return PROMPT_COLLATE([PROMPTS[i] for i in range(start, start + 2)])


def build(actor_stage: int, ref_stage: int, lr: float = 1e-3, grad_accum: int = 1, micro: int = 4) -> EngineRegistry:
    registry = EngineRegistry()
    registry.add(trainable_role("actor", causal_lm(MODEL), Placement(actor_stage, "fp32"),
                                OptimSpec(lr=lr, total_steps=10), micro_batch_size=micro, grad_accum=grad_accum))
    registry.add(frozen_role("ref", causal_lm(MODEL), Placement(ref_stage, "fp32")))
    return registry.build()


def grpo(registry: EngineRegistry, algorithm: str, sources=(DENSE,), **kw) -> GRPOTrainer:
    settings = GRPOSettings(algorithm=algorithm, n_samples_per_prompt=4, rollout_batch_size=2,
                            epochs=2 if algorithm == "grpo" else 1, **kw)
    return GRPOTrainer(registry, settings, RolloutSpec(GEN, EOS, PAD, list(sources), decode, judge=tiny.judge), 4)


def grpo_run(registry: EngineRegistry) -> dict:
    out: dict = {"stages": {r.name: r.stage for r in registry.roles()}, "steps": []}
    schedule = [("grpo", 0), ("grpo", 1), ("dr_grpo", 2), ("rloo", 3), ("reinforce_pp", 4)]
    for algorithm, step in schedule:
        trainer = grpo(registry, algorithm)
        if algorithm == "reinforce_pp":
            # whitening is global: the masked advantages of this rank alone need not have mean 0
            exp = trainer.make_experience(prompts(step, registry.rank), step)
            m = exp.action_mask.float()
            out["reinforce_pp_local"] = {"sum": float((exp.advantages * m).sum()),
                                         "sum_sq": float((exp.advantages ** 2 * m).sum()), "count": float(m.sum())}
        metrics = trainer.step(prompts(step, registry.rank), step)
        out["steps"].append({"algorithm": algorithm, **{k: metrics[k] for k in KEYS if k in metrics}})
    return out


def free(*objs) -> None:
    del objs
    gc.collect()
    barrier()


result: dict = {}

# --- GRPO family: ZeRO-2 vs ZeRO-3, the same seed ----------------------------------------------------
registry = build(2, 2)
result["grpo_z2"] = grpo_run(registry)
free(registry)

registry = build(3, 3)
result["grpo_z3"] = grpo_run(registry)
result["grpo_z3"]["names"] = registry.names()  # the function alone: no reward role was built
# --- with a reward model as well: the function + 0.5 x reward-model score--------------------------------
registry.add(frozen_role("reward", scalar_model(MODEL, zero3=True), Placement(3, "fp32")))
registry.build()  # builds only the new role; the actor keeps its trained weights
before = gathered_state_dict(registry, "actor")
trainer = grpo(registry, "grpo", sources=(DENSE, reward_model("reward", weight=0.5)))
exp = trainer.make_experience(prompts(5, registry.rank), 5)
dense = torch.tensor([len(set(a.split())) / 6.0 for a in exp.responses])
with_rm = {"score_vs_parts": float((exp.score - (dense + 0.5 * exp.reward_parts["reward"])).abs().max()),
           "fn_vs_part": float((dense - exp.reward_parts["distinct_words"]).abs().max()),
           "steps": [{k: m[k] for k in KEYS if k in m} for m in (trainer.step(prompts(s, registry.rank), s)
                                                                 for s in (5, 6))],
           "stages": {r.name: r.stage for r in registry.roles()}}
after = gathered_state_dict(registry, "actor")
if registry.is_main:
    with_rm["actor_change"] = max((before[k] - after[k]).abs().max().item() for k in before)
result["grpo_z3_rm"] = with_rm
free(registry, trainer, before, after)


# --- DPO: policy ZeRO-2 + ref ZeRO-3, then policy ZeRO-3 + ref ZeRO-3 ------------------------------------
def dpo_run(policy_stage: int) -> dict:
    registry = build(policy_stage, 3, lr=1e-2, grad_accum=2, micro=2)
    trainer = DPOTrainer(registry, DPOSettings(beta=0.1))
    mine = [PAIRS[i] for i in range(registry.rank * 8, registry.rank * 8 + 8)]
    held_out = [PAIR_COLLATE([PAIRS[i] for i in range(32 + registry.rank * 4, 36 + registry.rank * 4)])]
    out: dict = {"stages": {r.name: r.stage for r in registry.roles()}, "eval_before": trainer.evaluate(held_out)}
    ref_before = gathered_state_dict(registry, "ref")
    out["steps"] = [trainer.step(PAIR_COLLATE(mine[j:j + 4])) for j in (0, 4)]
    out["eval_after"] = trainer.evaluate(held_out)
    # reference log-probs precomputed once (each rank scores a share, all ranks get all rows) == a ref forward
    cached = trainer.precompute_reference(PAIRS.select(range(10)), PAIR_COLLATE, batch_size=4)
    batch = PAIR_COLLATE([PAIRS[i] for i in range(10)])
    on_the_fly = trainer.reference_logprobs({k: v.to(registry.device) if torch.is_tensor(v) else v
                                             for k, v in batch.items()})
    pre = torch.tensor([[r["ref_chosen_logp"], r["ref_rejected_logp"]] for r in cached])
    out["precomputed_vs_forward"] = float((pre - torch.stack(on_the_fly, 1).cpu()).abs().max())
    out["n_cached"] = len(cached)
    ref_after = gathered_state_dict(registry, "ref")
    if registry.is_main:
        out["ref_change"] = max((ref_before[k] - ref_after[k]).abs().max().item() for k in ref_before)
    free(registry, trainer)
    return out


result["dpo_z2"] = dpo_run(2)
result["dpo_z3"] = dpo_run(3)
dump(result)
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

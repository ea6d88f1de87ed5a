"""`plan` with roles.rollout.ranks: the DeepSpeed roles partitioned over the trainer GPUs only, each rollout GPU
holding a whole rollout engine, and a --gpus count the placement cannot split refused naming the key."""

from __future__ import annotations

import pytest
from multiengine.engines import planner as P
from multiengine.engines.settings import SettingsError
from multiengine.recipes.language import cli, plans
from multiengine.recipes.language.config import load_config, load_recipe

LLAMA_8B = 8_030_261_248  # meta-llama/Llama-3.1-8B, built in (engines/known_models.py)


def _plan(recipe: str, config: str, gpus: int, overrides: list[str] = ()) -> list[P.Plan]:
    cfg = load_config(recipe, config, list(overrides))
    return plans.plan_recipe(load_recipe(recipe), cfg, P.budget_for(gpus, "80GiB"))[1]


def _states(result: P.Plan, role: str, choice: P.Choice) -> P.StateBytes:
    return next(o.states for o in result.role(role).options if o.choice == choice)


def test_deepspeed_roles_are_partitioned_over_the_trainer_gpus_only():
    trainers, rollouts = _plan("rlhf_grpo", "llama3_8b_async", 8)
    alone_6 = _plan("rlhf_grpo", "llama3_8b_async", 6, ["roles.rollout.ranks=[]"])[0]
    alone_8 = _plan("rlhf_grpo", "llama3_8b_async", 8, ["roles.rollout.ranks=[]"])[0]
    assert (trainers.budget.world_size, rollouts.budget.world_size) == (6, 2)
    stage3 = P.Choice(3)
    for role in ("actor", "ref"):  # ZeRO-3 shards over 6 ranks: as a 6-GPU job with no rollout ranks, not 8
        placed = _states(trainers, role, stage3)
        assert placed == _states(alone_6, role, stage3) != _states(alone_8, role, stage3)
    actor = _states(trainers, "actor", stage3)
    assert actor.optimizer == 12 * -(-LLAMA_8B // 6)  # Adam's fp32 master and moments, a sixth each
    assert actor.params > 2 * LLAMA_8B // 6
    # the rollout engine is on the rollout GPUs, not beside the DeepSpeed roles (colocated vLLM is)
    assert "rollout" not in [r.request.name for r in trainers.roles]
    assert "rollout" in [r.request.name for r in alone_8.roles]
    assert trainers.fits and rollouts.fits and trainers.current_fits and rollouts.current_fits


def test_a_rollout_gpu_holds_the_whole_vllm_engine_and_its_kv_cache():
    rollouts = _plan("rlhf_grpo", "llama3_8b_async", 8)[1]
    assert [r.request.name for r in rollouts.roles] == ["rollout"]
    engine = rollouts.role("rollout").chosen
    assert engine.choice == P.Choice(0) and rollouts.role("rollout").request.params == LLAMA_8B
    # bf16 weights + roles.rollout.kv_cache_gb
    assert (engine.states.accelerator, engine.transient, engine.transient_phase) == (2 * LLAMA_8B, 32 * P.GIB,
                                                                                     "KV cache")
    assert rollouts.fixed == P.CUDA_CONTEXT_BYTES  # one process per rollout GPU, no NCCL (a gloo bridge)
    base = 2 * LLAMA_8B + 32 * P.GIB + rollouts.fixed
    assert rollouts.total == base + int(base * P.FRAGMENTATION_MARGIN)


def test_a_rollout_gpu_with_transformers_holds_the_actor_and_one_trainer_ranks_generation():
    trainers, rollouts = _plan("rlhf_grpo", "llama3_8b_async", 8, ["generation.engine=hf"])
    engine = rollouts.role("rollout")
    dims = P.transformer_dims(plans.resolve_model("meta-llama/Llama-3.1-8B", "actor").config)
    generate = dict(plans.lm_phases(dims, "bf16", generate=(4 * 8, 256, 512)))["generation"]  # 4 prompts x 8
    assert engine.chosen.states.accelerator == 2 * LLAMA_8B
    assert (engine.chosen.transient, engine.chosen.transient_phase) == (generate, "generation")
    # on the trainer GPUs the actor generates the evaluation answers only (eval.batch_size 16)
    assert dict(trainers.role("actor").request.phases)["generation"] == dict(
        plans.lm_phases(dims, "bf16", generate=(16, 256, 512)))["generation"]


def test_ppo_places_actor_critic_ref_and_reward_on_the_trainer_gpus():
    trainers, rollouts = _plan("rlhf_ppo", "tiny", 4, ["roles.rollout.ranks=[2,3]"])
    assert (trainers.budget.world_size, rollouts.budget.world_size) == (2, 2)
    assert {r.request.name for r in trainers.roles} >= {"actor", "critic", "ref", "reward"}
    assert [r.request.name for r in rollouts.roles] == ["rollout"]
    actor = trainers.role("actor").request
    assert rollouts.role("rollout").chosen.states.accelerator == P.DTYPE_BYTES[actor.dtype] * actor.params


@pytest.mark.parametrize("gpus, problem", [(4, "must be the job's last ranks"), (2, "leaves no rank to train"),
                                            (1, "needs at least 2 ranks")])
def test_gpus_the_placement_cannot_split_are_refused_naming_the_key(gpus, problem):
    with pytest.raises(SettingsError, match=rf"roles\.rollout\.ranks' does not fit --gpus {gpus}: {problem}"):
        _plan("rlhf_grpo", "llama3_8b_async", gpus)


def test_the_cli_says_which_gpus_are_which(capsys):
    args = ["plan", "rlhf_grpo", "--config", "llama3_8b_async", "--gpu-mem", "80GiB"]
    assert cli.main([*args, "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "== plan: rlhf_grpo, 6 trainer GPUs" in out and "== plan: rlhf_grpo, 2 rollout GPUs" in out
    assert out.count("note: 6 trainer GPUs + 2 rollout GPUs (roles.rollout.ranks=[6, 7])") == 2
    assert "fits: " in out and "does not fit" not in out
    assert cli.main([*args, "--gpus", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: config key 'roles.rollout.ranks' does not fit --gpus 7") and len(err) == 1

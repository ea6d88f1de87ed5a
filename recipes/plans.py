"""The memory plans of rlhf_ppo and rlhf_grpo (what `multiengine plan` sizes), until they move into their recipe
classes as every other recipe's plan has."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiengine.recipes.language.plans import RecipePlan, RoleKeys, _current, _lora, _role, _scalar


def rlhf_ppo(cfg: Any, assume: Mapping[str, str] | None = None) -> list[RecipePlan]:
    """Actor, critic, a frozen ref, the reward-model roles and an EMA of the actor (ema.enabled)."""
    from . import common

    r, g, d = cfg.roles, cfg.generation, cfg.data
    actor_info = common.lm_info(cfg, r.actor.model, "actor", assume)
    prompt, new, rollout = d.max_prompt_len, g.max_new_tokens, cfg.ppo.rollout_batch_size
    rewards, reward_infos = common.reward_plan(cfg, rollout, assume)
    # the critic's folder as the recipe resolves it: roles.critic.model, else the reward model's (its
    # declaration), else the first reward model, else the actor's with a fresh head (rewards from functions only)
    if r.critic.model or (assume and "critic" in assume):
        critic_info = _scalar(common.lm_info(cfg, r.critic.model, "critic", assume))
    elif reward_infos:
        critic_info = reward_infos.get("reward") or next(iter(reward_infos.values()))
    else:
        critic_info = _scalar(actor_info)
    plan = common.policy_plan("rlhf_ppo", f"generation: {rollout} prompts x ({prompt} + {new}) tokens per rank, mode "
                              f"{g.mode}; updates on {r.actor.micro_batch_size} rows (critic "
                              f"{r.critic.micro_batch_size}) per forward/backward", cfg,
                              {"actor": actor_info, "critic": critic_info}, True, rollout, rollout, rewards)
    if cfg.ema.enabled:  # the actor's weights (and adapters) at the actor's stage
        plan.roles.append(_role("ema", actor_info, r.ema.effective_dtype, trainable=False, lora=_lora(r.actor.lora),
                                current=_current(plan.roles[0].current.stage, False, r.ema.offload_params),
                                follows="actor", note="built at the actor's stage"))
        plan.keys["ema"] = RoleKeys(None, "roles.ema.offload_params")
    return [plan]


def rlhf_grpo(cfg: Any, assume: Mapping[str, str] | None = None) -> list[RecipePlan]:
    """Actor, a frozen ref (none when ``grpo.kl_coef`` is 0) and the reward-model roles; no critic. A rollout is
    ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows per rank, generated and scored in one batch; the
    update runs on ``roles.actor.micro_batch_size`` rows at a time."""
    from . import common

    gr, g, a = cfg.grpo, cfg.generation, cfg.roles.actor
    info = common.lm_info(cfg, a.model, "actor", assume)
    prompt, new = cfg.data.max_prompt_len, g.max_new_tokens
    rows = gr.rollout_batch_size * gr.n_samples_per_prompt
    rows_gen = max(rows, cfg.eval.batch_size if cfg.eval.size else 0)
    note = (f"rollout: {gr.rollout_batch_size} prompts x {gr.n_samples_per_prompt} samples = {rows} rows of "
            f"({prompt} + {new}) tokens per rank, generation mode {g.mode}; updates on {a.micro_batch_size} "
            "rows per forward/backward")
    return [common.policy_plan("rlhf_grpo", note, cfg, {"actor": info}, gr.kl_coef > 0, rows, rows_gen,
                               common.reward_plan(cfg, rows_gen, assume)[0])]

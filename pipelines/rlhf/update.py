"""The policy (and optional value) update over one frozen rollout: epochs x minibatches, each minibatch a
forward/backward/step of the actor (the settings' policy loss [+ KL loss] [+ ptx]) and, with a critic, of the critic
(clipped value loss).

Normalisation: each micro-batch's loss is divided by the global count of normalisation units of its optimizer step
(tokens, or rows for the sequence modes; all ranks, all micro-batches) over ``W * G``, so after DeepSpeed's averaging
the gradient is that of the whole step's batch in one piece, independent of the data-parallel size and of how rows
are spread (losses.aggregate_loss).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum, moe
from multiengine.engines.packing import budget_split, lm_forward, token_budget

from . import ppo
from .losses import PolicyLossInputs, kl_loss, logprob_mismatch, loss_units, policy_loss, truncated_is_weights
from .rollout import Experience, RolloutSpec, StepStats
from .scoring import lm_logprobs
from .steps import causal_lm_loss

__all__ = ["minibatch_indices", "train_on_experience"]


def minibatch_indices(n_rows: int, mini_batch_size: int, shuffle: bool = True, seed: int = 0, step: int = 0,
                      epoch: int = 0) -> list[torch.Tensor]:
    """Row indices of the minibatches of one epoch. The permutation is seeded by ``(seed, step, epoch)`` only (not
    the rank), so every rank shuffles its own rows the same way."""
    if n_rows % mini_batch_size:
        raise ValueError(f"{n_rows} rollout rows per rank are not a multiple of the micro batch {mini_batch_size}.")
    if shuffle:
        order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 31 + step * 1009 + epoch))
    else:
        order = torch.arange(n_rows)
    return list(order.split(mini_batch_size))


class _Micro(NamedTuple):
    rows: torch.Tensor
    step: int  # the optimizer step (within the epoch) it belongs to
    last: bool  # the step's last micro-batch: the optimizer steps after it
    count: int  # micro-batches in its step (the engine divides each loss by its gradient accumulation steps)


def _plan(exp: Experience, epochs: dict[str, list[list[torch.Tensor]]], groups: list[tuple[str, str, int, int]],
          registry: EngineRegistry) -> tuple[dict[str, list[list[_Micro]]], dict[tuple[str, int, int], torch.Tensor]]:
    """Each role's micro-batches per epoch and every optimizer step's loss denominator (``(role, epoch, step) ->
    global units / (W * G)``), from one all-reduce. ``epochs[role]``: its fixed-size minibatches per epoch, ``G`` of
    them one optimizer step. With a token budget a step's rows are spread over balanced micro-batches of at most that
    many tokens, as many on every rank as the rank that needs most (the same all-reduce). The rows of each step are
    fixed before it runs (the minibatch order is seeded) and the units only count the action mask, so all can be
    summed up front."""
    world, rank = registry.world_size, registry.rank
    keys, local, counts, splits = [], [], [], {}
    for role, mode, g, budget in groups:
        lengths = (exp.critic_attention_mask if role == "critic" and exp.critic_sequences is not None
                   else exp.attention_mask).sum(-1)
        for e, micro in enumerate(epochs[role]):
            for start in range(0, len(micro), g):
                keys.append((role, e, start // g))
                local.append(sum(float(loss_units(exp.action_mask[idx], mode)) for idx in micro[start:start + g]))
                if budget:
                    rows = torch.cat(micro[start:start + g])
                    splits[keys[-1]] = (rows, lengths[rows].tolist(), budget)
                    counts.append(len(budget_split(splits[keys[-1]][1], budget)))
    if not keys:
        return {}, {}
    slots = torch.zeros(len(counts) * world, dtype=torch.float64)
    slots[rank::world] = torch.tensor(counts, dtype=torch.float64)
    totals = all_reduce_sum(torch.cat([torch.tensor(local, dtype=torch.float64), slots])).tolist()
    most = [int(max(totals[len(keys) + i * world:len(keys) + (i + 1) * world])) for i in range(len(counts))]
    g_of = {role: g for role, _, g, _ in groups}
    plan: dict[str, list[list[_Micro]]] = {role: [[] for _ in epochs[role]] for role, *_ in groups}
    for key in keys:
        role, e, step = key
        g = g_of[role]
        if key in splits:
            rows, lengths, budget = splits[key]
            bins = budget_split(lengths, budget, most.pop(0))
            plan[role][e] += [_Micro(rows[b], step, i == len(bins) - 1, len(bins)) for i, b in enumerate(bins)]
        else:
            fixed = epochs[role][e][step * g:(step + 1) * g]
            plan[role][e] += [_Micro(idx, step, i == g - 1, g) for i, idx in enumerate(fixed)]
    return plan, {key: torch.tensor(total / (world * g_of[key[0]]), dtype=torch.float32, device=registry.device)
                  for key, total in zip(keys, totals)}


def train_on_experience(registry: EngineRegistry, exp: Experience, step: int, settings: Any, spec: RolloutSpec,
                        micro_batch_size: int, critic_micro_batch_size: int | None = None, *, train_actor: bool = True,
                        ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None,
                        stats: StepStats | None = None) -> dict[str, float]:
    """``settings.epochs`` passes of minibatches over one frozen rollout (collective: one all-reduce for every loss
    denominator, one for the statistics).

    ``settings`` (a PPOSettings or GRPOSettings) names the policy loss (``objective``) and its hyper-parameters, the
    ``aggregation`` of the policy and KL losses (Dr. GRPO's horizon is ``spec.generation.max_new_tokens``), the KL
    loss term (``kl_loss_coef``, k3 clamped to ``kl_clamp``; 0 = none, e.g. when it is in the reward), the critic's
    ``value_clip`` and, with ``ptx_batches`` (SFT batches for PPO-ptx), ``ptx_coef``; ``shuffle_minibatches`` with
    ``spec.seed`` orders the rows. ``spec`` names the actor and the critic to train (None: critic-free) and the
    temperature the log-probs divide by. ``micro_batch_size`` / ``critic_micro_batch_size`` (None = the actor's):
    rows per forward/backward of each role; an epoch's minibatches must be a multiple of each engine's gradient
    accumulation steps, and with a token budget (``RoleSpec.token_budget``) each optimizer step's rows are spread over
    balanced micro-batches of at most that many tokens instead (the same gradient). ``train_actor`` False: a critic
    warm-up. With ``stats`` the statistics are added to it (the caller reduces them with the step's others) and ``{}``
    is returned.

    Returns global means over ranks and micro-batches: ``policy_loss`` / ``value_loss`` / ``kl_loss`` (per optimizer
    step), ``clip_frac``, ``clip_low_frac`` / ``clip_high_frac`` (tokens clipped below with ``A < 0`` / above with
    ``A > 0``), ``approx_kl``, ``ratio_mean``, ``entropy``, ``value_clip_frac``, ``ptx_loss``, ``kl_loss_kl`` (the
    mean per-token estimate).
    """
    s, critic, temperature = settings, spec.critic, spec.generation.temperature
    is_cap = s.rollout_is_cap  # truncated importance sampling of rows that carry their sampler's log-probs
    kl_coef, aggregation, horizon = s.kl_loss_coef, s.aggregation, spec.generation.max_new_tokens
    if exp.advantages is None:
        raise ValueError("the experience has no advantages: run an estimator first.")
    if kl_coef and exp.ref_logprobs is None:
        raise ValueError("kl_coef > 0 (KL as a loss term) needs ref log-probs: build a ref role.")
    if critic is not None and (exp.returns is None or exp.values is None):
        raise ValueError(f"training the critic {critic!r} needs returns and rollout values (GAE).")
    world = registry.world_size
    actor_engine = registry[spec.actor]
    critic_engine = registry[critic] if critic is not None else None
    g_actor = actor_engine.gradient_accumulation_steps()
    g_critic = critic_engine.gradient_accumulation_steps() if critic_engine is not None else 1
    C = exp.context_length
    sums: dict[str, float] = {}
    n_micro, n_steps = {"actor": 0, "critic": 0}, {"actor": 0, "critic": 0}

    def add(key: str, value: torch.Tensor | float) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)

    sizes = {"actor": micro_batch_size, "critic": critic_micro_batch_size or micro_batch_size}
    micro_of = {role: [minibatch_indices(exp.sequences.shape[0], size, s.shuffle_minibatches, spec.seed, step, epoch)
                       for epoch in range(s.epochs)] for role, size in sizes.items()}
    for role, g in (("actor", g_actor), ("critic", g_critic)):
        if len(micro_of[role][0]) % g:
            raise ValueError(f"{len(micro_of[role][0])} {role} minibatches per epoch is not a multiple of its gradient "
                             f"accumulation steps ({g}).")
    # one pass (no rollout forward of the actor): every minibatch goes into one optimizer step, so the old log-probs
    # are this pass's, detached (ratio 1, as TRL takes them); they are kept in exp for the rollout's KL figure
    one_pass = exp.logprobs is None
    if one_pass and (s.epochs != 1 or len(micro_of["actor"][0]) != g_actor or not train_actor):
        raise ValueError(f"the rollout has no old log-probs, which epochs={s.epochs} and {len(micro_of['actor'][0])} "
                         f"actor minibatches in {g_actor}-step accumulation need: sample with old_logprobs=True.")
    if one_pass:
        exp.logprobs = torch.zeros(exp.action_mask.shape, device=exp.action_mask.device)
    groups = ([("actor", aggregation, g_actor, token_budget(actor_engine))] if train_actor else []) + \
        ([("critic", "token_mean", g_critic, token_budget(critic_engine))] if critic_engine is not None else [])
    plan, denominators = _plan(exp, micro_of, groups, registry)
    for epoch in range(s.epochs):
        actor_micro, critic_micro = (plan[role][epoch] if role in plan else [] for role in ("actor", "critic"))
        for i in range(max(len(actor_micro), len(critic_micro))):
            # 1. actor: the policy loss on the current policy's log-probs (+ KL loss) (+ pretraining loss)
            if train_actor and i < len(actor_micro):
                mb = exp.rows(actor_micro[i].rows)
                den = denominators[("actor", epoch, actor_micro[i].step)]
                with moe.tapped(actor_engine, mb.routing) as tap:  # routing: router replay's record, or None
                    logp, token_entropy = lm_logprobs(actor_engine, mb.sequences, mb.attention_mask, C, temperature,
                                                      entropy=True)
                # an MoE router's auxiliary loss over the trained tokens, a step's mean whatever its micro-batches
                aux, figures = moe.aux_term(actor_engine, tap, torch.nn.functional.pad(mb.action_mask, (C, 0)))
                for key, value in figures.items():
                    add(key, value)
                if one_pass:
                    mb.logprobs = logp.detach() * mb.action_mask
                    exp.logprobs[actor_micro[i].rows] = mb.logprobs
                weights = None
                if mb.rollout_logprobs is not None:  # the sampler's log-probs (vLLM, MoE) against the trainer's
                    add("rollout/logprob_mismatch", logprob_mismatch(mb.logprobs, mb.rollout_logprobs, mb.action_mask))
                    if is_cap:
                        weights = truncated_is_weights(mb.logprobs, mb.rollout_logprobs, is_cap)
                        add("rollout/is_weight_mean", ppo.masked_mean(weights, mb.action_mask))
                pg_loss, pg_stats = policy_loss(s.objective, PolicyLossInputs(
                    logp, mb.logprobs, mb.advantages, mb.action_mask, aggregation, den, horizon, weights), s)
                loss = pg_loss + aux * (g_actor / actor_micro[i].count)
                if kl_coef:
                    k_loss, k_mean = kl_loss(logp, mb.ref_logprobs, mb.action_mask, "k3", s.kl_clamp, aggregation,
                                             den, horizon)
                    loss = loss + kl_coef * k_loss
                    add("kl_loss_global", k_loss.detach() / (world * g_actor))
                    add("kl_loss_kl", k_mean)
                entropy = ppo.masked_mean(token_entropy, mb.action_mask)
                if ptx_batches is not None and s.ptx_coef > 0:
                    ptx = {k: v.to(registry.device) for k, v in next(ptx_batches).items()}
                    ptx_loss = causal_lm_loss(actor_engine, ptx)
                    # a step's ptx term is its micro-batches' mean whatever their number (the engine divides by G)
                    loss = loss + s.ptx_coef * ptx_loss * (g_actor / actor_micro[i].count)
                    add("ptx_loss", ptx_loss.detach())
                if token_budget(actor_engine):  # a step of any number of micro-batches: say which one ends it
                    actor_engine.set_gradient_accumulation_boundary(actor_micro[i].last)
                actor_engine.backward(loss)
                actor_engine.step()
                n_steps["actor"] += actor_micro[i].last
                # summed over ranks and an optimizer step's micro-batches, loss / (W*G) is that step's loss
                add("policy_loss_global", pg_loss.detach() / (world * g_actor))
                for key in ("clip_frac", "approx_kl", "ratio_mean"):
                    add(key, pg_stats[key])
                add("clip_low_frac", pg_stats["clip_frac_low"])
                add("clip_high_frac", pg_stats["clip_frac_high"])
                add("entropy", entropy)
                n_micro["actor"] += 1
            # 2. critic: clipped value loss against the returns
            if critic_engine is not None and i < len(critic_micro):
                mb = exp.rows(critic_micro[i].rows)
                den = denominators[("critic", epoch, critic_micro[i].step)]
                if mb.critic_sequences is not None:  # a critic with its own tokenizer: its re-encoded rows
                    full = lm_forward(critic_engine, mb.critic_sequences, mb.critic_attention_mask)
                    values = full.float().gather(1, mb.critic_index)
                else:
                    full = lm_forward(critic_engine, mb.sequences, mb.attention_mask)
                    values = ppo.response_values(full, C)
                v_loss, v_stats = ppo.value_loss(values, mb.values, mb.returns, mb.action_mask, s.value_clip, den)
                if token_budget(critic_engine):
                    critic_engine.set_gradient_accumulation_boundary(critic_micro[i].last)
                critic_engine.backward(v_loss)
                critic_engine.step()
                n_steps["critic"] += critic_micro[i].last
                add("value_loss_global", v_loss.detach() / (world * g_critic))
                add("value_clip_frac", v_stats["clip_frac"])
                n_micro["critic"] += 1

    # 3. every statistic in one all-reduce (the caller's, with ``stats``): global sums, then means per
    #    micro-batch / optimizer step
    own = stats is None
    stats = StepStats() if own else stats
    per_step = {"policy_loss_global", "kl_loss_global", "value_loss_global"}
    for key in sorted(sums):
        role = "critic" if key.startswith("value_") else "actor"
        if key in per_step:
            steps = max(float(n_steps[role]), 1.0)
            stats.add(key.removesuffix("_global"), [sums[key]], lambda total, steps=steps: total / steps)
        else:
            count = world * max(n_micro[role], 1)
            stats.add(key, [sums[key]], lambda total, count=count: total / count)
    return stats.reduce() if own else {}

"""PPO math for RLHF step 3 as small pure tensor functions.

Follows the reference checklist (OpenRLHF, TRL, verl, DeepSpeed-Chat agree on these): log-prob
alignment ``logits[:, ctx-1:-1]`` with temperature, an action mask up to and including the first
EOS, the reward-model score on the last valid action token, a per-token k1 KL penalty, GAE in a
reverse loop, whitening across ranks, clipped policy/value losses normalised by a global token count.

Shape conventions: ``B`` batch, ``L`` full sequence length (prompt + response), ``C`` context
(prompt) length, ``T = L - C`` response length, ``V`` vocabulary size. Masks are ``[B, T]`` bool or
0/1 tensors; functions cast them to the data dtype themselves.

Functions that reduce across data-parallel ranks (:func:`masked_whiten`, :func:`global_token_count`)
do so only when ``torch.distributed`` is initialised, and then *every* rank must call them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "action_mask",
    "apply_no_eos_penalty",
    "clipped_surrogate",
    "compute_rewards",
    "entropy_from_logits",
    "gae",
    "global_token_count",
    "kl_k1",
    "kl_k3",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "response_logprobs",
    "response_values",
    "truncate_after_eos",
    "value_loss",
]

# exp() of a log-ratio above ~88 overflows float32; 20 keeps the ratio finite and is what
# OpenRLHF/verl clamp to, so a stale or diverged token cannot produce inf/NaN gradients.
_LOG_RATIO_CLAMP = 20.0


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# log-probs, masks
# --------------------------------------------------------------------------------------------------


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]`` (any leading dims) unnormalised scores.
        labels: ``[B, T]`` token ids, same leading dims as ``logits``.
        temperature: the sampling temperature; actor, ref and old policy must all use the one the
            rollout was sampled with, otherwise the ratio and the KL compare different distributions.

    Returns:
        ``[B, T]`` float32 log-probs.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # float32 log-softmax: bf16 log-probs are too coarse for ratios that must be ~1.0 at step 0.
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def response_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, context_length: int, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs of the response tokens of ``prompt + response`` sequences.

    The logit at position ``i`` predicts token ``i + 1``, so response tokens
    ``input_ids[:, C:]`` are scored by ``logits[:, C-1:-1]``.

    Args:
        logits: ``[B, L, V]`` model output for ``input_ids``.
        input_ids: ``[B, L]`` prompt (left padded to ``C``) followed by the response (``T`` tokens).
        context_length: ``C``, the padded prompt length (>= 1).
        temperature: sampling temperature (see :func:`logprobs_from_logits`).

    Returns:
        ``[B, T]`` float32 log-probs, ``T = L - C``.
    """
    if not 1 <= context_length < input_ids.shape[1]:
        raise ValueError(
            f"context_length must be in [1, {input_ids.shape[1] - 1}] for sequences of length "
            f"{input_ids.shape[1]}, got {context_length}"
        )
    return logprobs_from_logits(
        logits[:, context_length - 1 : -1], input_ids[:, context_length:], temperature
    )


def response_values(values: torch.Tensor, context_length: int) -> torch.Tensor:
    """Critic values aligned with the response tokens (same shift as :func:`response_logprobs`).

    ``values[:, i]`` is the value of the state that has seen tokens ``<= i``, i.e. the state in which
    token ``i + 1`` is chosen, so action ``input_ids[:, C + t]`` gets ``values[:, C - 1 + t]``.

    Args:
        values: ``[B, L]`` per-position critic output.
        context_length: ``C``.

    Returns:
        ``[B, T]`` values.
    """
    return values[:, context_length - 1 : -1]


def _first_eos_onehot(response_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` bool one-hot of the first EOS per row, and ``[B, T]`` bool 'at or before it'."""
    is_eos = response_ids == eos_token_id
    # cumsum counts EOS seen so far: the first EOS is where the count becomes 1 on an EOS token.
    seen = is_eos.long().cumsum(dim=-1)
    first = is_eos & (seen == 1)
    upto = (seen - is_eos.long()) == 0  # no EOS strictly before this position
    return first, upto


def action_mask(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Mask of the generated tokens that are actions: the prefix up to and including the first EOS.

    Every token before the first EOS is an action, whatever its id: ``generate`` only writes padding
    after a row has emitted EOS, so a pad id before it was *sampled* (and attended to while the rest
    of the row was sampled). Masking it out would punch a hole into a prefix mask (GAE and the returns
    assume a prefix) and hide it from attention when re-scoring, which shifts the log-probs of every
    later token away from the sampling distribution. Works when ``pad_token_id == eos_token_id``.

    Args:
        response_ids: ``[B, T]`` generated tokens (prompt removed), padded after the first EOS.
        eos_token_id: stop token.

    Returns:
        ``[B, T]`` bool prefix mask; a row without EOS (a truncated answer) is all actions.
    """
    _, upto = _first_eos_onehot(response_ids, eos_token_id)
    return upto


def truncate_after_eos(
    response_ids: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> torch.Tensor:
    """Replace every token after the first EOS with ``pad_token_id`` (a new tensor).

    Batched generation keeps sampling for rows that already stopped until all rows stop; those tokens
    must not reach the reward model, the decoder or the losses.

    Args:
        response_ids: ``[B, T]`` generated tokens.

    Returns:
        ``[B, T]`` tokens, same dtype.
    """
    _, upto = _first_eos_onehot(response_ids, eos_token_id)
    return torch.where(upto, response_ids, torch.full_like(response_ids, pad_token_id))


def apply_no_eos_penalty(
    score: torch.Tensor, response_ids: torch.Tensor, eos_token_id: int, penalty: float
) -> torch.Tensor:
    """Subtract ``penalty`` from the score of responses that never emitted EOS (truncated answers).

    Args:
        score: ``[B]`` reward-model scores.
        response_ids: ``[B, T]`` generated tokens.

    Returns:
        ``[B]`` penalised scores.
    """
    has_eos = (response_ids == eos_token_id).any(dim=-1)
    return torch.where(has_eos, score, score - penalty)


# --------------------------------------------------------------------------------------------------
# rewards and KL
# --------------------------------------------------------------------------------------------------


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 KL estimator ``logp - logp_ref`` (unbiased, can be negative). Shapes ``[B, T]``."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``e^(ref - logp) - (ref - logp) - 1`` (>= 0), used as a loss term (GRPO).

    Shapes ``[B, T]``. The log-ratio is clamped to +/-20 so ``exp`` cannot overflow.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _last_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last true entry per row ``[B]`` (long) and whether the row has any ``[B]``."""
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    return last.clamp_min(0), last >= 0


def compute_rewards(
    score: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    action_mask: torch.Tensor,
    kl_coef: float,
    clip_reward: float | None = 5.0,
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token rewards: ``r_t = -kl_coef * (logp_t - ref_logp_t)`` plus the clipped score on the last action.

    Score position: the scalar sits on the *last action token* (the first EOS, or the last token of an
    answer cut at ``max_new_tokens``), as OpenRLHF does. TRL and DeepSpeed-Chat add it one position
    later. Ours keeps the score on a token the policy chose, inside the same prefix mask as the KL
    terms, so GAE, returns-to-go and every masked mean see one consistent set of actions.

    Args:
        score: ``[B]`` reward-model score of each (prompt, response).
        logprobs: ``[B, T]`` rollout (old) policy log-probs.
        ref_logprobs: ``[B, T]`` reference-model log-probs, or ``None`` for no KL term (e.g. when the
            KL is a loss term instead).
        action_mask: ``[B, T]`` (see :func:`action_mask`).
        kl_coef: beta (0.1 DeepSpeed-Chat, 0.05 TRL); may come from a KL controller.
        clip_reward: clip the score to ``[-clip_reward, clip_reward]``; ``None`` disables.
        kl_clamp: clamp the per-token k1 estimate to ``[-kl_clamp, kl_clamp]`` first; ``None`` disables.

    Returns:
        ``[B, T]`` float32 rewards, zero outside the mask. Rows with no action get nothing.
    """
    mask = action_mask.to(torch.float32)
    if ref_logprobs is None or kl_coef == 0:
        rewards = torch.zeros_like(mask)
    else:
        kl = kl_k1(logprobs.float(), ref_logprobs.float())
        if kl_clamp is not None:
            kl = kl.clamp(-kl_clamp, kl_clamp)
        rewards = -kl_coef * kl * mask
    score = score.to(torch.float32).reshape(-1)
    if clip_reward is not None:
        score = score.clamp(-clip_reward, clip_reward)
    last, has_action = _last_index(action_mask)
    score = torch.where(has_action, score, torch.zeros_like(score))
    return rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1))


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op so it is interchangeable with the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing (kept for interface parity)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning LMs from Human Preferences".

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    The error is clipped so one noisy KL estimate cannot swing beta by more than a few percent.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update beta from the mean per-sequence KL of the last rollout of ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # beta is training state: without it a resumed run restarts from init_kl_coef.
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


# --------------------------------------------------------------------------------------------------
# GAE and masked statistics
# --------------------------------------------------------------------------------------------------


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens (reverse loop).

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``, with
    ``V = 0`` after the last action (values and rewards are masked first, so the padding after EOS
    contributes nothing). ``returns = advantages + values``, taken before any whitening.

    Args:
        rewards: ``[B, T]`` per-token rewards (see :func:`compute_rewards`).
        values: ``[B, T]`` critic values of the rollout (see :func:`response_values`).
        action_mask: ``[B, T]``; assumed to be a prefix mask (actions then padding).
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32, zero outside the mask.
    """
    mask = action_mask.to(torch.float32)
    rewards = rewards.float() * mask
    values = values.float().detach() * mask
    steps = rewards.shape[-1]
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    returns = advantages + values
    return advantages, returns


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is set (local to this rank).

    Args:
        x: ``[B, T]`` (any shape).
        mask: same shape as ``x``.
        dim: reduce only this dim; ``None`` reduces everything to a scalar.

    Returns:
        Scalar, or ``x`` reduced over ``dim``. An empty mask gives 0, not NaN.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance of the masked entries of ``x`` (scalar, local to this rank).

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]``.
        unbiased: apply Bessel's correction ``n / (n - 1)`` (TRL does; OpenRLHF does not).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        if count <= 1:
            raise ValueError(f"unbiased variance needs at least 2 masked entries, got {count.item()}")
        var = var * count / (count - 1)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whiten ``x`` with the masked mean and (population) variance of the whole rollout batch.

    When ``torch.distributed`` is initialised, the sum, the sum of squares and the count are
    all-reduced over ``process_group``, so every rank uses the statistics of the global batch (each
    rank whitening its own shard would give a different, data-parallel-size dependent normalisation).
    Statistics are accumulated in float64 so ``E[x^2] - E[x]^2`` does not cancel catastrophically.

    Args:
        x: ``[B, T]`` (typically advantages).
        mask: ``[B, T]``.
        shift_mean: if False the mean is added back (only the scale is normalised).
        process_group: group to reduce over; ``None`` is the default (world) group.

    Returns:
        ``[B, T]`` ``(x - mean) * rsqrt(var + 1e-8)``, same dtype as ``x``, zero outside the mask.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64) * m
    stats = torch.stack([xd.sum(), (xd * xd).sum(), m.sum()])
    if _dist_active():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    total, total_sq, count = stats.unbind()
    if count.item() == 0:
        logger.warning("masked_whiten called with an empty mask on every rank; returning zeros")
        return torch.zeros_like(x)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)
    whitened = (x.to(torch.float64) - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * m).to(x.dtype)


def global_token_count(mask: torch.Tensor, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Number of set entries of ``mask`` summed over all ranks (local count when not distributed).

    Args:
        mask: ``[B, T]`` action mask of this rank's (mini)batch.

    Returns:
        Scalar float32 tensor on ``mask.device``.
    """
    count = mask.to(torch.float32).sum()
    if _dist_active():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=process_group)
    return count


def _reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, global_count: torch.Tensor | float | None
) -> torch.Tensor:
    """Token mean over the local batch, or ``sum / global_count`` when a global count is given."""
    if global_count is None:
        return masked_mean(per_token, mask)
    global_count = torch.as_tensor(global_count, dtype=per_token.dtype, device=per_token.device)
    return (per_token * mask.to(per_token.dtype)).sum() / global_count.clamp_min(1.0)


# --------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped PPO surrogate ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))`` (unreduced).

    ``ratio = exp(clamp(logp - old_logp, -20, 20))``. With ``dual_clip = c > 1`` the loss of tokens
    with ``A < 0`` is additionally capped at ``-c * A`` (Ye et al. 2020), so a huge ratio on a bad
    action cannot dominate the batch. The reduction over tokens is the caller's (:func:`policy_loss`
    takes a token mean; ``losses.aggregate_loss`` offers the GRPO-family normalisations).

    Returns:
        ``(per_token [B, T], stats)``; ``stats`` holds detached masked means ``clip_frac`` (fraction of
        valid tokens where the clipped branch is active), ``approx_kl`` (``0.5 * E[(logp - old)^2]``),
        ``ratio_mean``, ``ratio_max`` and, with dual clip, ``dual_clip_frac``.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    advantages = advantages.float().detach()
    mask = action_mask.to(torch.float32)
    per_token, clipped, stats = clipped_max(ratio, advantages, clip_eps, clip_eps, dual_clip, mask)
    with torch.no_grad():
        stats["clip_frac"] = masked_mean(clipped.float(), mask)
        stats.update(ratio_stats(log_ratio.detach(), ratio.detach(), mask))
    return per_token, stats


def clipped_max(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                dual_clip: float | None, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate's core, shared by every policy loss: ``max(-A r, -A clip(r, 1 - low, 1 + high))``
    per token, optionally capped at ``-dual_clip * A`` for ``A < 0``. Returns the per-token loss, where the clipped
    branch is the larger (bool), and ``dual_clip_frac`` when the dual clip is on."""
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.max(surr1, surr2)
    stats: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        capped = torch.min(per_token, -dual_clip * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = masked_mean(dual_active.float(), mask).detach()
    return per_token, (surr2 > surr1).detach(), stats


def ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The diagnostics every policy loss logs, over the masked tokens: ``approx_kl`` (0.5 x mean squared log-ratio),
    ``ratio_mean`` and ``ratio_max`` (0 for an empty batch)."""
    valid = torch.where(mask.bool(), ratio, torch.zeros_like(ratio))
    return {"approx_kl": 0.5 * masked_mean(log_ratio**2, mask), "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": valid.max() if valid.numel() else torch.zeros(())}


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
    global_token_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (:func:`clipped_surrogate`), averaged over the valid tokens.

    Normalisation: without ``global_token_count`` the loss is the mean over this rank's valid
    tokens. With it, the loss is ``sum(valid token losses) / global_token_count``, so the per-rank
    losses add up to the global token mean whatever the split of the batch across ranks or
    micro-batches. Engines that *average* gradients over ``W`` data-parallel ranks (DeepSpeed, DDP)
    and over ``G`` accumulation steps then apply a factor ``1 / (W * G)``; pass
    ``global_token_count / (W * G)`` to get exactly the global token mean.

    Args:
        logprobs: ``[B, T]`` current policy log-probs (with grad).
        old_logprobs: ``[B, T]`` rollout-time log-probs.
        advantages: ``[B, T]``.
        action_mask: ``[B, T]``.
        clip_eps: epsilon.
        dual_clip: ``c`` (> 1, typically 3) or ``None``.
        global_token_count: see above (e.g. from :func:`global_token_count`).

    Returns:
        ``(loss, stats)`` with the statistics of :func:`clipped_surrogate`.
    """
    per_token, stats = clipped_surrogate(logprobs, old_logprobs, advantages, action_mask, clip_eps, dual_clip)
    return _reduce_loss(per_token, action_mask.to(torch.float32), global_token_count), stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float | None = 0.2,
    global_token_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``, masked.

    Args:
        values: ``[B, T]`` current critic values (with grad).
        old_values: ``[B, T]`` rollout-time values.
        returns: ``[B, T]`` GAE returns (unwhitened).
        action_mask: ``[B, T]``.
        clip_eps: value clip range; ``None`` gives the plain ``0.5 * (V - R)^2``.
        global_token_count: normalisation as in :func:`policy_loss`.

    Returns:
        ``(loss, stats)``; ``stats`` holds detached ``clip_frac`` (fraction of valid tokens where the
        clipped branch is the larger one) and ``values_mean``.
    """
    values = values.float()
    returns = returns.float().detach()
    unclipped = (values - returns) ** 2
    mask = action_mask.to(torch.float32)
    if clip_eps is None:
        per_token = 0.5 * unclipped
        clip_frac = torch.zeros((), device=values.device)
    else:
        old_values = old_values.float().detach()
        clipped_v = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_v - returns) ** 2
        per_token = 0.5 * torch.max(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask).detach()
    loss = _reduce_loss(per_token, mask, global_token_count)
    return loss, {"clip_frac": clip_frac, "values_mean": masked_mean(values.detach(), mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position.

    ``H = logsumexp(z) - sum(softmax(z) * z)``, which avoids materialising ``log_softmax``.

    Args:
        logits: ``[B, T, V]`` (divide by the temperature first if the policy samples with one).

    Returns:
        ``[B, T]`` float32 entropies in nats.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


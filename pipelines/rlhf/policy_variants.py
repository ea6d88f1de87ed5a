"""GRPO-family policy-loss variants as pure tensor functions: asymmetric clipping (DAPO's clip-higher) with
clip fractions per side, GSPO's sequence-level importance ratio, and DAPO's soft overlong penalty.

The loss aggregation modes (``token_mean`` DAPO, ``seq_mean_token_mean`` GRPO, ``seq_mean_token_sum_norm``
Dr. GRPO) are ``losses.aggregate_loss``; :func:`clipped_policy_loss` reduces with it, so the rank /
micro-batch normalisation of losses.py (``denominator``) applies unchanged.

Shapes as in ppo.py: ``B`` rows, ``T`` response tokens, masks ``[B, T]``.
"""

from __future__ import annotations

import torch

from .losses import aggregate_loss
from .ppo import clipped_max, masked_mean, ratio_stats

__all__ = [
    "IMPORTANCE_LEVELS",
    "asymmetric_clipped_surrogate",
    "clipped_policy_loss",
    "log_importance_weights",
    "overlong_penalty",
    "sequence_log_ratio",
]

IMPORTANCE_LEVELS = ("token", "sequence")
# the same bound ppo.clipped_surrogate puts on a token's log-ratio: exp(20) is finite in fp32
_LOG_RATIO_CLAMP = 20.0


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``log s_i = (1/|o_i|) sum_t m_it (logp_it - old_it)``, ``[B]``.

    A fully masked row has ``|o_i| = 0`` and gets 0 (ratio 1), not NaN.
    """
    m = mask.to(torch.float32)
    diff = (logprobs.float() - old_logprobs.float()) * m
    return diff.sum(-1) / m.sum(-1).clamp_min(1.0)


def log_importance_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """Per-token log importance weight ``[B, T]``, clamped to +/-20.

    * ``token`` (PPO, GRPO, DAPO): ``logp_it - old_it``.
    * ``sequence`` (GSPO-token, Zheng et al. 2025): ``log s_it = sg[log s_i] + logp_it - sg[logp_it]``, where
      ``s_i`` is :func:`sequence_log_ratio`'s ratio. Every token of a row carries the value ``s_i``, and the
      gradient reaching ``logp_it`` is ``s_i`` times the token's own loss weight. With an advantage that is
      constant over a row this equals GSPO's sequence objective (and TRL's ``importance_sampling_level=
      "sequence"``) in value and gradient, for every aggregation mode; it also admits per-token advantages.
    """
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_level={level!r}; use one of {list(IMPORTANCE_LEVELS)}.")
    logprobs = logprobs.float()
    if level == "token":
        log_w = logprobs - old_logprobs.float()
    else:
        seq = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)
        log_w = logprobs - logprobs.detach() + seq.unsqueeze(-1)
    return log_w.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low!r}: the ratio's lower bound is 1 - clip_low, so use 0 <= clip_low < 1 "
                         "(e.g. 0.2).")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high!r}: the ratio's upper bound is 1 + clip_high; use clip_high >= 0 "
                         "(e.g. 0.28, DAPO's clip-higher).")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def asymmetric_clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    importance_level: str = "token",
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate with separate bounds, unreduced:
    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, ``r = exp(log_importance_weights(level))``.

    ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al. 2025: 0.2 / 0.28): a token with ``A > 0`` may
    grow its probability further before its gradient stops, which keeps low-probability tokens explorable.
    ``clip_high=None`` is ``clip_low`` (symmetric: then this equals ``ppo.clipped_surrogate``). ``dual_clip``
    caps the loss of ``A < 0`` tokens at ``-dual_clip * A`` as in ppo.py.

    Returns:
        ``(per_token [B, T], stats)``; ``stats`` (detached): ``clip_frac_low`` (share of valid tokens with
        ``r < 1 - clip_low`` and ``A < 0``), ``clip_frac_high`` (``r > 1 + clip_high`` and ``A > 0``),
        ``clip_frac`` (their sum: the tokens whose gradient the clip stops), ``approx_kl``
        (``0.5 E[(logp - old)^2]`` per token), ``ratio_mean``, ``ratio_max`` and, with ``dual_clip``,
        ``dual_clip_frac``. At the sequence level the fractions are shares of the rows with at least one
        valid token (each row has one ratio).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    mask = action_mask.to(torch.float32)
    log_w = log_importance_weights(logprobs, old_logprobs, mask, importance_level)
    ratio = torch.exp(log_w)
    advantages = advantages.float().detach()
    if advantages.dim() == 1:  # one advantage per row
        advantages = advantages.unsqueeze(-1).expand_as(ratio)
    per_token, _, stats = clipped_max(ratio, advantages, clip_low, clip_high, dual_clip, mask)
    with torch.no_grad():
        r = ratio.detach()
        low = ((r < 1.0 - clip_low) & (advantages < 0)).float()
        high = ((r > 1.0 + clip_high) & (advantages > 0)).float()
        if importance_level == "sequence":
            # one ratio per row; each row with a valid token counts once (TRL's per-row mean)
            rows = (mask.sum(-1) > 0).float()
            first = mask.argmax(-1, keepdim=True)  # a valid position of each non-empty row

            def frac(x: torch.Tensor) -> torch.Tensor:
                return masked_mean(x.gather(1, first).squeeze(-1), rows)
        else:

            def frac(x: torch.Tensor) -> torch.Tensor:
                return masked_mean(x, mask)
        stats["clip_frac_low"] = frac(low)
        stats["clip_frac_high"] = frac(high)
        stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
        stats.update(ratio_stats(logprobs.detach().float() - old_logprobs.float(), r, mask))
    return per_token, stats


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    importance_level: str = "token",
    dual_clip: float | None = None,
    loss_agg: str = "token_mean",
    denominator: torch.Tensor | float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`asymmetric_clipped_surrogate` reduced with ``losses.aggregate_loss`` (``loss_agg``,
    ``denominator``, ``horizon`` as there). With ``clip_low == clip_high`` and ``importance_level="token"``
    this is ``losses.policy_gradient_loss``. Returns ``(loss, stats)``."""
    per_token, stats = asymmetric_clipped_surrogate(logprobs, old_logprobs, advantages, action_mask, clip_low,
                                                    clip_high, importance_level, dual_clip)
    loss = aggregate_loss(per_token, action_mask.to(torch.float32), loss_agg, denominator, horizon)
    return loss, stats


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the sequence reward:

    ``0`` for ``L <= max_len - buffer``; ``-penalty * (L - (max_len - buffer)) / buffer`` inside the buffer
    (linear to ``-penalty`` at ``L = max_len``); ``-penalty`` beyond ``max_len``.

    Args:
        lengths: ``[B]`` response lengths in tokens (e.g. ``action_mask.sum(-1)``).
        max_len: the generation cap (``max_new_tokens``).
        buffer: tokens before ``max_len`` where the penalty ramps up, ``1 <= buffer <= max_len``.
        penalty: the penalty at ``max_len``, ``>= 0``.

    Returns:
        ``[B]`` float32, ``<= 0``.
    """
    if max_len < 1:
        raise ValueError(f"overlong max_len must be >= 1 (max_new_tokens), got {max_len}.")
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong_buffer={buffer!r}: the penalty ramps over the last overlong_buffer tokens before "
                         f"max_new_tokens={max_len}, so use 1 <= overlong_buffer <= {max_len}.")
    if penalty < 0:
        raise ValueError(f"overlong_penalty={penalty!r}: a penalty size >= 0 (it is subtracted from the reward).")
    exceed = lengths.float() - float(max_len - buffer)
    return (-exceed / float(buffer) * penalty).clamp(min=-penalty, max=0.0)

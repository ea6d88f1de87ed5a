"""Loss math as pure tensor functions: the policy-loss registry (one entry point for every clipped objective), the
GRPO-family normalisations of a per-token loss, the KL loss term, and the DPO / IPO preference losses with the
response log-prob they need. Shapes as in ppo.py: ``B`` rows, ``T`` response tokens, masks ``[B, T]``.

Policy losses. ``policy_loss(name, inputs, settings)`` runs the entry ``POLICY_LOSSES[name]`` on a
:class:`PolicyLossInputs` with the algorithm's settings object (its fields are read by name: ``clip_eps``,
``dual_clip``, ``clip_low``, ``clip_high``, ...); every entry returns ``(loss, detached stats)``. Entries register
with :func:`register_policy_loss` where they are defined (as verl's ``@register_policy_loss``): ``ppo``, ``dapo``
and ``gspo`` here, ``diffusion_grpo`` in pipelines.diffusion.rl. RLOO and REINFORCE++ train with ``ppo``: they differ
in their advantages (advantages.py) and aggregation, not in the objective.

Normalisation over ranks and micro-batches: a loss is ``numerator / denominator``, and passing the *global* count
of normalisation units (tokens or rows of the whole optimizer step, all ranks) over ``W * G`` makes the
per-micro-batch losses add up, after DeepSpeed's averaging over ``W`` ranks and ``G`` accumulation steps, to the
loss of the whole batch in one piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import ppo

__all__ = ["DPO_LOSSES", "IMPORTANCE_LEVELS", "LOSS_AGG_MODES", "POLICY_LOSSES", "ROLLOUT_IS_HELP", "PolicyLossInputs",
           "aggregate_loss", "chosen_nll", "dpo_loss", "kl_estimate", "kl_loss", "log_importance_weights",
           "logprob_mismatch", "loss_units", "policy_loss", "register_policy_loss", "sequence_log_ratio",
           "sequence_logprob", "truncated_is_weights"]

# token_mean: sum over every valid token / number of valid tokens (PPO, DAPO, REINFORCE++, RLOO);
# seq_mean_token_mean: mean over tokens within a row, then over rows (the original GRPO);
# seq_mean_token_sum_norm: sum over a row's tokens / a constant horizon, then mean over rows
#   (Dr. GRPO: no 1/|o_i| length bias; the constant is max_new_tokens).
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
IMPORTANCE_LEVELS = ("token", "sequence")
DPO_LOSSES = ("sigmoid", "ipo")
KL_ESTIMATORS = ("k1", "k3")


# --- normalisation ------------------------------------------------------------------------------------------------
def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_aggregation={mode!r}; use one of {list(LOSS_AGG_MODES)}.")


def loss_units(mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """This rank's count of normalisation units of ``mask`` ``[B, T]``: valid tokens for ``token_mean``, rows for
    the sequence modes. Scalar float32 (sum it over ranks for a global count)."""
    _check_mode(mode)
    mask = mask.to(torch.float32)
    return mask.sum() if mode == "token_mean" else torch.tensor(float(mask.shape[0]), device=mask.device)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean",
                   denominator: torch.Tensor | float | None = None, horizon: int | None = None) -> torch.Tensor:
    """A per-token loss ``[B, T]`` reduced to a scalar: ``token_mean`` ``sum(l m) / N_tokens``;
    ``seq_mean_token_mean`` ``sum_i(sum_t l m / n_i) / N_rows``; ``seq_mean_token_sum_norm`` ``sum(l m) / horizon /
    N_rows`` (``horizon`` None = ``T``). ``denominator``: the unit count to divide by (module docstring); None =
    this batch's own :func:`loss_units`."""
    _check_mode(mode)
    m = mask.to(per_token.dtype)
    masked = per_token * m
    if mode == "token_mean":
        numerator = masked.sum()
    elif mode == "seq_mean_token_mean":
        numerator = (masked.sum(-1) / m.sum(-1).clamp_min(1.0)).sum()
    else:
        horizon = per_token.shape[-1] if horizon is None else horizon
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        numerator = masked.sum() / float(horizon)
    if denominator is None:
        denominator = loss_units(mask, mode)
    denominator = torch.as_tensor(denominator, dtype=per_token.dtype, device=per_token.device)
    # an empty batch has a zero numerator too: 0 / eps = 0, not NaN
    return numerator / denominator.clamp_min(1e-8)


# --- the policy-loss registry -------------------------------------------------------------------------------------
@dataclass
class PolicyLossInputs:
    """One minibatch of a policy loss: log-probs ``[B, T]`` of the current policy (with grad) and of the rollout,
    advantages ``[B, T]`` (or ``[B]``, one per row), the action mask, and how the per-token loss is reduced
    (:func:`aggregate_loss`: ``aggregation``, ``denominator``, ``horizon``)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    aggregation: str = "token_mean"
    denominator: torch.Tensor | float | None = None
    horizon: int | None = None
    weights: torch.Tensor | None = None  # [B, T] per-token loss weights (truncated importance sampling); None = 1

    def reduce(self, per_token: torch.Tensor) -> torch.Tensor:
        per_token = per_token if self.weights is None else per_token * self.weights
        return aggregate_loss(per_token, self.mask.to(torch.float32), self.aggregation, self.denominator,
                              self.horizon)


ROLLOUT_IS_HELP = ("0 = off; > 0: truncated importance sampling of rollouts sampled by other weights or another "
                   "engine (vLLM, rollout ranks, one_step_off/async schedules; TRL's "
                   "vllm_importance_sampling_correction, verl's TIS): each token's policy loss x min(pi_old / "
                   "pi_rollout, cap), e.g. 2.0")


def logprob_mismatch(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean ``|old - rollout|`` over the actions: how far the inference engine's log-probs of its sampled tokens are
    from the trainer's."""
    return ppo.masked_mean((old_logprobs.float() - rollout_logprobs.float()).abs(), mask)


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Per-token ``min(exp(old - rollout), cap)``, detached: the policy gradient of tokens sampled by an inference
    engine whose probabilities differ slightly from the trainer's, corrected towards the trainer's old policy and
    capped so a rare token cannot dominate (Yao et al. 2025)."""
    return torch.exp(old_logprobs.float() - rollout_logprobs.float()).clamp(max=cap).detach()


PolicyLoss = Callable[[PolicyLossInputs, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register ``fn(inputs, settings) -> (loss, stats)`` as the policy loss ``name``."""
    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = fn
        return fn
    return register


def policy_loss(name: str, inputs: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss ``name`` of ``inputs`` with the hyper-parameters of ``settings``: ``(loss, detached stats)``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r}; use one of {sorted(POLICY_LOSSES)}.")
    return POLICY_LOSSES[name](inputs, settings)


def clipped_max(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate's core: ``max(-A r, -A clip(r, 1 - low, 1 + high))`` per token, capped at ``-dual_clip *
    A`` for ``A < 0`` when ``dual_clip`` (> 1; 0 = off; Ye et al. 2020: a huge ratio on a bad action cannot dominate
    the batch). Returns the per-token loss, where the clipped branch is the larger, and ``dual_clip_frac``."""
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.max(surr1, surr2)
    stats: dict[str, torch.Tensor] = {}
    if dual_clip:
        capped = torch.min(per_token, -dual_clip * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = ppo.masked_mean(dual_active.float(), mask).detach()
    return per_token, (surr2 > surr1).detach(), stats


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Detached float32 ``[B, T]`` advantages (one per row, ``[B]``, spread over the row's tokens)."""
    advantages = advantages.float().detach()
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages


def _ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``approx_kl`` (0.5 x mean squared log-ratio), ``ratio_mean`` and ``ratio_max`` (0 for an empty batch)."""
    valid = torch.where(mask.bool(), ratio, torch.zeros_like(ratio))
    return {"approx_kl": 0.5 * ppo.masked_mean(log_ratio**2, mask), "ratio_mean": ppo.masked_mean(ratio, mask),
            "ratio_max": valid.max() if valid.numel() else torch.zeros(())}


def _side_fractions(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float,
                    frac: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Shares of the tokens the clip stops: below (``r < 1 - low``, ``A < 0``) and above (``r > 1 + high``,
    ``A > 0``)."""
    return {"clip_frac_low": frac(((ratio < 1.0 - low) & (advantages < 0)).float()),
            "clip_frac_high": frac(((ratio > 1.0 + high) & (advantages > 0)).float())}


@register_policy_loss("ppo")
def ppo_clip_loss(x: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` on the token ratio ``r = exp(clamp(logp -
    old, +/-20))``, with the dual clip (``settings.clip_eps``, ``settings.dual_clip``; 0 = off). At ratio 1 (one
    epoch over one minibatch, the usual GRPO) it is the plain policy gradient ``-A logp`` in value and gradient.
    Stats: ``clip_frac`` (share of valid tokens where the clipped branch is the larger), ``clip_frac_low`` /
    ``clip_frac_high`` (per side), ``approx_kl``, ``ratio_mean``, ``ratio_max`` (and ``dual_clip_frac``)."""
    eps = settings.clip_eps
    log_ratio = (x.logprobs.float() - x.old_logprobs.float()).clamp(-ppo.LOG_RATIO_CLAMP, ppo.LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    advantages = _per_token(x.advantages, ratio)
    mask = x.mask.to(torch.float32)
    per_token, clipped, stats = clipped_max(ratio, advantages, eps, eps, settings.dual_clip, mask)
    with torch.no_grad():
        stats["clip_frac"] = ppo.masked_mean(clipped.float(), mask)
        stats.update(_ratio_stats(log_ratio.detach(), ratio.detach(), mask))
        if eps < 1.0:  # a lower bound 1 - eps <= 0 clips nothing below: both sides are reported as 0
            stats.update(_side_fractions(ratio.detach(), advantages, eps, eps, lambda v: ppo.masked_mean(v, mask)))
        else:
            stats.update(clip_frac_low=torch.zeros(()), clip_frac_high=torch.zeros(()))
    return x.reduce(per_token), stats


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio ``log s_i = (1/|o_i|) sum_t m_it (logp_it - old_it)``, ``[B]``;
    a fully masked row gets 0 (ratio 1), not NaN."""
    m = mask.to(torch.float32)
    return ((logprobs.float() - old_logprobs.float()) * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def log_importance_weights(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                           level: str = "token") -> torch.Tensor:
    """Per-token log importance weight ``[B, T]``, clamped to +/-20: ``token`` (PPO, GRPO, DAPO) ``logp_it -
    old_it``; ``sequence`` (GSPO-token, Zheng et al. 2025) ``sg[log s_i] + logp_it - sg[logp_it]``, so every token
    of a row carries the value ``s_i`` (:func:`sequence_log_ratio`) and the gradient reaching ``logp_it`` is ``s_i``
    times the token's own loss weight. With an advantage constant over a row this equals GSPO's sequence objective
    (TRL's ``importance_sampling_level="sequence"``) in value and gradient, for every aggregation mode."""
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"importance_level={level!r}; use one of {list(IMPORTANCE_LEVELS)}.")
    logprobs = logprobs.float()
    if level == "token":
        log_w = logprobs - old_logprobs.float()
    else:
        log_w = logprobs - logprobs.detach() + sequence_log_ratio(logprobs.detach(), old_logprobs, mask).unsqueeze(-1)
    return log_w.clamp(-ppo.LOG_RATIO_CLAMP, ppo.LOG_RATIO_CLAMP)


def _asymmetric(x: PolicyLossInputs, settings: Any, level: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate with the bounds ``1 - clip_low`` / ``1 + clip_high`` (``settings.clip_low`` None =
    ``clip_eps``, ``clip_high`` None = ``clip_low``) on the ``level`` ratio, with the dual clip. Stats:
    ``clip_frac_low`` / ``clip_frac_high`` and their sum ``clip_frac`` (at the sequence level shares of the rows
    with a valid token: one ratio per row), ``approx_kl`` (per token), ``ratio_mean``, ``ratio_max``."""
    low = settings.clip_eps if settings.clip_low is None else settings.clip_low
    high = low if settings.clip_high is None else settings.clip_high
    mask = x.mask.to(torch.float32)
    ratio = torch.exp(log_importance_weights(x.logprobs, x.old_logprobs, mask, level))
    advantages = _per_token(x.advantages, ratio)
    per_token, _, stats = clipped_max(ratio, advantages, low, high, settings.dual_clip, mask)
    with torch.no_grad():
        r = ratio.detach()
        if level == "sequence":  # one ratio per row; each row with a valid token counts once (TRL's per-row mean)
            rows, first = (mask.sum(-1) > 0).float(), mask.argmax(-1, keepdim=True)
            stats.update(_side_fractions(r, advantages, low, high,
                                         lambda v: ppo.masked_mean(v.gather(1, first).squeeze(-1), rows)))
        else:
            stats.update(_side_fractions(r, advantages, low, high, lambda v: ppo.masked_mean(v, mask)))
        stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
        stats.update(_ratio_stats(x.logprobs.detach().float() - x.old_logprobs.float(), r, mask))
    return x.reduce(per_token), stats


@register_policy_loss("dapo")
def dapo_loss(x: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO's clip-higher (Yu et al. 2025: ``clip_low`` 0.2 / ``clip_high`` 0.28) on the token ratio: a token with
    ``A > 0`` may grow its probability further before its gradient stops, which keeps rare tokens explorable."""
    return _asymmetric(x, settings, "token")


@register_policy_loss("gspo")
def gspo_loss(x: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): the clip of ``dapo`` on the length-normalised sequence ratio
    (:func:`log_importance_weights` ``sequence``)."""
    return _asymmetric(x, settings, "sequence")


# --- the KL loss term ---------------------------------------------------------------------------------------------
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
                clamp: float = 0.0) -> torch.Tensor:
    """Per-token ``[B, T]`` KL(pi || pi_ref) estimate from sampled tokens: ``k1 = logp - ref`` (in the reward) or
    ``k3 = e^(ref-logp) - (ref-logp) - 1`` (>= 0, a loss term, GRPO), clamped to ``+/- clamp`` (0 = off) so one
    token far from the reference cannot dominate."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator={estimator!r}; use one of {list(KL_ESTIMATORS)}.")
    if clamp is not None and clamp < 0:
        raise ValueError(f"kl clamp must be > 0 (0 = off), got {clamp}")
    kl = (ppo.kl_k1 if estimator == "k1" else ppo.kl_k3)(logprobs.float(), ref_logprobs.float())
    return kl.clamp(-clamp, clamp) if clamp else kl


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, action_mask: torch.Tensor, estimator: str = "k3",
            clamp: float = 0.0, loss_agg: str = "token_mean", denominator: torch.Tensor | float | None = None,
            horizon: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KL to the reference as a loss term (GRPO): :func:`kl_estimate` of the *current* log-probs (with grad),
    reduced like the policy loss; multiply by the KL coefficient. Returns ``(loss, detached masked token mean)``."""
    per_token = kl_estimate(logprobs, ref_logprobs.detach(), estimator, clamp)
    mask = action_mask.to(torch.float32)
    return aggregate_loss(per_token, mask, loss_agg, denominator, horizon), ppo.masked_mean(per_token.detach(), mask)


# --- preference losses --------------------------------------------------------------------------------------------
def sequence_logprob(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """``[B]`` float32 ``log pi(y | x)``: the sum of the log-probs of the tokens where ``response_mask`` ``[B, L]``
    is set (response tokens, EOS included; never position 0, which no logit predicts), logits divided by
    ``temperature`` (1 for DPO)."""
    if response_mask.shape != input_ids.shape:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if bool(response_mask[:, 0].any()):
        raise ValueError("response_mask marks position 0, which no logit predicts; the prompt must be non-empty")
    logp = ppo.logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
    return (logp * response_mask[:, 1:].to(logp.dtype)).sum(-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss from sequence log-probs (``[B]`` each), with ``h = (logpi(y_w) - logref(y_w)) -
    (logpi(y_l) - logref(y_l))``:

    * ``sigmoid`` (DPO, Rafailov et al. 2023): ``-(1 - e) log sigma(beta h) - e log sigma(-beta h)``;
      ``e = label_smoothing`` is the assumed probability that a label is flipped (conservative DPO).
    * ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, a regression of the margin to a finite target, so it
      does not push ``h`` to infinity on deterministic preferences.

    Returns ``(losses [B], chosen_rewards [B], rejected_rewards [B])``; the implicit rewards ``beta * (logpi -
    logref)`` are detached.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss={loss_type!r}; use one of {list(DPO_LOSSES)}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("label_smoothing applies to the sigmoid (DPO) loss only; set it to 0 for ipo.")
    chosen_ratio = policy_chosen.float() - ref_chosen.float().detach()
    rejected_ratio = policy_rejected.float() - ref_rejected.float().detach()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def chosen_nll(policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Per-pair negative log-likelihood of the chosen response per token, ``-logpi(y_w) / |y_w|`` (``[B]`` summed
    log-probs with grad, ``[B]`` token counts). Added to the DPO loss with a weight (``DPOSettings.sft_coef``; TRL's
    ``rpo_alpha``, Pang et al. 2024) it keeps the chosen answers likely: DPO alone only widens the margin, often by
    lowering chosen and rejected log-probs alike."""
    return -policy_chosen.float() / chosen_tokens.to(torch.float32).clamp_min(1.0)

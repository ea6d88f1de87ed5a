"""Loss math beyond PPO's token mean, as pure tensor functions: the GRPO-family normalisations of a
per-token loss, the KL loss term, and the DPO / IPO preference losses with the response log-prob they
need. Shapes as in ppo.py: ``B`` rows, ``T`` response tokens, masks ``[B, T]``.

Normalisation over ranks and micro-batches follows ppo.py: a loss is ``numerator / denominator``,
and passing the *global* count of normalisation units (tokens or rows of the whole optimizer step,
all ranks) divided by ``W * G`` makes the per-micro-batch losses add up, after DeepSpeed's averaging
over ``W`` ranks and ``G`` accumulation steps, to the loss of the whole batch in one piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ppo

__all__ = [
    "DPO_LOSSES",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "chosen_nll",
    "dpo_loss",
    "kl_estimate",
    "kl_loss",
    "loss_units",
    "policy_gradient_loss",
    "sequence_logprob",
]

# token_mean: sum over every valid token / number of valid tokens (PPO, DAPO, REINFORCE++, RLOO);
# seq_mean_token_mean: mean over tokens within a row, then over rows (the original GRPO);
# seq_mean_token_sum_norm: sum over a row's tokens / a constant horizon, then mean over rows
#   (Dr. GRPO: no 1/|o_i| length bias; the constant is max_new_tokens).
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
DPO_LOSSES = ("sigmoid", "ipo")
KL_ESTIMATORS = ("k1", "k3")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg={mode!r}; use one of {list(LOSS_AGG_MODES)}.")


def loss_units(mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
    """This rank's count of normalisation units of ``mask`` ``[B, T]``: valid tokens for
    ``token_mean``, rows for the sequence modes. Scalar float32 (sum it over ranks for a global count)."""
    _check_mode(mode)
    mask = mask.to(torch.float32)
    if mode == "token_mean":
        return mask.sum()
    return torch.tensor(float(mask.shape[0]), device=mask.device)


def aggregate_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token_mean",
    denominator: torch.Tensor | float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar with one of :data:`LOSS_AGG_MODES`.

    Args:
        per_token: ``[B, T]`` loss per token.
        mask: ``[B, T]`` valid tokens.
        mode: ``token_mean`` ``sum(l*m) / N_tokens``; ``seq_mean_token_mean``
            ``sum_i(sum_t l*m / n_i) / N_rows``; ``seq_mean_token_sum_norm`` ``sum(l*m) / horizon / N_rows``.
        denominator: the unit count to divide by (see the module docstring); ``None`` uses this
            batch's own :func:`loss_units`.
        horizon: the constant of ``seq_mean_token_sum_norm`` (``max_new_tokens``); ``None`` = ``T``.

    Returns:
        Scalar loss in ``per_token``'s dtype.
    """
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


def policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token_mean",
    denominator: torch.Tensor | float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate of :func:`ppo.clipped_surrogate` reduced with ``loss_agg``.

    With one epoch over one minibatch (the usual GRPO setting) the ratio is 1 and this is the plain
    policy gradient ``-A * logp`` in value and gradient. Returns ``(loss, stats)``.
    """
    per_token, stats = ppo.clipped_surrogate(logprobs, old_logprobs, advantages, action_mask, clip_eps, dual_clip)
    return aggregate_loss(per_token, action_mask.to(torch.float32), loss_agg, denominator, horizon), stats


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3",
                clamp: float | None = None) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled tokens: ``k1 = logp - ref`` (in the reward) or
    ``k3 = e^(ref-logp) - (ref-logp) - 1`` (>= 0, as a loss term, GRPO), optionally clamped to
    ``[-clamp, clamp]`` so one token far from the reference cannot dominate. ``[B, T]``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator={estimator!r}; use one of {list(KL_ESTIMATORS)}.")
    kl = ppo.kl_k1(logprobs.float(), ref_logprobs.float()) if estimator == "k1" else \
        ppo.kl_k3(logprobs.float(), ref_logprobs.float())
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"kl clamp must be > 0, got {clamp}")
        kl = kl.clamp(-clamp, clamp)
    return kl


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: str = "k3",
    clamp: float | None = None,
    loss_agg: str = "token_mean",
    denominator: torch.Tensor | float | None = None,
    horizon: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL to the reference as a loss term (GRPO): :func:`kl_estimate` of the *current* policy's
    log-probs (with grad) reduced like the policy loss. Multiply by the KL coefficient and add it to
    the policy loss. Returns ``(loss, detached masked token mean of the estimate)``."""
    per_token = kl_estimate(logprobs, ref_logprobs.detach(), estimator, clamp)
    mask = action_mask.to(torch.float32)
    loss = aggregate_loss(per_token, mask, loss_agg, denominator, horizon)
    return loss, ppo.masked_mean(per_token.detach(), mask)


def sequence_logprob(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """``log pi(y | x)`` per row: the sum of the log-probs of the tokens where ``response_mask`` is set.

    Args:
        logits: ``[B, L, V]`` model output for ``input_ids``.
        input_ids: ``[B, L]`` prompt + response (+ padding).
        response_mask: ``[B, L]`` 1 on the response tokens (EOS included), 0 on prompt and padding;
            position 0 cannot be a response token (nothing predicts it).
        temperature: divide the logits first (1 for DPO).

    Returns:
        ``[B]`` float32 sums.
    """
    if response_mask.shape != input_ids.shape:
        raise ValueError(f"response_mask {tuple(response_mask.shape)} != input_ids {tuple(input_ids.shape)}")
    if bool(response_mask[:, 0].any()):
        raise ValueError("response_mask marks position 0, which no logit predicts; the prompt must be non-empty")
    logp = ppo.logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
    return (logp * response_mask[:, 1:].to(logp.dtype)).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference loss from sequence log-probs (``[B]`` each).

    With ``h = (logpi(y_w) - logref(y_w)) - (logpi(y_l) - logref(y_l))``:

    * ``sigmoid`` (DPO, Rafailov et al. 2023): ``-(1 - e) log sigma(beta h) - e log sigma(-beta h)``;
      ``e = label_smoothing`` is the assumed probability that a label is flipped (conservative DPO).
    * ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, a regression of the log-ratio margin to a
      finite target, so it does not push ``h`` to infinity on deterministic preferences.

    Returns:
        ``(losses [B], chosen_rewards [B], rejected_rewards [B])``; the implicit rewards
        ``beta * (logpi - logref)`` are detached.
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
    """Per-pair negative log-likelihood of the chosen response, per token: ``-logpi(y_w) / |y_w|``.

    Added to the DPO loss with a weight (``DPOSettings.sft_coef``; TRL's ``rpo_alpha``, Pang et al. 2024)
    it keeps the chosen answers likely: DPO alone only widens the margin, and often does so by lowering
    the log-probs of chosen and rejected answers alike, moving mass to answers neither of them is.

    Args:
        policy_chosen: ``[B]`` summed log-probs of the chosen responses (with grad).
        chosen_tokens: ``[B]`` number of response tokens (EOS included) each sum covers.
    """
    return -policy_chosen.float() / chosen_tokens.to(torch.float32).clamp_min(1.0)

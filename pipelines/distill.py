"""Knowledge-distillation losses between a teacher's and a student's next-token distributions.

Pure functions on logits ``[B, T, V]`` and a mask ``[B, T]`` of the positions to learn from; every
loss is a mean over those positions.

* forward KL ``KL(p_T || p_S)`` (Hinton et al. 2015: the student covers every mode of the teacher);
* reverse KL ``KL(p_S || p_T)`` (mode seeking, as in MiniLLM);
* generalised Jensen-Shannon ``beta KL(p_T || m) + (1 - beta) KL(p_S || m)``, ``m = beta p_T + (1 - beta) p_S``
  (as in GKD; ``beta = 0.5`` is the symmetric JSD, bounded by ln 2).

With a temperature ``tau`` both distributions are ``softmax(logits / tau)`` and the loss is multiplied
by ``tau^2``, which keeps its gradient scale independent of ``tau`` (Hinton et al.).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["DIVERGENCES", "distillation_loss", "divergence", "next_token_mask"]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
               kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Mean over ``mask`` of the per-position divergence between teacher and student, times ``tau^2``.

    Args:
        student_logits, teacher_logits: ``[B, T, V]`` (same vocabulary).
        mask: ``[B, T]`` bool/0-1, the positions that count.
        kind: ``forward_kl`` | ``reverse_kl`` | ``jsd``.
        temperature: ``tau > 0``.
        beta: the JSD's teacher weight, in (0, 1).
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence kind={kind!r}; use one of {list(DIVERGENCES)}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models need the same vocabulary.")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if kind == "forward_kl":
        per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif kind == "reverse_kl":
        per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta must be in (0, 1), got {beta}.")
        log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1.0 - beta)]), dim=0)
        per_token = (beta * (log_t.exp() * (log_t - log_m)).sum(-1)
                     + (1.0 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1))
    return _masked_mean(per_token, mask) * temperature**2


def next_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` labels (-100 = ignore) -> ``[B, L - 1]`` mask of the logits positions that predict a
    labelled token (position ``t`` predicts token ``t + 1``)."""
    return labels[:, 1:] != -100


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      kind: str = "forward_kl", temperature: float = 1.0, alpha: float = 1.0,
                      beta: float = 0.5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``alpha * divergence + (1 - alpha) * cross-entropy`` on the labelled next-token positions.

    Args:
        student_logits, teacher_logits: ``[B, L, V]`` logits of the same input ids.
        labels: ``[B, L]`` the input ids with -100 where no loss is wanted (prompt, padding).
        alpha: weight of the distillation term; ``1 - alpha`` goes to the hard-label loss.

    Returns:
        ``(loss, {"divergence", "ce"})`` (the parts detached).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}.")
    mask = next_token_mask(labels)
    s, t = student_logits[:, :-1], teacher_logits[:, :-1]
    div = divergence(s, t, mask, kind, temperature, beta)
    target = labels[:, 1:]
    ce_all = F.cross_entropy(s.float().reshape(-1, s.shape[-1]), target.clamp(min=0).reshape(-1), reduction="none")
    ce = _masked_mean(ce_all.view(target.shape), mask)
    loss = alpha * div + (1.0 - alpha) * ce if alpha < 1.0 else div
    return loss, {"divergence": div.detach(), "ce": ce.detach()}

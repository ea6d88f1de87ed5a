"""Knowledge distillation between a teacher's and a student's next-token distributions: pure losses on logits
(GKD's ``beta``: 0 forward KL, 1 reverse KL, between the generalised JSD; ``softmax(logits / tau)``, offline loss
times ``tau^2``), the distill recipe's settings, and on-policy distillation's samples (GKD, Agarwal et al. 2024)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from multiengine.engines.packing import lm_forward, packs
from multiengine.engines.settings import Choice, Range, Satisfies, Settings, setting

__all__ = ["DIVERGENCES", "DistillSettings", "check_vocab", "distillation_loss", "divergence", "generalized_jsd",
           "generalized_jsd_loss", "gkd_beta", "heldout_cross_entropy", "next_token_mask", "on_policy_batch",
           "prompts_of_demonstrations", "response_distill_loss", "role_logits", "sampled_distill_loss",
           "student_samples"]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillSettings(Settings):
    """The distillation loss: the same per-token divergence on demonstrations and on the student's samples."""

    loss: str = setting("forward_kl", "forward_kl | reverse_kl | jsd", Choice(*DIVERGENCES))
    temperature: float = setting(1.0, "softens both distributions; the loss is multiplied by its square",
                                 Range(0, min_exclusive=True))
    alpha: float = setting(1.0, "weight of the distillation term; 1 - alpha goes to the hard-label cross-entropy",
                           Range(0, 1))
    beta: float = setting(0.5, "the JSD's teacher weight (GKD's beta; forward_kl is beta 0, reverse_kl 1)",
                          Satisfies(lambda b: isinstance(b, (int, float)) and 0 < b < 1,
                                    "in (0, 1) (its ends are distill.loss=forward_kl (beta 0) and reverse_kl "
                                    "(beta 1))"), when="loss=jsd")
    on_policy_fraction: float = setting(0.0, "GKD's lambda: the share of steps whose responses the student samples "
                                             "itself (generation.*) for the teacher to score; 0 = offline, 1 = always",
                                        Range(0, 1))

    def offline_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`distillation_loss` of these settings on a demonstration batch."""
        return distillation_loss(student_logits, teacher_logits, labels, self.loss, self.temperature, self.alpha,
                                 self.beta)

    def sampled_loss(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, context_length: int,
                     action_mask: torch.Tensor) -> torch.Tensor:
        """:func:`sampled_distill_loss` of these settings on the student's own answers."""
        return sampled_distill_loss(student_logits, teacher_logits, context_length, action_mask, self.loss,
                                    self.temperature, self.beta)


def _masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def gkd_beta(kind: str, beta: float = 0.5) -> float:
    """GKD's ``beta`` of a divergence name: ``forward_kl`` 0, ``reverse_kl`` 1, ``jsd`` ``beta`` (in (0, 1))."""
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence kind={kind!r}; use one of {list(DIVERGENCES)}.")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"distill.beta={beta!r}: the JSD's teacher weight must be in (0, 1).")
    return {"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, float(beta))


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 0.5,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position divergence of GKD's ``beta`` (module docstring), ``[..., V] -> [...]`` float32, without the
    ``tau^2`` factor. The mixture tends to ``p_S`` as ``beta -> 0``, so the endpoints are computed as the KLs."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"distill.beta={beta!r}: in [0, 1] (0 forward KL, 1 reverse KL, between: JSD).")
    if temperature <= 0:
        raise ValueError(f"distill.temperature={temperature!r}: must be > 0.")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ: the two models need the same vocabulary "
                         "(check_vocab(), then slice both to its size).")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1.0 - beta)]), dim=0)
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1.0 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
               kind: str = "forward_kl", temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Mean over ``mask`` of the per-position divergence ``kind`` (``forward_kl`` | ``reverse_kl`` | ``jsd`` with
    teacher weight ``beta``) between same-vocabulary logits, times ``temperature^2``."""
    per_token = generalized_jsd(student_logits, teacher_logits, gkd_beta(kind, beta), temperature)
    return _masked_mean(per_token, mask) * temperature**2


def next_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` labels (-100 = ignore) -> ``[B, L - 1]`` mask of the logits positions that predict a
    labelled token (position ``t`` predicts token ``t + 1``)."""
    return labels[:, 1:] != -100


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      kind: str = "forward_kl", temperature: float = 1.0, alpha: float = 1.0,
                      beta: float = 0.5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``alpha * divergence + (1 - alpha) * cross-entropy`` on the labelled positions (``labels`` -100 elsewhere);
    returns ``(loss, {"divergence", "ce"})``."""
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


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                         beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Mean of :func:`generalized_jsd` over the positions where ``mask [B, T]`` is set (GKD's ``batchmean`` over
    the labelled tokens); 0 when none is (not NaN). The teacher's logits are detached."""
    return _masked_mean(generalized_jsd(student_logits, teacher_logits.detach(), beta, temperature), mask)


def response_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, context_length: int,
                          action_mask: torch.Tensor, beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """:func:`generalized_jsd_loss` on a rollout's response tokens (logits of prompt ``C`` + response, positions
    ``C - 1 .. L - 2``; ``action_mask [B, T]``: the student's own tokens)."""
    if context_length < 1:
        raise ValueError(f"context_length must be >= 1 (the prompt predicts the first response token), got "
                         f"{context_length}.")
    T = action_mask.shape[-1]
    if student_logits.shape[1] != context_length + T:
        raise ValueError(f"logits cover {student_logits.shape[1]} positions, prompt + response is "
                         f"{context_length} + {T}.")
    s = student_logits[:, context_length - 1:-1]
    t = teacher_logits[:, context_length - 1:-1]
    return generalized_jsd_loss(s, t, action_mask, beta, temperature)


def sampled_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, context_length: int,
                         action_mask: torch.Tensor, kind: str = "forward_kl", temperature: float = 1.0,
                         beta: float = 0.5) -> torch.Tensor:
    """The offline objective (:func:`divergence`, ``tau^2`` included) on a rollout's response tokens, so on-policy
    and offline batches of one run differ only in where the responses come from (GKD's ``lambda``)."""
    loss = response_distill_loss(student_logits, teacher_logits, context_length, action_mask,
                                 gkd_beta(kind, beta), temperature)
    return loss * temperature**2


def check_vocab(student_vocab_size: int, teacher_vocab_size: int, student_tokenizer: Any = None,
                teacher_tokenizer: Any = None) -> int:
    """How many leading logits teacher and student share, or a ``ValueError`` saying why they cannot be compared:
    different logit sizes (padded embeddings) pass only with equal tokenizers no larger than either model's logits."""
    fix = ("use a teacher and a student of one model family (one tokenizer), or train the student on text the "
           "teacher generated (sequence-level distillation: rlhf_sft on the teacher's answers) instead of its logits")
    s, t = int(student_vocab_size), int(teacher_vocab_size)
    if student_tokenizer is not None and teacher_tokenizer is not None:
        sv, tv = dict(student_tokenizer.get_vocab()), dict(teacher_tokenizer.get_vocab())
        if sv != tv:
            differ = sorted(set(sv.items()) ^ set(tv.items()), key=str)[:3]
            raise ValueError(f"teacher and student tokenizers differ (student {len(sv)} tokens, teacher {len(tv)}; "
                             f"e.g. {differ}): their logits index different tokens. Fix: {fix}.")
        n = len(student_tokenizer)
        if s < n or t < n:
            raise ValueError(f"the tokenizer has {n} tokens but the student has {s} logits and the teacher {t}: a "
                             f"model has fewer logits than tokens. Fix: {fix}.")
        return n if s != t else s
    if s != t:
        raise ValueError(f"teacher vocabulary size {t} != student vocabulary size {s}: the per-token divergence "
                         "compares the two distributions entry by entry. If both use one tokenizer and only the "
                         "embedding matrices are padded to different sizes, pass both tokenizers to check_vocab "
                         f"(the loss then uses the real tokens only); otherwise {fix}.")
    return s


def on_policy_batch(seed: int, step: int, fraction: float) -> bool:
    """Whether step ``step`` uses the student's own samples (GKD's lambda): ``u < fraction`` from a generator
    seeded by ``(seed, step)``, the same on every rank and after a resume."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"distill.on_policy_fraction={fraction!r}: the share of batches the student samples, in "
                         "[0, 1] (0 = offline distillation, 1 = always on-policy).")
    g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step) * 7919 + 17) % (2**63 - 1))
    u = float(torch.rand((), generator=g, dtype=torch.float64))
    return u < fraction


def prompts_of_demonstrations(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                              pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask)`` ``[B, C]`` of right-padded demonstrations, left padded for generation: a row's
    tokens before its first labelled one (at least one; all its real tokens when none is labelled)."""
    labelled = labels != -100
    real = attention_mask.long().sum(1)
    first = torch.where(labelled.any(1), labelled.long().argmax(1), real)
    lengths = first.clamp(min=1).tolist()
    C = max(lengths)
    ids = torch.full((input_ids.shape[0], C), int(pad_token_id), dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((input_ids.shape[0], C), dtype=attention_mask.dtype, device=attention_mask.device)
    for i, n in enumerate(lengths):
        ids[i, C - n:] = input_ids[i, :n]
        mask[i, C - n:] = 1
    return ids, mask


@torch.no_grad()
def student_samples(registry: Any, role: str, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: Any,
                    eos_token_id: int, pad_token_id: int, seed: int, record: bool = False) -> dict[str, Any]:
    """The student's answers to left-padded prompts (collective; torch seeded with ``seed``): ``sequences``,
    ``attention_mask``, ``action_mask`` (up to the first EOS), ``context_length`` and ``routing``: with ``record``
    (router replay) the experts each token of an MoE student went to, else None."""
    from multiengine.pipelines.rlhf.generation import generate, generate_routed
    from multiengine.pipelines.rlhf.ppo import action_mask

    torch.manual_seed(seed)
    routing = None
    if record:
        response, routing, _ = generate_routed(registry, prompt_ids, prompt_mask, settings, eos_token_id,
                                               pad_token_id, role=role)
    else:
        response = generate(registry, prompt_ids, prompt_mask, settings, eos_token_id, pad_token_id, role=role)
    action = action_mask(response, eos_token_id)
    return {"sequences": torch.cat([prompt_ids, response], dim=1),
            "attention_mask": torch.cat([prompt_mask, action.to(prompt_mask.dtype)], dim=1),
            "action_mask": action, "context_length": prompt_ids.shape[1], "routing": routing}


def role_logits(registry: Any, role: str, batch: dict[str, torch.Tensor], vocab: int,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``role``'s logits of ``batch``'s tokens (packed where its engine packs), cut to the first ``vocab`` (the logits
    teacher and student share: padded embeddings of one tokenizer, :func:`check_vocab`)."""
    engine = registry[role]
    if packs(engine):
        logits = lm_forward(engine, batch["input_ids"], batch["attention_mask"])
    else:
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        position_ids=position_ids, use_cache=False).logits
    return logits if logits.shape[-1] == vocab else logits[..., :vocab]


@torch.no_grad()
def heldout_cross_entropy(registry: Any, role: str, batches: list[dict[str, torch.Tensor]], vocab: int
                          ) -> float | None:
    """``role``'s next-token cross-entropy on the labelled tokens of ``batches`` (labels -100 elsewhere), a mean
    over every such token of every rank (collective); ``None`` without batches."""
    from multiengine.engines import mean_over_ranks
    from multiengine.pipelines.rlhf.scoring import eval_mode

    if not batches:
        return None
    total = count = 0.0
    with eval_mode(registry, role):
        for batch in batches:
            batch = {k: v.to(registry.device) for k, v in batch.items()}
            logits = role_logits(registry, role, batch, vocab)[:, :-1].float()
            target = batch["labels"][:, 1:]
            mask = target != -100
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.clamp(min=0).reshape(-1),
                                 reduction="none").view(target.shape)
            total += float((ce * mask).sum())
            count += float(mask.sum())
    sums = mean_over_ranks({"total": total, "count": count})
    return sums["total"] / max(sums["count"], 1.0)

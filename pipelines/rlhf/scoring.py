"""Forwards of RLHF roles: policy logits and log-probs, critic values, reward-model scores.

Every call goes through the role's engine (ZeRO-3 fetch hooks, or whole weights for a small role: scoring_mode);
every rank must make the same calls in the same order (each ZeRO-3 forward is a collective).

Shapes: ``B`` rows, ``C`` padded prompt length, ``T`` response length, ``L = C + T``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from multiengine.engines import EngineRegistry, moe, packing
from multiengine.engines.packing import lm_forward

from . import ppo
from .losses import sequence_logprob
from .models import last_token_index

__all__ = ["eval_mode", "lm_logprobs", "policy_logits", "role_logprobs", "role_values", "scoring_mode",
           "sequence_logprobs", "sequence_scores"]


@contextlib.contextmanager
def eval_mode(registry: EngineRegistry, role: str) -> Iterator[Any]:
    """The role's engine with its module in eval mode (restored on exit); rollout scoring must see
    the numbers the training forwards see, without dropout."""
    module = registry.role(role).module
    if not module.training:  # frozen roles are built in eval mode: no walk over the modules twice per forward
        yield registry[role]
        return
    module.eval()
    try:
        yield registry[role]
    finally:
        module.train()


@contextlib.contextmanager
def scoring_mode(registry: EngineRegistry, role: str) -> Iterator[Any]:
    """:func:`eval_mode` for a no-grad scoring forward, on whole weights where a ZeRO-3 role is no larger than what
    DeepSpeed may hold gathered at once (its prefetch bucket and live-parameter limit): one coalesced all-gather and
    no per-layer fetch hooks, which cost more than a model that small computes."""
    r = registry.role(role)
    zero = r.config.get("zero_optimization", {})
    limit = min(zero.get("stage3_prefetch_bucket_size", 0), zero.get("stage3_max_live_parameters", 0))
    small = r.stage == 3 and not r.spec.gather_forward and \
        sum(getattr(p, "ds_numel", p.numel()) for p in r.module.parameters()) <= limit  # gather_forward: its own
    with registry.gathered(role) if small else contextlib.nullcontext(), eval_mode(registry, role) as engine:
        yield engine


def policy_logits(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]`` logits of a causal-LM engine: packed where the engine packs, else positions from the mask (left
    padding safe)."""
    return lm_forward(engine, input_ids, attention_mask)


def sequence_scores(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` scalar-head scores at the last real token (through the engine, so ZeRO-3 hooks run)."""
    values = lm_forward(engine, input_ids, attention_mask)
    return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)


def lm_logprobs(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, context_length: int,
                temperature: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` float32 log-probs of the response tokens ``input_ids[:, C:]`` (:func:`ppo.logprobs_from_logits`) and
    with ``entropy`` their distributions' ``[B, T]`` entropies (no grad). Packed where the engine packs: only the
    logits that score a real response token after a real one are taken, and only the per-token figures unpacked
    (0 elsewhere), never ``[B, L, V]`` logits; padded, the model's head runs only where it scores the response
    (transformers' ``logits_to_keep``)."""
    C, T = context_length, input_ids.shape[1] - context_length
    where = None
    if not packing.packs(engine):
        keep = {"logits_to_keep": T + 1} if packing.keeps_logits(engine) else {}
        z, labels = lm_forward(engine, input_ids, attention_mask, **keep)[:, -T - 1:-1], input_ids[:, C:]
    else:
        p = packing.pack(input_ids, attention_mask)  # through the module: one place packs every pass
        logits = packing.packed_output(engine, p)
        # real tokens of the response whose predecessor is real: that one sits in the slot before theirs
        column, flat_mask = p.index % input_ids.shape[1], attention_mask.reshape(-1).bool()
        scored = (column >= C) & flat_mask[(p.index - 1).clamp(min=0)] & (column > 0)
        where = p.index[scored]
        z = logits.reshape(-1, logits.shape[-1]).index_select(0, p.slots[scored] - 1)
        labels = input_ids.reshape(-1)[where]
    logp = ppo.logprobs_from_logits(z, labels, temperature)
    ent = None
    if entropy:
        with torch.no_grad():
            ent = ppo.entropy_from_logits(z.float() / temperature)
    if where is None:
        return logp, ent

    def unpacked(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(attention_mask.numel()).index_copy(0, where, x).view(attention_mask.shape)[:, C:]

    return unpacked(logp), None if ent is None else unpacked(ent)


@torch.no_grad()
def role_logprobs(registry: EngineRegistry, role: str, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  context_length: int, temperature: float = 1.0, routing: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` log-probs of the response tokens under ``role`` (eval mode, no grad); an MoE role's tokens routed
    to the experts ``routing`` (``[B, L, layers, k]``, router replay) gives."""
    with scoring_mode(registry, role) as engine, moe.tapped(engine, routing) if routing is not None \
            else contextlib.nullcontext():
        return lm_logprobs(engine, sequences, attention_mask, context_length, temperature)[0]


@torch.no_grad()
def role_values(registry: EngineRegistry, role: str, sequences: torch.Tensor, attention_mask: torch.Tensor,
                context_length: int) -> torch.Tensor:
    """``[B, T]`` critic values aligned with the response tokens (eval mode, no grad)."""
    with scoring_mode(registry, role) as engine:
        values = lm_forward(engine, sequences, attention_mask).float()
        return ppo.response_values(values, context_length)


def sequence_logprobs(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B]`` log-prob of each row's response: the sum over the tokens where ``response_mask`` is set
    (DPO's ``log pi(y | x)``), through the engine (with grad if the caller allows it)."""
    logits = policy_logits(engine, input_ids, attention_mask)
    return sequence_logprob(logits, input_ids, response_mask, temperature)

"""Packed passes: the real tokens of a padded ``[B, L]`` batch laid end to end in one ``[1, N]`` row, position ids
restarting at 0 for each sequence, no attention mask and no cache, so no arithmetic is spent on padding.

transformers confines attention to each packed sequence itself when it gets position ids that restart and no mask
(``masking_utils.find_packed_sequence_indices``, for sdpa and eager; flash-attention's variable-length kernels read
the same position ids). Families that derive positions or masks their own way (OPT's learned positions come from
the mask) give other numbers packed, so only :data:`PACKABLE_FAMILIES` pack. :meth:`Packed.unpack` puts each
per-position output back where the padded pass has it, so losses and their normalisation do not change.

Micro-batches by token budget (:func:`budget_split`): a step's rows spread over micro-batches of at most ``budget``
tokens each, balanced, in a number of micro-batches every rank agrees on (ZeRO-3 gathers are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import moe

__all__ = ["PACKABLE_FAMILIES", "Packed", "budget_split", "family_packs", "keeps_logits", "lm_forward", "pack",
           "packed_output", "packs", "token_budget"]

# model_type values whose transformers attention (sdpa, eager; 5.x) gives a packed sequence the logits it has alone
# (tests/unit/test_packing.py checks each against its padded pass); OPT is not among them.
PACKABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
                               "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"})


def family_packs(config: Any) -> bool:
    """Whether a model of this transformers config packs (its ``model_type`` is in :data:`PACKABLE_FAMILIES`)."""
    return str(getattr(config, "model_type", "")) in PACKABLE_FAMILIES


def packs(engine: Any) -> bool:
    """Whether the registry built ``engine`` to run its token-sequence passes packed (``RoleSpec.packed``)."""
    return bool(getattr(engine, "packed_sequences", False))


def token_budget(engine: Any) -> int:
    """The tokens per micro-batch the registry built ``engine`` with (``RoleSpec.token_budget``; 0 = rows)."""
    return int(getattr(engine, "token_budget", 0) or 0)


@dataclass(frozen=True)
class Packed:
    """Packed rows: ``input_ids`` / ``position_ids`` ``[R, C]``, and ``index``, where each real token of the flattened
    ``[R * C]`` rows sits in the flattened ``[B, L]`` batch of ``shape`` (``slots``: its place in the packed rows)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    slots: torch.Tensor
    shape: tuple[int, int]

    def unpack(self, out: torch.Tensor) -> torch.Tensor:
        """``[R, C, ...]`` per-token outputs -> ``[B, L, ...]``, zeros at the padding (differentiable)."""
        flat = out.new_zeros((self.shape[0] * self.shape[1], *out.shape[2:]))
        picked = out.reshape(-1, *out.shape[2:]).index_select(0, self.slots)
        return flat.index_copy(0, self.index, picked).view(*self.shape, *out.shape[2:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int = 0) -> Packed:
    """The real tokens (mask 1) of each row laid end to end in rows of ``capacity`` tokens (0 = the batch's width),
    longest sequences first, each into the first row with room. Positions count the real tokens of their sequence
    from 0, as the padded pass's positions from the mask do; a row's unused tail is one more sequence (of token 0)
    whose outputs nobody reads. Rows no longer than the padded ones keep sdpa's dense attention, which computes every
    pair of a row, from costing more than the padded pass."""
    mask = attention_mask.bool()
    lengths = mask.sum(-1).tolist()
    capacity = max(capacity or mask.shape[1], max(lengths, default=1), 1)
    rows: list[list[int]] = []
    room: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
        if not lengths[b]:
            continue
        r = next((r for r, left in enumerate(room) if left >= lengths[b]), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(capacity)
        rows[r].append(b)
        room[r] -= lengths[b]
    positions = mask.long().cumsum(-1) - 1
    width = capacity - min(room, default=0) if rows else 1
    ids = torch.zeros(max(len(rows), 1), width, dtype=input_ids.dtype, device=input_ids.device)
    pos = torch.arange(width, device=input_ids.device).repeat(ids.shape[0], 1)
    index, slots = [], []
    for r, members in enumerate(rows):
        start = 0
        for b in members:
            where = mask[b].nonzero().squeeze(1)
            n = where.numel()
            ids[r, start:start + n] = input_ids[b, where]
            pos[r, start:start + n] = positions[b, where]
            index.append(where + b * mask.shape[1])
            slots.append(torch.arange(r * width + start, r * width + start + n, device=ids.device))
            start += n
        pos[r, start:] = torch.arange(width - start, device=ids.device)  # the tail: a sequence of its own
    empty = torch.zeros(0, dtype=torch.long, device=ids.device)
    return Packed(ids, pos, torch.cat(index) if index else empty, torch.cat(slots) if slots else empty,
                  (int(mask.shape[0]), int(mask.shape[1])))


def packed_output(engine: Any, p: Packed) -> torch.Tensor:
    """``[R, C, ...]`` per-position output of ``engine`` on the packed rows ``p`` (no mask, no cache); an open router
    tap (engines.moe) is told where each token went."""
    tap = moe.tap_of(engine)
    if tap is not None:
        tap.packed(p.index, p.slots, p.input_ids.numel())
    out = engine(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False)
    return getattr(out, "logits", out)


def lm_forward(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``[B, L, ...]`` per-position output of ``engine`` (a causal LM's logits, a scalar head's values), computed
    packed when the engine packs, else on the padded rows with positions from the mask (left padding safe;
    ``kwargs``: more for the padded forward)."""
    if packs(engine):
        p = pack(input_ids, attention_mask)
        return p.unpack(packed_output(engine, p))
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    tap = moe.tap_of(engine)
    if tap is not None:
        tap.packed(None)
    out = engine(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False, **kwargs)
    return getattr(out, "logits", out)


def keeps_logits(engine: Any) -> bool:
    """Whether the causal LM under ``engine`` (through a peft wrapper) takes ``logits_to_keep`` (transformers')."""
    import inspect

    module = getattr(engine, "module", engine)
    module = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "logits_to_keep" in inspect.signature(module.forward).parameters


def _balanced(lengths: list[int], count: int) -> list[list[int]]:
    """Rows (longest first) each into the micro-batch holding the fewest tokens so far; rows kept in order."""
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(count), key=lambda b: (loads[b], b))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def budget_split(lengths: list[int], budget: int, count: int = 0) -> list[list[int]]:
    """Row indices of the micro-batches of one optimizer step's ``lengths`` (tokens per row): with ``count`` 0 the
    fewest micro-batches of at most ``budget`` tokens each (a longer row alone), balanced; with ``count``, exactly
    that many (at most ``len(lengths)``: every rank runs the same number, the largest any rank needs)."""
    if not lengths:
        raise ValueError("a token-budget split needs at least one row")
    if count:
        return _balanced(lengths, min(count, len(lengths)))
    n = max(1, -(-sum(lengths) // budget))
    while n < len(lengths):
        bins = _balanced(lengths, n)
        if all(len(b) == 1 or sum(lengths[i] for i in b) <= budget for b in bins):
            return bins
        n += 1
    return [[i] for i in range(len(lengths))]

"""Preference batches for DPO-style training: which tokens of a :class:`PairCollator` row are the
response, and the per-row response log-probs of a policy.

A :class:`PairCollator` batch holds ``2B`` right-padded rows, ``prompt + chosen + EOS`` for pairs
``0..B-1`` then ``prompt + rejected + EOS``. :class:`PreferenceCollator` wraps one and adds
``prompt_lengths`` ``[B]`` (and precomputed reference log-probs when the rows carry them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .scoring import sequence_logprobs

__all__ = ["REF_KEYS", "PreferenceCollator", "pair_logprobs", "preference_response_mask"]

# row fields written by DPOTrainer.precompute_reference, and the batch keys they become
REF_KEYS = {"ref_chosen_logp": "ref_chosen_logps", "ref_rejected_logp": "ref_rejected_logps"}


class PreferenceCollator:
    """A :class:`PairCollator` batch plus ``prompt_lengths`` ``[B]`` (tokens of each pair's prompt,
    encoded as the pair collator encodes it) and, when every example has ``ref_chosen_logp`` /
    ``ref_rejected_logp``, the tensors ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[B]``."""

    def __init__(self, pairs: Any) -> None:
        if not hasattr(pairs, "prompt_ids"):
            raise TypeError(f"{type(pairs).__name__} has no prompt_ids(); wrap a PairCollator.")
        self.pairs = pairs

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = dict(self.pairs(examples))
        batch["prompt_lengths"] = torch.tensor([len(self.pairs.prompt_ids(e["prompt"])) for e in examples])
        for row_key, batch_key in REF_KEYS.items():
            if all(row_key in e for e in examples):
                batch[batch_key] = torch.tensor([float(e[row_key]) for e in examples], dtype=torch.float32)
        return batch


def preference_response_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[2B, L]`` mask of the response tokens (EOS included) of a pair batch: after ``prompt_lengths``, or without
    them at the first token where a pair's rows differ (a common start of both responses has the same log-probs in
    both rows, so DPO / IPO margins and losses are unchanged; only the separate implicit rewards shift)."""
    ids, attn = batch["input_ids"], batch["attention_mask"].bool()
    rows, L = ids.shape
    if rows % 2:
        raise ValueError(f"a pair batch has an even number of rows (chosen then rejected), got {rows}.")
    B = rows // 2
    positions = torch.arange(L, device=ids.device).expand(rows, L)
    if "prompt_lengths" in batch:
        start = batch["prompt_lengths"].to(ids.device).long().repeat(2)
    else:
        same = (ids[:B] == ids[B:]) & attn[:B] & attn[B:]
        common = same.long().cumprod(-1).sum(-1)  # length of the shared prefix of each pair
        start = common.repeat(2)
    start = start.clamp_min(1)  # position 0 has no predecessor
    return ((positions >= start.unsqueeze(1)) & attn).to(torch.float32)


def pair_logprobs(engine: Any, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chosen [B], rejected [B])`` response log-probs of a pair batch under ``engine`` (one forward of
    all ``2B`` rows; with grad if the caller allows it)."""
    mask = preference_response_mask(batch)
    logps = sequence_logprobs(engine, batch["input_ids"], batch["attention_mask"], mask)
    B = logps.shape[0] // 2
    return logps[:B], logps[B:]

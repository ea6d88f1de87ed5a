"""Loss helpers of RLHF steps 1 and 2: supervised fine-tuning of the actor and the pairwise
(Bradley-Terry) reward-model loss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from multiengine.engines import moe
from multiengine.engines.packing import lm_forward, packs

from .models import pairwise_loss
from .scoring import sequence_scores

__all__ = ["causal_lm_loss", "reward_loss"]


def causal_lm_loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy on ``labels`` (-100 = ignored), ``[B, L]`` batch of :class:`SFTCollator`; packed
    where the engine packs (the same tokens and mean as transformers' loss)."""
    if packs(engine):
        logits = lm_forward(engine, batch["input_ids"], batch["attention_mask"])[:, :-1].float()
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False, **moe.router_logits_off(engine))  # an MoE's auxiliary loss: the caller's
    return out.loss


def reward_loss(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise loss and accuracy for a :class:`PairCollator` batch (``[2B, L]``: chosen then rejected)."""
    scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"])
    half = scores.shape[0] // 2
    return pairwise_loss(scores[:half], scores[half:])

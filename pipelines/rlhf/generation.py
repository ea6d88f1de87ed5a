"""Generation from a (possibly ZeRO-3 partitioned) actor, two ways.

``mode="gather"`` (default): ``registry.generation(role)``: the actor's parameters are gathered once
per batch and DeepSpeed's per-module fetch/release hooks are detached for the duration, so every token
runs on full local weights with no communication (what TRL's ``unwrap_model_for_generation`` does;
DeepSpeed's Hybrid Engine does the same on the few GPU model families it supports). Costs one full
copy of the actor per rank while it runs.

``mode="per_token"``: the ZeRO-3 path, ``generate(synced_gpus=True)``: every token of every layer is
gathered and released again (the ~700 ms/token of DeepSpeedExamples#764 on big models), but no rank
ever holds the whole actor (TRL #2557). ``synced_gpus`` keeps a rank that finished early running dummy
forwards until all ranks are done, since each forward is a collective.

Below stage 3 both modes are plain ``generate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from multiengine.engines import EngineRegistry

from .ppo import truncate_after_eos

logger = logging.getLogger(__name__)

__all__ = ["GenerationSettings", "generate", "position_ids_from_mask"]

GENERATION_MODES = ("gather", "per_token")


@dataclass
class GenerationSettings:
    """Sampling settings; ``temperature`` is also what the PPO log-probs divide logits by."""

    max_new_tokens: int = 16
    do_sample: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    mode: str = "gather"  # gather | per_token

    def __post_init__(self) -> None:
        if self.mode not in GENERATION_MODES:
            raise ValueError(f"generation mode={self.mode!r}; use one of {list(GENERATION_MODES)}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting real tokens only (left padding safe), as ``generate`` computes them."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@torch.no_grad()
def generate(
    registry: EngineRegistry,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationSettings,
    eos_token_id: int,
    pad_token_id: int,
    role: str = "actor",
) -> torch.Tensor:
    """Responses to left-padded prompts; every rank must call it (same number of times).

    Args:
        input_ids: ``[B, C]`` left-padded prompts.
        attention_mask: ``[B, C]``.

    Returns:
        ``[B, T]`` response tokens (``T <= max_new_tokens``), padded with ``pad_token_id`` after the
        first EOS (rows that stopped early are not continued into the padding).
    """
    r = registry.role(role)
    synced = settings.mode == "per_token" and r.backend == "deepspeed" and r.stage == 3 and registry.world_size > 1
    kwargs = dict(
        max_new_tokens=settings.max_new_tokens,
        do_sample=settings.do_sample,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        synced_gpus=synced,
        use_cache=True,
    )
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    with registry.generation(role, gather=settings.mode == "gather") as module:
        out = module.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    response = out[:, input_ids.shape[1]:]
    return truncate_after_eos(response, eos_token_id, pad_token_id)

"""EMA of a trainable role kept as its own (frozen, stateful) role, sharded like its source.

Under ZeRO-3 both roles partition identical shapes identically, so the update runs on each
rank's local partitions: no gather, no full copy on any rank (diffusers' EMAModel keeps a full
unsharded copy and gathers every parameter every step).
"""

from __future__ import annotations

import torch

from .partition import local_tensors, refresh_full_copies


@torch.no_grad()
def ema_update(ema: torch.nn.Module, source: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * source, on this rank's partitions.

    Both modules must have the same parameter shapes and the same ZeRO stage/world size. All ranks
    must call it under ZeRO-3 (persistent parameters held whole are re-gathered afterwards).
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"ema decay={decay!r} must be in [0, 1].")
    targets, sources = local_tensors(ema), local_tensors(source)
    if len(targets) != len(sources):
        raise ValueError(f"EMA has {len(targets)} parameters but its source has {len(sources)}.")
    for t, s in zip(targets, sources):
        if t.shape != s.shape:
            raise ValueError(
                f"EMA partition shape {tuple(t.shape)} != source {tuple(s.shape)}: build the EMA role at the same"
                " ZeRO stage as its source."
            )
        t.lerp_(s.to(t.dtype), 1.0 - decay)
    refresh_full_copies(ema)


def ema_decay(step: int, max_decay: float = 0.9999, warmup: bool = True) -> float:
    """The decay diffusers' EMAModel uses with its default warm-up: min(max, (1 + step) / (10 + step))."""
    if not warmup:
        return max_decay
    return min(max_decay, (1 + step) / (10 + step))

"""EMA of a trainable role kept as its own (frozen, stateful) role sharded like its source: the update runs on each
rank's partitions, with no gather and no full copy (diffusers' EMAModel gathers every parameter every step).
"""

from __future__ import annotations

import torch

from .partition import local_tensors, refresh_full_copies


@torch.no_grad()
def ema_update(ema: torch.nn.Module, source: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * source on this rank's partitions (same shapes, stage and world size); all
    ranks call it under ZeRO-3 (the persistent parameters are re-gathered after)."""
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


def ema_decay(
    optimization_step: int,
    decay: float = 0.9999,
    min_decay: float = 0.0,
    update_after_step: int = 0,
    use_ema_warmup: bool = False,
    inv_gamma: float = 1.0,
    power: float = 2 / 3,
) -> float:
    """The decay of diffusers' ``EMAModel.get_decay`` (same option names and defaults).

    ``optimization_step`` counts optimizer steps taken so far, including the one just taken (1 after the
    first; EMAModel's ``optimization_step`` after its increment). With ``s = optimization_step -
    update_after_step - 1``: 0 while ``s <= 0`` (the EMA copies the weights), else ``1 - (1 + s / inv_gamma)
    ** -power`` with ``use_ema_warmup`` and ``(1 + s) / (10 + s)`` without, clamped to ``[min_decay, decay]``.
    """
    for name, value in (("decay", decay), ("min_decay", min_decay)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"ema {name}={value!r} must be in [0, 1].")
    if min_decay > decay:
        raise ValueError(f"ema min_decay={min_decay} is above decay={decay}; use min_decay <= decay.")
    if use_ema_warmup and not (inv_gamma > 0 and power > 0):
        raise ValueError(f"ema inv_gamma={inv_gamma}, power={power}: both must be > 0 with use_ema_warmup.")
    step = max(0, optimization_step - update_after_step - 1)
    if step <= 0:
        return 0.0
    if use_ema_warmup:
        value = 1 - (1 + step / inv_gamma) ** -power
    else:
        value = (1 + step) / (10 + step)
    return max(min(value, decay), min_decay)

"""Optimizers by name, for role factories: torch AdamW, DeepSpeed's own Adam for the accelerator, SGD.

``"ds_adam"`` is the Adam that DeepSpeed ships for where the optimizer step runs: its vectorised CPU
Adam (``DeepSpeedCPUAdam``) when the step runs on the host (DeepSpeed's CPU accelerator, or an
offloaded optimizer), its multi-tensor ``FusedAdam`` on a GPU. Both are AdamW (decoupled weight
decay), so they are drop-in replacements for ``"adamw"``. Each compiles a small C++/CUDA op on first
use (about a minute, then cached in torch's extensions folder).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["OPTIMIZERS", "build_optimizer", "ds_adam_kind", "resolve_optimizer"]

OPTIMIZERS = ("adamw", "ds_adam", "sgd")


def ds_adam_kind(offload: bool) -> str:
    """Which DeepSpeed Adam ``"ds_adam"`` means here: ``"cpu_adam"`` or ``"fused_adam"``."""
    if offload:
        return "cpu_adam"
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as exc:  # torch-only install
        raise ValueError("optimizer 'ds_adam' needs deepspeed, which does not import here; use 'adamw'.") from exc
    return "cpu_adam" if get_accelerator().device_name() == "cpu" else "fused_adam"


def resolve_optimizer(name: str, offload: bool) -> str:
    """``"auto"``: DeepSpeed's Adam where it pays: an offloaded optimizer (DeepSpeed requires its CPU Adam)
    or a GPU (FusedAdam); torch's AdamW on a CPU-only machine, where the tiny roles' optimizer step is
    well under a millisecond and the CPU Adam's first-use build costs a minute. Other names as given."""
    if name != "auto":
        return name
    if offload:
        return "ds_adam"
    if torch.cuda.is_available():
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            return "adamw"
        return "ds_adam"
    return "adamw"


def build_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params``.

    Args:
        name: ``"adamw"`` (``torch.optim.AdamW``), ``"ds_adam"`` (DeepSpeed's AdamW for where the
            step runs: ``DeepSpeedCPUAdam`` on the CPU accelerator or with ``offload``, ``FusedAdam``
            on a GPU) or ``"sgd"`` (plain ``torch.optim.SGD``; ``betas`` and ``eps`` unused).
        offload: the role's optimizer state lives on the host (``offload_optimizer``); DeepSpeed then
            requires its CPU Adam, so ``"adamw"`` with ``offload=True`` is an error naming the fix.

    ``lr``, ``betas``, ``eps``, ``weight_decay``: checked where they are set (:class:`~.roles.OptimSpec`).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer name={name!r} is not known; use one of {list(OPTIMIZERS)}.")
    params = list(params)
    betas = (float(betas[0]), float(betas[1]))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        if offload:
            # DeepSpeed steps an offloaded optimizer on the host and accepts only its own CPU optimizers there.
            raise ValueError("optimizer 'adamw' with offload_optimizer=True: DeepSpeed needs its CPU Adam for an "
                             "offloaded optimizer; use optimizer 'ds_adam'.")
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if ds_adam_kind(offload) == "cpu_adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True)
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)

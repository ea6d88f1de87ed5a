"""ZeRO-3 partition helpers: the storage a rank owns, and whole-parameter access to a built engine.

Everything here is a no-op for modules that were never partitioned (stage 0/1/2, the torch backend).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (built under zero.Init or converted by a stage-3 engine)."""
    return hasattr(param, "ds_tensor")


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameter storage this rank owns: ZeRO-3 partitions (ds_tensor), else the full tensors."""
    return [p.ds_tensor if is_partitioned(p) else p.data for p in module.parameters()]


def refresh_full_copies(module: torch.nn.Module) -> None:
    """After writing ZeRO-3 partitions (ds_tensor) directly, re-gather the parameters that are
    currently held whole. DeepSpeed keeps persistent parameters (small ones, below
    stage3_param_persistence_threshold) gathered between forwards once its trace is complete;
    their full copy would otherwise keep the old values for every later forward and gather.
    Collective when any such parameter exists: all ranks must call it (they share the trace)."""
    from_zero = [p for p in module.parameters() if is_partitioned(p)]
    if not from_zero:
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held = [p for p in from_zero if p.ds_status == ZeroParamStatus.AVAILABLE]
    if held:
        held[0].partition(param_list=held, has_been_updated=False)  # drop the stale full copies
        held[0].all_gather(param_list=held)  # and rebuild them from the updated partitions


def zero3_offload(engine: Any) -> Any | None:
    """The ZeRO-3 parameter-offload object of an engine (owner of the fetch/release hooks), or None."""
    optimizer = getattr(engine, "optimizer", None)
    # A trainable role's ZeRO-3 optimizer owns one; a frozen role's engine holds the offload object
    # itself in place of an optimizer.
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if hasattr(offload, "forward_hooks") else None


@contextlib.contextmanager
def hooks_detached(engine: Any) -> Iterator[None]:
    """ZeRO-3's per-module fetch/release hooks off for the block (all parameters must be whole, i.e.
    inside a full gather), back on afterwards.

    Before detaching, every prefetch still in flight from the last training step is waited for and
    every fetched parameter released: a forward with a different module order (``generate``) would
    otherwise meet parameters that are "in flight" or "active in submodules" when the gather ends.
    Re-registering the hooks makes DeepSpeed record its fetch trace again on the next forward.
    """
    offload = zero3_offload(engine)
    if offload is None:
        yield
        return
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    offload.get_param_coordinator().release_and_reset_all(offload.module)
    for param in iter_params(offload.module, recurse=True):
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module)


__all__ = ["hooks_detached", "is_partitioned", "local_tensors", "refresh_full_copies", "zero3_offload"]

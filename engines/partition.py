"""ZeRO-3 partition helpers: the storage a rank owns, and whole parameters of a built engine (a no-op for modules
never partitioned). Gathers are coalesced, one flat collective per bucket of ``GATHER_BUCKET_NUMEL`` elements, as
ZeRO-3's own fetch is: DeepSpeed's ``GatheredParameters`` launches one per tensor (on gloo ~1 ms each, ~100 ms for a
small model of a hundred tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .deepspeed_adapter import GATHERED_MARK, zero3_hooks_off, zero3_hooks_on, zero3_offload

# Most elements one coalesced gather moves: its flat receive buffer is transient memory on top of the
# whole parameters (DeepSpeed's default prefetch bucket: 100 MB in bf16). Larger tensors go alone.
GATHER_BUCKET_NUMEL = int(5e7)



def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (built under zero.Init or converted by a stage-3 engine)."""
    return hasattr(param, "ds_tensor")


def local_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameter storage this rank owns: ZeRO-3 partitions (ds_tensor), else the full tensors."""
    return [p.ds_tensor if is_partitioned(p) else p.data for p in module.parameters()]


def _status() -> Any:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


def _zero_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ZeRO-3 parameters among ``params``, each once, in ``ds_id`` order (the same order on every rank:
    a coalesced collective must see the same list everywhere)."""
    unique = {id(p): p for p in params if is_partitioned(p)}
    return sorted(unique.values(), key=lambda p: p.ds_id)


def fetch(params: Iterable[torch.Tensor], bucket_numel: int = GATHER_BUCKET_NUMEL) -> list[torch.Tensor]:
    """Make the partitioned (NOT_AVAILABLE) ZeRO-3 parameters among ``params`` whole, with one coalesced
    all-gather per bucket; parameters already whole or in flight are left as they are. Returns those
    fetched. Collective: every rank passes the same parameters in the same state."""
    params = _zero_params(params)
    if not params:
        return []
    status = _status()
    todo = [p for p in params if p.ds_status == status.NOT_AVAILABLE]
    # Quantized partitions (ZeRO++ qwZ) have their own gather path in DeepSpeed.
    quantized = [p for p in todo if hasattr(p.ds_tensor, "ds_quant_scale")]
    if quantized:
        quantized[0].all_gather(param_list=quantized)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in (p for p in todo if not hasattr(p.ds_tensor, "ds_quant_scale")):
        if bucket and size + p.ds_numel > bucket_numel:
            bucket[0].all_gather_coalesced(bucket).wait()
            bucket, size = [], 0
        bucket.append(p)
        size += p.ds_numel
    if bucket:
        bucket[0].all_gather_coalesced(bucket).wait()
    return todo


def release(params: Iterable[torch.Tensor], has_been_updated: bool = False) -> None:
    """Back to 1/N: drop the whole copies of these ZeRO-3 parameters (no communication), after copying
    the whole values into this rank's partition when ``has_been_updated``."""
    status = _status()
    held = [p for p in _zero_params(params) if p.ds_status == status.AVAILABLE]
    if held:
        held[0].partition(param_list=held, has_been_updated=has_been_updated)


def _broadcast(params: list[torch.Tensor], modifier_rank: int) -> None:
    """Every rank's whole copies of ``params`` := ``modifier_rank``'s, one broadcast per process group and
    device (the bytes of all tensors in one flat buffer)."""
    import deepspeed.comm as dist

    groups: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((id(p.ds_process_group), p.data.device), []).append(p)
    for members in groups.values():
        group = members[0].ds_process_group
        src = modifier_rank if group == dist.get_world_group() else dist.get_global_rank(group, modifier_rank)
        flat = torch.cat([p.data.contiguous().view(-1).view(torch.uint8) for p in members])
        dist.broadcast(flat, src, group=group)
        offset = 0
        for p in members:
            n = p.data.numel() * p.data.element_size()
            p.data.view(-1).view(torch.uint8).copy_(flat[offset:offset + n])
            offset += n


@contextlib.contextmanager
def whole_parameters(params: Iterable[torch.Tensor], modifier_rank: int | None = None,
                     bucket_numel: int = GATHER_BUCKET_NUMEL) -> Iterator[None]:
    """``deepspeed.zero.GatheredParameters`` with coalesced collectives: the full values of these ZeRO-3 parameters
    for the block (all ranks, the same parameters); back to 1/N on exit, except the persistent ones ZeRO-3 keeps
    whole between forwards anyway. Read-only, unless ``modifier_rank``: that rank's values are broadcast (one
    collective) and written into every rank's partitions on exit."""
    params = _zero_params(params)
    if not params:
        yield
        return
    busy = [p.ds_id for p in params if getattr(p, GATHERED_MARK, 0) > 0]
    if busy:
        raise RuntimeError(f"parameters {busy[:8]} are already inside a GatheredParameters block; gather each "
                           "parameter once (registry.gathered is a no-op for a role already gathered).")
    fetched = fetch(params, bucket_numel)
    for p in params:  # a nested GatheredParameters over them fails loudly instead of re-partitioning them under us
        setattr(p, GATHERED_MARK, 1)
    completed = False
    try:
        yield
        completed = True
    finally:
        for p in params:
            delattr(p, GATHERED_MARK)
        if not completed or modifier_rank is None:
            # after an error: no collective (a peer may not be here), the changes are dropped
            release(p for p in fetched if not p.ds_persist)
    if modifier_rank is None:
        return
    whole = [p for p in params if p.ds_status == _status().AVAILABLE]
    _broadcast(whole, modifier_rank)
    release(whole, has_been_updated=True)
    fetch([p for p in params if p.ds_persist], bucket_numel)  # whole again, with the new values


def refresh_full_copies(module: torch.nn.Module) -> None:
    """After writing ZeRO-3 partitions (ds_tensor) directly, re-gather the parameters held whole (the persistent
    ones), whose full copy would keep the old values. Collective when there are any: all ranks call it."""
    from_zero = [p for p in module.parameters() if is_partitioned(p)]
    if not from_zero:
        return
    held = [p for p in from_zero if p.ds_status == _status().AVAILABLE]
    if held:
        release(held)  # drop the stale full copies
        fetch(held)  # and rebuild them from the updated partitions (coalesced)


@contextlib.contextmanager
def hooks_detached(engine: Any) -> Iterator[None]:
    """ZeRO-3's fetch/release hooks off for the block (inside a full gather), back on after. Prefetches in flight
    are waited for and fetched parameters released first: a forward in another module order (``generate``) would
    otherwise meet parameters "in flight" or "active in submodules" when the gather ends."""
    offload = zero3_offload(engine)
    if offload is None:
        yield
        return
    params = zero3_hooks_off(offload)
    release(p for p in params if not getattr(p, "ds_persist", False))
    try:
        yield
    finally:
        zero3_hooks_on(offload)


__all__ = ["GATHER_BUCKET_NUMEL", "fetch", "hooks_detached", "is_partitioned", "local_tensors", "refresh_full_copies",
           "release", "whole_parameters", "zero3_offload"]

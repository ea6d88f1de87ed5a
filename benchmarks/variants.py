"""Config variants for side-by-side measurements in ONE process (so every variant sees the same load).

A variant is one set of choices for the settings issue 13 changed: the "auto" bucket rule, DeepSpeed's
``memory_efficient_linear``, ``overlap_comm``, the optimizer, whether ``LOCAL_SIZE`` is exported
(DeepSpeed's CPU accelerator runs ``numactl --hardware`` for its device count without it, once per
ZeRO-3 gradient bucket), and how whole-parameter gathers are made (``registry.gathered``,
``registry.generation``, ``gather_forward``): one coalesced all-gather per bucket, persistent tensors
left whole (today), or DeepSpeed's ``GatheredParameters``, one all-gather per tensor, everything
re-partitioned on exit (before). ``legacy`` is what the library did before issue 13; ``default`` is
what it does now; the ``+x`` variants change one thing on top of ``legacy``; ``default@x`` change one
thing of ``default`` back.

Three of these settings are process-wide, so several variants in one process need them set per
variant while it runs (``running``): ``memory_efficient_linear`` replaces ``F.linear`` for the whole
process once any ZeRO-3 model is built with it, ``LOCAL_SIZE`` is an environment variable, and the
gather functions are module globals of the registry. Setting them back and forth reproduces exactly
what separate processes would see.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

# F.linear before any zero.Init can have replaced it (this module is imported before any build).
ORIGINAL_LINEAR = torch.nn.functional.linear

DS_DEFAULT_BUCKETS = {"reduce_bucket_size": int(5e8), "stage3_prefetch_bucket_size": int(5e7),
                      "stage3_param_persistence_threshold": int(1e5)}


def legacy_rule(h: int | None, total: int | None, trainable: int | None) -> dict[str, int]:
    """transformers' "auto": reduce h^2, prefetch 0.9 h^2, persistence 10 h (the factories' old rule)."""
    if not h:
        return dict(DS_DEFAULT_BUCKETS)
    return {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}


def ds_default_rule(h: int | None, total: int | None, trainable: int | None) -> dict[str, int]:
    """DeepSpeed's own defaults whatever the model (what a config without these keys gets)."""
    return dict(DS_DEFAULT_BUCKETS)


def current_rule(h: int | None, total: int | None, trainable: int | None) -> dict[str, int]:
    """What engines.config resolves "auto" to now (the rule under test)."""
    from multiengine.engines.config import auto_bucket_sizes

    return auto_bucket_sizes(h, total, trainable)


Rule = Callable[[int | None, int | None, int | None], dict[str, int]]


def _persistence(rule: Rule, threshold: Callable[[int | None], int]) -> Rule:
    def sized(h: int | None, total: int | None, trainable: int | None) -> dict[str, int]:
        out = rule(h, total, trainable)
        out["stage3_param_persistence_threshold"] = threshold(h)
        return out

    return sized


def _floor_1e4(h: int | None) -> int:
    return max(10 * (h or 0), int(1e4))


def _ds_persistence(h: int | None) -> int:
    return DS_DEFAULT_BUCKETS["stage3_param_persistence_threshold"]


RULES: dict[str, Rule] = {
    "legacy": legacy_rule,
    "ds_default": ds_default_rule,
    "current": current_rule,
    # the persistence threshold alone, on the old buckets or on today's: a 1e4 floor, or DeepSpeed's 1e5
    "legacy@persist1e4": _persistence(legacy_rule, _floor_1e4),
    "current@persist1e4": _persistence(current_rule, _floor_1e4),
    "current@persist_ds": _persistence(current_rule, _ds_persistence),
}


@dataclass(frozen=True)
class Variant:
    name: str
    rule: str = "current"
    memory_efficient_linear: bool = False
    overlap_comm: bool | None = None  # None: the factories' choice
    optimizer: str = "auto"  # OptimSpec's default: torch AdamW on a CPU-only machine, DeepSpeed's Adam on GPUs
    local_size: bool = True
    gather: str = "coalesced"  # or "per_tensor": DeepSpeed's GatheredParameters


LEGACY = Variant("legacy", rule="legacy", memory_efficient_linear=True, overlap_comm=False, optimizer="adamw",
                 local_size=False, gather="per_tensor")
VARIANTS: dict[str, Variant] = {
    "legacy": LEGACY,
    "+mel_off": replace(LEGACY, name="+mel_off", memory_efficient_linear=False),
    "+buckets": replace(LEGACY, name="+buckets", rule="current"),
    "+persist1e4": replace(LEGACY, name="+persist1e4", rule="legacy@persist1e4"),
    "+overlap": replace(LEGACY, name="+overlap", overlap_comm=True),
    "+local_size": replace(LEGACY, name="+local_size", local_size=True),
    "+ds_adam": replace(LEGACY, name="+ds_adam", optimizer="ds_adam"),
    "+coalesced": replace(LEGACY, name="+coalesced", gather="coalesced"),
    "default": Variant("default"),
    "default@per_tensor": Variant("default@per_tensor", gather="per_tensor"),
    "default+ds_adam": Variant("default+ds_adam", optimizer="ds_adam"),
    "default@persist1e4": Variant("default@persist1e4", rule="current@persist1e4"),
    "default@persist_ds": Variant("default@persist_ds", rule="current@persist_ds"),
    "default+overlap": Variant("default+overlap", overlap_comm=True),
    "default-overlap": Variant("default-overlap", overlap_comm=False),
    "default+adamw": Variant("default+adamw", optimizer="adamw"),
}


def configure(variant: Variant, ds_config: dict[str, Any], trainable: bool) -> dict[str, Any]:
    """The role's config with this variant's memory_efficient_linear and overlap_comm (in place)."""
    zero = ds_config.setdefault("zero_optimization", {})
    if zero.get("stage", 0) == 3:
        zero["memory_efficient_linear"] = variant.memory_efficient_linear
    if trainable and zero.get("stage", 0) >= 1 and variant.overlap_comm is not None:
        zero["overlap_comm"] = variant.overlap_comm
    return ds_config


def optimizer_factory(variant: Variant, lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.95),
                      offload: bool = False) -> Callable[[Any], torch.optim.Optimizer]:
    from multiengine.engines.optim import build_optimizer, resolve_optimizer

    name = "ds_adam" if offload else resolve_optimizer(variant.optimizer, offload)
    return lambda params: build_optimizer(name, params, lr=lr, betas=betas, eps=1e-8, weight_decay=0.0,
                                          offload=offload)


@contextlib.contextmanager
def building(variant: Variant) -> Iterator[None]:
    """While a variant's roles build: its bucket rule stands in for the registry's resolution."""
    import multiengine.engines.registry as registry_module

    rule = RULES[variant.rule]
    original = registry_module.resolve_bucket_sizes

    def resolve(config: dict[str, Any], hidden_size: int | None, num_params: int | None = None,
                trainable_params: int | None = None) -> None:
        zero = config.get("zero_optimization", {})
        for key, value in rule(hidden_size, num_params, trainable_params).items():
            if zero.get(key) == "auto":
                zero[key] = value
        original(config, hidden_size, num_params, trainable_params)

    registry_module.resolve_bucket_sizes = resolve
    try:
        with running(variant, any_zero3=True):
            yield
    finally:
        registry_module.resolve_bucket_sizes = original


@contextlib.contextmanager
def per_tensor_whole_parameters(params: Any, modifier_rank: int | None = None, **_: Any) -> Iterator[None]:
    """The gather before issue 13: DeepSpeed's GatheredParameters (one all-gather per tensor; on exit every
    tensor is re-partitioned, persistent ones too)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=modifier_rank):
        yield


def _releasing_hooks_detached(engine: Any) -> Any:
    from multiengine.engines.partition import zero3_offload

    @contextlib.contextmanager
    def detached() -> Iterator[None]:
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

    return detached()


@contextlib.contextmanager
def _gathers(kind: str) -> Iterator[None]:
    """The registry's whole-parameter gathers as ``kind`` ("coalesced": today's; "per_tensor": before)."""
    import multiengine.engines.registry as registry_module

    if kind == "coalesced" or not hasattr(registry_module, "whole_parameters"):
        yield  # today's, or a library from before the change (which only has the per-tensor one)
        return
    saved = registry_module.whole_parameters, registry_module.hooks_detached
    registry_module.whole_parameters, registry_module.hooks_detached = (per_tensor_whole_parameters,
                                                                        _releasing_hooks_detached)
    try:
        yield
    finally:
        registry_module.whole_parameters, registry_module.hooks_detached = saved


@contextlib.contextmanager
def running(variant: Variant, any_zero3: bool) -> Iterator[None]:
    """While a variant's steps run: F.linear, LOCAL_SIZE and the registry's gathers as a process of its
    own would have them."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    old_linear, old_env = torch.nn.functional.linear, os.environ.get("LOCAL_SIZE")
    torch.nn.functional.linear = zero3_linear_wrap if (variant.memory_efficient_linear and any_zero3) \
        else ORIGINAL_LINEAR
    if variant.local_size:
        os.environ["LOCAL_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", "1")
    else:
        os.environ.pop("LOCAL_SIZE", None)
    try:
        with _gathers(variant.gather):
            yield
    finally:
        torch.nn.functional.linear = old_linear
        if old_env is None:
            os.environ.pop("LOCAL_SIZE", None)
        else:
            os.environ["LOCAL_SIZE"] = old_env

"""Every DeepSpeed internal the runtime touches, in one place. No release promises these names, so a DeepSpeed
upgrade is checked here (:func:`missing`, run against the installed DeepSpeed by tests/unit/test_deepspeed_adapter.py
and at every build) and fixed here. What DeepSpeed's public API lacks: one backward for several engines and engines
a loss only passes through (the engine's backward bookkeeping), ZeRO-3 hooks off around a gathered forward, torch's
own ``F.linear`` on whole weights, zero.Init that keeps class decorators, DeepSpeed's cached groups torn down, and
its groups bounded by the collective timeout.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

# The oldest DeepSpeed the runtime supports: the engine's backward graph tracker and running-backward counter arrived
# in 0.19.6, and 0.19.8 is the first that loads ZeRO-3 checkpoints of tied-embedding models (pyproject.toml's floor).
MIN_DEEPSPEED = "0.19.8"

# DeepSpeed's marker of parameters inside a GatheredParameters block (set by partition.whole_parameters too).
GATHERED_MARK = "_ds_z3_gathered_param_context_depth"

# (module, attribute path) of every internal used here; the engine's instance attributes are checked on a built one
_REQUIRED = (
    ("deepspeed.runtime.engine", "_ENGINE_BACKWARD_GRAPH_TRACKER.new_state"),
    ("deepspeed.runtime.engine", "_ENGINE_BACKWARD_GRAPH_TRACKER.register_current_graph"),
    ("deepspeed.runtime.engine", "_ENGINE_BACKWARD_GRAPH_TRACKER.unregister"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._backward_prologue"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._backward_epilogue"),
    ("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses._post_init_method"),
    ("deepspeed.runtime.zero.partition_parameters", "InsertPostInitMethodToModuleSubClasses.unpatch_init_and_builtins"),
    ("deepspeed.runtime.zero.partition_parameters", "get_all_subclasses"),
    ("deepspeed.runtime.zero.partition_parameters", "shutdown_init_context"),
    ("deepspeed.runtime.zero.partition_parameters", "restore_init_context"),
    ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload._register_deepspeed_module"),
    ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload.get_param_coordinator"),
    ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator._invalidate_trace"),
    ("deepspeed.runtime.zero.partitioned_param_coordinator", "iter_params"),
    ("deepspeed.comm.comm", "cdb"),
    ("deepspeed.comm.comm", "destroy_process_group"),
    ("deepspeed.comm.torch", "TorchBackend.new_group"),
)
_ENGINE_ATTRS = ("_running_engine_backward_lock", "_running_engine_backward_count", "_running_engine_backward")


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing(engine: Any = None) -> list[str]:
    """The internals used here that the installed DeepSpeed lacks (given a built trainable ``engine``, its
    instance attributes too); empty when everything is there."""
    out = []
    for module, path in _REQUIRED:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            out.append(f"{module}.{path}")
    return out + [f"DeepSpeedEngine().{a}" for a in _ENGINE_ATTRS if engine is not None and not hasattr(engine, a)]


def check(engine: Any = None) -> None:
    """ConfigError naming the missing internals and the supported versions, when :func:`missing` finds any."""
    gone = missing(engine)
    if gone:
        import deepspeed

        from .config import ConfigError

        raise ConfigError(f"deepspeed {deepspeed.__version__} lacks internals the multi-role runtime uses ({gone}); "
                          f"install a release it supports: pip install 'deepspeed>={MIN_DEEPSPEED}'")


# --- backward over several engines ------------------------------------------------------------------------------
def _no_prologue() -> None:
    """Stands in for a DeepSpeed engine's backward prologue while a loss only passes through its role."""


@contextlib.contextmanager
def prologue_skipped(engines: Sequence[Any]) -> Iterator[None]:
    """These engines ignore a gradient passing through their outputs for the block: their output hooks would open a
    ZeRO backward nobody closes (at stage 0, refuse it: "Direct calls to tensor.backward() are not supported")."""
    quiet = [e for e in engines if hasattr(e, "_backward_prologue")]
    for engine in quiet:
        engine._backward_prologue = _no_prologue
    try:
        yield
    finally:
        for engine in quiet:
            del engine._backward_prologue


def joint_backward(loss: torch.Tensor, engines: Sequence[Any], retain_graph: bool,
                   inputs: list[torch.Tensor] | None = None) -> None:
    """``engine.backward`` for several engines at once: each marked as inside its own backward (its output hooks do
    not rescale the already scaled loss), one ``loss.backward()``, then every engine's epilogue (the reduction)."""
    from deepspeed.runtime.engine import _ENGINE_BACKWARD_GRAPH_TRACKER as tracker

    for engine in engines:
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True
    state = tracker.new_state()
    handle = loss.register_hook(lambda grad: tracker.register_current_graph(grad, state))
    try:
        loss.backward(retain_graph=retain_graph, inputs=inputs)
        for engine in engines:
            engine._backward_epilogue()
    finally:
        handle.remove()
        tracker.unregister(state)
        for engine in engines:
            with engine._running_engine_backward_lock:
                engine._running_engine_backward_count -= 1
                engine._running_engine_backward = engine._running_engine_backward_count > 0


def loss_scale(engine: Any) -> float:
    """What an engine's backward multiplies the loss by besides 1/accumulation: the fp16 loss scale (1 otherwise)."""
    optimizer = getattr(engine, "optimizer", None)
    if not hasattr(optimizer, "scale_if_loss"):
        return 1.0
    return float(optimizer.scale_if_loss(torch.ones((), requires_grad=True)).detach())


# --- ZeRO-3 hooks, F.linear and zero.Init -----------------------------------------------------------------------
def zero3_offload(engine: Any) -> Any | None:
    """The ZeRO-3 parameter-offload object (owner of the fetch/release hooks) of an engine: its optimizer's, or a
    frozen engine's in place of an optimizer; None below stage 3."""
    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", optimizer)
    return offload if hasattr(offload, "forward_hooks") else None


def zero3_hooks_off(offload: Any) -> list[torch.nn.Parameter]:
    """Wait for every prefetch in flight, clear the parameters' active-submodule marks and remove the fetch/release
    hooks; returns the module's parameters (for the caller to release)."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    inflight = getattr(offload.module, "ds_inflight_param_registry", None)
    if inflight:
        for handle in list(inflight.values()):
            handle.wait()
        inflight.clear()
    params = list(iter_params(offload.module, recurse=True))
    for param in params:
        param.ds_active_sub_modules.clear()
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    # and the root's start-of-forward hook: its reset_step checks a stale trace across ranks (collectives) per forward
    start = getattr(offload, "fwd_pre_hook", None)
    if start is not None and start.id in offload.module._forward_pre_hooks:
        offload.start_of_forward = offload.module._forward_pre_hooks[start.id]
        start.remove()
    return params


def zero3_hooks_on(offload: Any) -> None:
    """The hooks back as they were: DeepSpeed's order, the same module ids, and its fetch trace kept (no hooked pass
    ran meanwhile; DeepSpeed drops it on re-registering, and the next update would fetch layer by layer and check the
    re-recorded order across ranks, every step). Whatever a stale trace keeps whole, the optimizer step releases."""
    start = getattr(offload, "start_of_forward", None)
    if start is not None:
        offload.fwd_pre_hook = offload.module.register_forward_pre_hook(start)
        offload.start_of_forward = None
    coordinator = offload.get_param_coordinator()
    coordinator._invalidate_trace = lambda: None  # for the duration of the re-registration only
    try:
        offload._register_deepspeed_module(offload.module, count=[offload.module.ds_id])
    finally:
        del coordinator._invalidate_trace


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """Torch's own ``F.linear`` for the block (DeepSpeed replaces it process-wide once a stage-3 model is built;
    on whole weights that only adds overhead)."""
    patcher = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    original = getattr(getattr(patcher, "InsertPostInitMethodToModuleSubClasses", None), "linear_bk", None)
    current = torch.nn.functional.linear
    if original is None or current is original:
        yield
        return
    torch.nn.functional.linear = original
    try:
        yield
    finally:
        torch.nn.functional.linear = current


@contextlib.contextmanager
def zero_init_paused() -> Iterator[None]:
    """Parameters created in the block are ordinary full tensors even inside zero.Init (a no-op outside it)."""
    try:
        from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    except ImportError:
        yield
        return
    shutdown_init_context()
    try:
        yield
    finally:
        restore_init_context()


def _rewrapped_inits() -> dict[type, Any]:
    """Classes whose ``__init__`` was decorated after zero.Init wrapped it (defined inside the scope: transformers'
    kernel decorator on attention classes); zero.Init keeps the function it wraps as ``_old_init``."""
    from deepspeed.runtime.zero.partition_parameters import get_all_subclasses

    found = {}
    for cls in get_all_subclasses(torch.nn.Module):
        init, old = cls.__dict__.get("__init__"), cls.__dict__.get("_old_init")
        if init is not None and old is not None and getattr(init, "__wrapped__", None) is not old:
            found[cls] = init
    return found


@contextlib.contextmanager
def zero_init_kept(init_ctx: Any) -> Iterator[Any]:
    """``init_ctx`` (a zero.Init) that leaves nn.Module classes as if defined outside it: its stop would restore the
    ``__init__`` it first saw, dropping a later decorator (``'LlamaAttention' object has no attribute
    '_kernel_funcs'``); here the decorated one is put back, and its zero.Init wrapper partitions only while active."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Patcher

    post_init = init_ctx._post_init_method

    def post_init_while_active(module: torch.nn.Module) -> None:
        if init_ctx.patched:
            post_init(module)

    init_ctx._post_init_method = post_init_while_active
    unpatch = Patcher.__dict__["unpatch_init_and_builtins"]

    def unpatch_keeping_decorators(self: Any) -> None:
        rewrapped = _rewrapped_inits()
        unpatch(self)
        for cls, init in rewrapped.items():
            cls.__init__ = init

    Patcher.unpatch_init_and_builtins = unpatch_keeping_decorators
    try:
        with init_ctx:
            yield init_ctx
    finally:
        Patcher.unpatch_init_and_builtins = unpatch


def destroy_groups() -> bool:
    """Destroy the default group through DeepSpeed, which also drops its cached groups (torch's alone leaves them
    stale for a registry built next: "Group ... is not registered"). False when DeepSpeed holds no group."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is None or comm.cdb is None or not comm.cdb.is_initialized():
        return False
    comm.destroy_process_group()
    return True


def bound_group_timeouts(timeout: Any) -> None:
    """Every group DeepSpeed creates from now on (its data-parallel groups, the cloned world group ZeRO reduces
    gradients on) waits ``timeout`` (a timedelta; None: torch's default) in a collective, as the default group does:
    DeepSpeed's ``new_group`` passes no timeout, so torch gave them its 30 minutes."""
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    if cdb is None:
        return
    vars(cdb).pop("new_group", None)
    if timeout is not None:
        cdb.new_group = lambda ranks: torch.distributed.new_group(ranks, timeout=timeout)

"""Every DeepSpeed internal the runtime touches, in one place: the names below are private to DeepSpeed (no release
promises them), so a DeepSpeed upgrade is checked here (:func:`missing`, run by tests/unit/test_deepspeed_adapter.py
against the installed DeepSpeed) and fixed here.

What the runtime needs that DeepSpeed's public API lacks:

* one backward pass for several engines (:func:`joint_backward`) and engines a loss only passes through
  (:func:`prologue_skipped`): the engine's backward bookkeeping (``_backward_prologue``/``_backward_epilogue``, the
  running-backward counter and ``_ENGINE_BACKWARD_GRAPH_TRACKER``, which tells its output hooks the loss is scaled);
* ZeRO-3 hooks off and on around a gathered forward (:func:`zero3_hooks_off`, :func:`zero3_hooks_on`) and torch's own
  ``F.linear`` while weights are whole (:func:`plain_linear`);
* zero.Init that partitions only while active and keeps class ``__init__`` decorators (:func:`zero_init_kept`);
* DeepSpeed's cached process groups dropped with the default group (:func:`destroy_groups`).
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
    ("deepspeed.runtime.zero.partitioned_param_coordinator", "iter_params"),
    ("deepspeed.comm.comm", "cdb"),
    ("deepspeed.comm.comm", "destroy_process_group"),
)
_ENGINE_ATTRS = ("_running_engine_backward_lock", "_running_engine_backward_count", "_running_engine_backward")


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing(engine: Any = None) -> list[str]:
    """The DeepSpeed internals this module uses that the installed DeepSpeed lacks (and, given a built trainable
    ``engine``, the instance attributes it lacks); empty when everything is there."""
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
    """For the block, these engines ignore a gradient passing through their outputs: their forward hooks start the
    engine's backward bookkeeping, which for a role that does not learn from the loss would open a ZeRO backward
    nobody closes (at stage 0 it refuses the pass: "Direct calls to tensor.backward() are not supported")."""
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
    """``engine.backward`` for several engines at once: each engine is marked as inside its own backward (its output
    hooks run its prologue but do not rescale: the loss is scaled already), one ``loss.backward()``, then every
    engine's epilogue (gradient reduction)."""
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
    """The ZeRO-3 parameter-offload object of an engine (owner of the fetch/release hooks), or None. A trainable
    role's ZeRO-3 optimizer owns one; a frozen role's engine holds it in place of an optimizer."""
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
    return params


def zero3_hooks_on(offload: Any) -> None:
    """The hooks back (DeepSpeed records its fetch trace again on the next forward)."""
    offload._register_deepspeed_module(offload.module)


@contextlib.contextmanager
def plain_linear() -> Iterator[None]:
    """``torch.nn.functional.linear`` as torch ships it for the block. DeepSpeed replaces it process-wide with its
    ZeRO-3 variant once a stage-3 model is built; on weights that are already whole that only adds overhead."""
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
    """Classes whose ``__init__`` was wrapped again after zero.Init wrapped it (a class defined while the scope was
    open, then decorated, as transformers' kernel decorator does to most attention classes); zero.Init keeps the
    function it wraps as both ``__wrapped__`` and the class's ``_old_init``."""
    from deepspeed.runtime.zero.partition_parameters import get_all_subclasses

    found = {}
    for cls in get_all_subclasses(torch.nn.Module):
        init, old = cls.__dict__.get("__init__"), cls.__dict__.get("_old_init")
        if init is not None and old is not None and getattr(init, "__wrapped__", None) is not old:
            found[cls] = init
    return found


@contextlib.contextmanager
def zero_init_kept(init_ctx: Any) -> Iterator[Any]:
    """``init_ctx`` (a zero.Init) that leaves every nn.Module class as it would be had it been defined outside it.

    When zero.Init stops (at the end, or paused), it sets each class's ``__init__`` back to the one it saw when the
    class was defined, dropping a decorator applied afterwards: later instances lack what it sets up
    (``'LlamaAttention' object has no attribute '_kernel_funcs'``). Here each stop puts such ``__init__`` back; the
    zero.Init wrapper left inside it partitions only while this zero.Init is active."""
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
    """Destroy the default process group through DeepSpeed when it set it up, which also drops the groups it cached
    (data parallel, world): destroyed with torch's alone, a registry built next in this process gets DeepSpeed's
    stale groups ("Group ... is not registered"). False when DeepSpeed holds no group."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is None or comm.cdb is None or not comm.cdb.is_initialized():
        return False
    comm.destroy_process_group()
    return True

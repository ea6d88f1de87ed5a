"""The non-finite guard: no trainable role ever applies an update whose loss or global gradient norm is NaN/inf,
and every rank skips the same updates. The registry wraps each trainable engine's ``backward`` (each loss checked
without a device sync) and ``step``; at each accumulation boundary:

* DeepSpeed's ZeRO, bf16 and fp16 optimizers skip a non-finite norm themselves ("overflow"); the guard reads that
  verdict (with fp16's dynamic loss scale an overflow counts only when a loss of the window was not finite).
* The others (stage 0 with a torch optimizer, the torch backend) would apply it: the guard computes the norm of the
  whole, averaged gradients and all-reduces ``[loss not finite, norm not finite]`` so every rank decides alike; a bad
  update runs the step with the optimizer's and scheduler's ``step`` as no-ops, as DeepSpeed's own skip does.

Skipped updates are logged and queued for ``EngineRegistry.nonfinite_updates()`` (the lifecycle's policy).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .dist import all_reduce_sum

logger = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "NonFiniteUpdate", "install_guard", "note_loss"]


@dataclass(frozen=True)
class NonFiniteUpdate:
    """One optimizer update that was skipped: the role, its optimizer step (the engine's count) and the
    global gradient norm (``inf``/``nan``; ``None`` where only the loss was not finite)."""

    role: str
    step: int
    grad_norm: float | None
    loss_nonfinite: bool | None  # a loss of the window was not finite on some rank (None: not known)

    def describe(self) -> str:
        what = []
        if self.loss_nonfinite:
            what.append("loss")
        if self.grad_norm is None or not math.isfinite(self.grad_norm):
            what.append(f"gradient norm ({self.grad_norm})" if self.grad_norm is not None else "gradient norm")
        return f"role '{self.role}': non-finite {' and '.join(what) or 'values'} at its optimizer step {self.step}"


@contextlib.contextmanager
def _no_step(*objects: Any) -> Iterator[None]:
    """``obj.step`` is a no-op for the block (an instance attribute shadowing the class's method)."""
    saved = []
    for obj in objects:
        if obj is None:
            continue
        saved.append((obj, obj.__dict__.get("step", _MISSING)))
        obj.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for obj, previous in saved:
            if previous is _MISSING:
                del obj.step
            else:
                obj.step = previous


_MISSING = object()


class _Guard:
    def __init__(self, name: str, engine: Any, backend: str, world_size: int, queue: list[NonFiniteUpdate]) -> None:
        self.name, self.engine, self.world_size, self.queue = name, engine, world_size, queue
        optimizer = getattr(engine, "optimizer", None)
        # DeepSpeed's wrapped optimizers carry `overflow` and skip a non-finite update themselves.
        self.deepspeed_decides = backend == "deepspeed" and hasattr(optimizer, "overflow")
        if backend == "deepspeed":
            fp16 = bool(getattr(engine, "fp16_enabled", lambda: False)())
            self.loss_scaled = fp16 and bool(getattr(engine, "dynamic_loss_scale", lambda: False)())
        else:  # the torch backend's fp16 GradScaler skips overflowing updates and backs its scale off itself
            self.loss_scaled = getattr(engine, "_scaler", None) is not None
        self.bad_loss: torch.Tensor | None = None  # "some loss since the last boundary was not finite"

    def note(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() == 0:
            return
        bad = ~torch.isfinite(loss.detach()).all()  # stays on the device: read once, at the boundary
        self.bad_loss = bad if self.bad_loss is None else (self.bad_loss | bad.to(self.bad_loss.device))

    def _take_bad_loss(self) -> float:
        bad, self.bad_loss = self.bad_loss, None
        return float(bad.item()) if bad is not None else 0.0

    def _step_count(self) -> int:
        return int(getattr(self.engine, "global_steps", 0))

    def step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            return original(*args, **kwargs)
        if self.deepspeed_decides:
            result = original(*args, **kwargs)
            bad_loss = self._take_bad_loss()
            if bool(getattr(engine.optimizer, "overflow", False)):
                norm = engine.get_global_grad_norm()
                norm = float(norm) if norm is not None else float("inf")
                if self.loss_scaled:
                    # every rank saw the overflow: this collective is entered by all of them
                    if float(all_reduce_sum(torch.tensor([bad_loss]))[0]) == 0:
                        return result  # the loss scaler's business: the scale backs off
                    self._record(norm, True)
                else:
                    self._record(norm, None)
            return result
        norm = 0.0 if self.loss_scaled else self._grad_norm()  # scaled gradients: overflow is the scaler's
        flags = torch.tensor([self._take_bad_loss(), 0.0 if math.isfinite(norm) else 1.0], dtype=torch.float64)
        if self.world_size > 1:
            flags = all_reduce_sum(flags)
        if not flags.any():
            return original(*args, **kwargs)
        with _no_step(getattr(engine, "optimizer", None), getattr(engine, "lr_scheduler", None)):
            result = original(*args, **kwargs)
        if hasattr(engine, "skipped_steps"):
            engine.skipped_steps += 1
        self._record(norm, bool(flags[0] > 0))
        return result

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False))

    def _record(self, norm: float | None, loss_nonfinite: bool | None) -> None:
        event = NonFiniteUpdate(self.name, self._step_count(), norm, loss_nonfinite)
        self.queue.append(event)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            logger.warning("%s: update skipped (weights, optimizer state and learning rate unchanged)",
                           event.describe())


def install_guard(name: str, engine: Any, backend: str, world_size: int, queue: list[NonFiniteUpdate]) -> Any:
    """Wrap ``engine.backward`` and ``engine.step`` of a trainable role; returns the guard (for note_loss)."""
    guard = _Guard(name, engine, backend, world_size, queue)
    backward, step = engine.backward, engine.step

    def guarded_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
        guard.note(loss)
        return backward(loss, *args, **kwargs)

    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        return guard.step(step, *args, **kwargs)

    engine.backward = guarded_backward
    engine.step = guarded_step
    return guard


def note_loss(guard: Any, loss: Any) -> None:
    """A loss that reached this role without its engine's backward (``registry.backward``)."""
    if guard is not None:
        guard.note(loss)


class NonFiniteError(RuntimeError):
    """A run stopped by its non-finite policy (the CLI exits 3). ``fix`` says what to try."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix

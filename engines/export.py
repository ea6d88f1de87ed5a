"""Exports: a role's full weights in a folder real clients load, written atomically (gathered on all ranks, written
by rank 0 into ``<out>.tmp``, swapped into place; a LoRA role merged, its adapter in ``<out>/adapter``). See
docs/reliability.md."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import inspect
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .dist import barrier
from .roles import _is_diffusers_model, is_lora, torch_dtype
from .safe_io import fsync_path, fsync_tree

if TYPE_CHECKING:
    from .registry import EngineRegistry

logger = logging.getLogger(__name__)

__all__ = ["atomic_dir", "cast_folder", "merged_state_dict", "recover_dir", "save_role", "write_role"]


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). False where the
    system or the file system cannot (the caller then falls back to two renames)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc older than glibc 2.28
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def recover_dir(out_dir: str) -> None:
    """Undo a crash inside an earlier commit: a missing ``out_dir`` gets its complete ``<out>.old`` back, else a
    stale ``<out>.old`` is removed (``<out>.tmp`` may be partial and is never promoted)."""
    out = os.path.abspath(out_dir).rstrip(os.sep)
    aside = out + ".old"
    if not os.path.lexists(aside):
        return
    if os.path.lexists(out):
        _remove(aside)
    else:
        logger.warning("%s was missing after an interrupted export; restoring the previous export from %s",
                       out, aside)
        os.replace(aside, out)
        fsync_path(os.path.dirname(out))


def _commit(tmp: str, out: str) -> None:
    """Replace ``out`` by the finished ``tmp`` so that no crash leaves ``out`` partial (and, where the file
    system can swap atomically, never missing either)."""
    fsync_tree(tmp)
    parent = os.path.dirname(out)
    if os.path.lexists(out) and _exchange(tmp, out):
        fsync_path(parent)  # out is the new export now; tmp holds the old one
        _remove(tmp)
        return
    aside = None
    if os.path.lexists(out):
        aside = out + ".old"  # a fixed name, so recover_dir finds it after a crash right here
        os.replace(out, aside)
    os.replace(tmp, out)
    fsync_path(parent)
    if aside is not None:
        _remove(aside)


@contextlib.contextmanager
def atomic_dir(out_dir: str, main: bool = True) -> Iterator[str]:
    """A temporary folder beside ``out_dir`` that becomes ``out_dir`` when the block ends without error. All ranks
    enter it (it ends with a barrier); only ``main`` writes and renames; on an exception ``out_dir`` is unchanged."""
    out = os.path.abspath(out_dir).rstrip(os.sep)
    tmp = out + ".tmp"
    if main:
        recover_dir(out)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)  # a leftover of a crashed export
        os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()  # every rank has finished its part of the writes (the gathers)
    if main:
        _commit(tmp, out)
    barrier()


def cast_folder(folder: str, dtype: torch.dtype | str) -> None:
    """Rewrite every safetensors file of a saved model with floating tensors in ``dtype`` (and the dtype
    recorded in config.json): every component of an export then loads in one dtype."""
    from safetensors.torch import load_file, save_file

    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)  # a bad name is a ConfigError naming the choices
    name = str(dtype).replace("torch.", "")
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry.endswith(".safetensors"):
            tensors = load_file(path)
            if any(t.is_floating_point() and t.dtype != dtype for t in tensors.values()):
                tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
                save_file(tensors, path, metadata={"format": "pt"})
        elif entry == "config.json":
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            keys = [k for k in ("torch_dtype", "dtype") if k in config]
            if keys:
                for key in keys:
                    config[key] = name
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(config, f, indent=2, sort_keys=True)


def _peft_prefixes(module: torch.nn.Module) -> list[str]:
    """State-dict prefixes of peft wrappers inside ``module`` ("" for a top-level PeftModel); peft is imported."""
    from peft import PeftModel

    return [name for name, m in module.named_modules() if isinstance(m, PeftModel)]


def merged_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's CPU state dict with every LoRA layer merged (``W + delta``) under the keys of the model without
    adapters (peft's ``base_layer``/``lora_``/``base_model.model.`` names undone). Parameters must be whole."""
    state = {k: v.detach().to("cpu").clone() for k, v in module.state_dict().items()}
    if "peft" not in sys.modules:  # no adapters were made in this process: nothing to merge or rename
        return state
    from peft.tuners.lora import LoraLayer

    for prefix, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        key = f"{prefix}.base_layer.weight"
        weight = state[key]
        delta = torch.zeros_like(weight, dtype=torch.float32)
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                delta += layer.get_delta_weight(adapter).detach().to("cpu", torch.float32)
        state[key] = (weight.float() + delta).to(weight.dtype)
    out: dict[str, torch.Tensor] = {}
    wrappers = sorted(_peft_prefixes(module), key=len, reverse=True)
    for key, value in state.items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        for prefix in wrappers:
            head = f"{prefix}.base_model.model." if prefix else "base_model.model."
            if key.startswith(head):
                key = (f"{prefix}." if prefix else "") + key[len(head):]
                break
        out[key] = value
    return out


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _save_kwargs(save: Any, pad_token_id: int | None) -> dict[str, Any]:
    """``pad_token_id`` for a ``save_pretrained`` that takes it (a reward model records its tokenizer's pad)."""
    if pad_token_id is not None and "pad_token_id" in inspect.signature(save).parameters:
        return {"pad_token_id": pad_token_id}
    return {}


def _write_state(module: torch.nn.Module, state: dict[str, torch.Tensor], out: str,
                 pad_token_id: int | None = None) -> None:
    """Write ``state`` (keys of ``module`` without adapters) in the module's own folder format."""
    from safetensors.torch import save_file

    target = _unwrapped(module)
    save = getattr(target, "save_pretrained", None)
    if save is not None and "state_dict" in inspect.signature(save).parameters:
        save(out, state_dict=state, **_save_kwargs(save, pad_token_id))
    elif _is_diffusers_model(target):
        target.save_config(out)
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(out, "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})


def _write_module(module: torch.nn.Module, out: str, pad_token_id: int | None = None) -> None:
    from safetensors.torch import save_file

    if hasattr(module, "save_pretrained"):
        module.save_pretrained(out, **_save_kwargs(module.save_pretrained, pad_token_id))
    else:
        # Under ZeRO-1/2 parameters are views into one flat buffer, which safetensors refuses to
        # write as shared storage: write owned copies.
        state = {k: v.detach().to("cpu").clone().contiguous() for k, v in module.state_dict().items()}
        save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def write_role(registry: EngineRegistry, name: str, folder: str, *, dtype: str | torch.dtype | None = None,
               merge_lora: bool = True, pad_token_id: int | None = None) -> dict[str, str]:
    """Gather role ``name`` on all ranks and write it into ``folder`` on rank 0, not atomically (see :func:`save_role`).
    Returns ``{"model": folder}`` and, for a peft LoRA role, ``"adapter": folder/adapter``."""
    module = registry.role(name).module
    lora = merge_lora and is_lora(module)
    written = {"model": folder}
    if lora and hasattr(module, "get_base_model"):  # a peft wrapper: its adapter folder loads with PeftModel
        written["adapter"] = os.path.join(folder, "adapter")
    with registry.gathered(name):
        if registry.is_main:
            os.makedirs(folder, exist_ok=True)
            if lora:
                _write_state(module, merged_state_dict(module), folder, pad_token_id)
                if "adapter" in written:
                    module.save_pretrained(written["adapter"])
            else:
                _write_module(module, folder, pad_token_id)
    if registry.is_main and dtype is not None:
        cast_folder(folder, dtype)
    barrier()
    return written


def save_role(registry: EngineRegistry, name: str, out_dir: str, *, dtype: str | torch.dtype | None = None,
              merge_lora: bool = True, tokenizer: Any = None,
              extra_files: Callable[[str], None] | None = None) -> dict[str, str]:
    """Export role ``name`` to ``out_dir`` atomically: gathered weights (LoRA merged, adapter in ``adapter/``) cast
    to ``dtype`` if given, the ``tokenizer`` and ``extra_files(folder)``. All ranks must call it; returns the paths."""
    with atomic_dir(out_dir, registry.is_main) as tmp:
        written = write_role(registry, name, tmp, dtype=dtype, merge_lora=merge_lora,
                             pad_token_id=getattr(tokenizer, "pad_token_id", None))
        if registry.is_main:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if extra_files is not None:
                extra_files(tmp)
    final = os.path.abspath(out_dir).rstrip(os.sep)
    if registry.is_main:
        logger.info("exported role '%s' to %s", name, final)
    return {k: final + v[len(tmp):] for k, v in written.items()}

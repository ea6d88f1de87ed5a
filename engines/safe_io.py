"""Checkpoint state that loads without running code: our state as JSON + safetensors (anything else refused at
save time), DeepSpeed's torch.save files read with ``weights_only=True`` and an allow-list of classes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_TAG = "__me__"  # marks an encoded value; a dict that uses this key itself is stored as pairs
TREE_FORMAT = "multiengine-tree-1"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: wrong roles or ranks, a missing file, an unsafe file."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would need unpickling of something not on the allow-list."""


# --- the JSON + safetensors tree ---------------------------------------------------------------
class _Encoder:
    def __init__(self, what: str) -> None:
        self.what = what
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, str] = {}
        self._storages: set[int] = set()

    def _tensor_key(self, t: torch.Tensor) -> str:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and view in self._views:  # the same tensor twice (tied weights): stored once
            return self._views[view]
        ptr = view[0]
        if not t.is_contiguous() or (ptr and ptr in self._storages):
            t = t.contiguous() if not t.is_contiguous() else t.clone()  # safetensors refuses shared memory
        self._storages.add(t.untyped_storage().data_ptr())
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t
        self._views[view] = key
        return key

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, (np.ndarray, np.generic)):  # before float: np.float64 is a float subclass
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise TypeError(f"{self.what} {path}: a numpy array of Python objects cannot be stored without pickle")
            raw = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy())
            kind = "npscalar" if isinstance(value, np.generic) else "ndarray"
            return {_TAG: kind, "key": self._tensor_key(raw), "dtype": arr.dtype.str, "shape": list(arr.shape)}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {_TAG: "float", "value": repr(value)}  # 'nan', 'inf', '-inf': strict JSON has none
        if isinstance(value, torch.Tensor):
            return {_TAG: "tensor", "key": self._tensor_key(value)}
        if isinstance(value, torch.Size):
            return {_TAG: "size", "items": list(value)}
        if isinstance(value, torch.dtype):
            return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
        if isinstance(value, tuple):
            return {_TAG: "tuple", "items": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) for k in value) and _TAG not in value:
                return {k: self.encode(v, f"{path}.{k}" if path else k) for k, v in value.items()}
            return {_TAG: "dict", "items": [[self.encode(k, f"{path}<key>"), self.encode(v, f"{path}[{k!r}]")]
                                            for k, v in value.items()]}
        raise TypeError(
            f"{self.what} {path or '(top level)'} holds a {type(value).__module__}.{type(value).__qualname__},"
            " which a checkpoint cannot store without pickle; store numbers, strings, lists, dicts, tensors or"
            " numpy arrays (e.g. the object's state_dict())."
        )


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: _decode(v, tensors, where) for k, v in value.items()}
    if kind == "float":
        return float(value["value"])
    if kind in ("tensor", "ndarray", "npscalar"):
        if value["key"] not in tensors:
            raise CheckpointError(f"{where}: tensor {value['key']!r} is missing from the .safetensors file")
        t = tensors[value["key"]]
        if kind == "tensor":
            return t
        arr = t.numpy().view(np.dtype(value["dtype"])).reshape(value["shape"])
        return arr[()] if kind == "npscalar" else arr
    if kind == "size":
        return torch.Size(value["items"])
    if kind == "dtype":
        dtype = getattr(torch, value["name"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{where}: unknown dtype {value['name']!r}")
        return dtype
    if kind == "tuple":
        return tuple(_decode(v, tensors, where) for v in value["items"])
    if kind == "dict":
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in value["items"]}
    raise CheckpointError(f"{where}: unknown encoded value kind {kind!r}")


def fsync_path(path: str) -> None:
    """A file's data (or a folder's entries) on disk."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Every file, then every folder bottom-up: data and names are on disk before a rename makes them visible."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def save_tree(obj: Any, base: str, what: str = "state") -> None:
    """Write `obj` as `<base>.json` + `<base>.safetensors` (both fsynced). `what` names it in errors."""
    from safetensors.torch import save_file

    enc = _Encoder(what)
    tree = enc.encode(obj, "")
    save_file(enc.tensors, base + ".safetensors", metadata={"format": TREE_FORMAT})
    with open(base + ".json", "w") as f:
        json.dump({"format": TREE_FORMAT, "tree": tree}, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(base + ".safetensors")


def load_tree(base: str) -> Any:
    """Read what save_tree wrote; CheckpointError (naming the file) for anything else."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for suffix in (".json", ".safetensors"):
        if not os.path.isfile(base + suffix):
            raise CheckpointError(f"checkpoint file {base + suffix} is missing")
    try:
        with open(base + ".json", encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{base}.json is not a multiengine state file (not JSON: {exc}); it may be"
                              " corrupt or replaced.") from None
    if not isinstance(doc, dict) or doc.get("format") != TREE_FORMAT:
        raise CheckpointError(f"{base}.json is not a multiengine state file (format {TREE_FORMAT!r} expected).")
    try:
        tensors = load_file(base + ".safetensors")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{base}.safetensors is not a valid safetensors file ({exc}); it may be corrupt"
                              " or replaced.") from None
    return _decode(doc["tree"], tensors, base + ".json")


# --- DeepSpeed's own files -----------------------------------------------------------------------
def deepspeed_safe_globals() -> list[Any]:
    """The plain-record classes DeepSpeed 0.19's engines and ZeRO optimizers pickle besides tensors and containers
    (the globals of stage 0-3 fp32/bf16/fp16 files); none runs code when rebuilt."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str, map_location: Any = None, allow: list[Any] | tuple[Any, ...] = ()) -> Any:
    """torch.load(weights_only=True) with `allow` added for this call; refusal is an
    UnsafeCheckpointError naming the file and the global it wanted."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = str(exc)
        start = detail.find("Unsupported global")
        wanted = (detail[start:] if start >= 0 else detail).splitlines()[0].split(" was not an allowed")[0]
        raise UnsafeCheckpointError(
            f"refusing to load {path}: it needs unpickling of something that is not plain tensors/containers"
            f" ({wanted}). Unpickling can run arbitrary code, so only files whose pickled classes are on the"
            " allow-list load. Load checkpoints only from sources you trust; a file that is genuinely from a"
            " newer DeepSpeed needs its class added to engines.safe_io.deepspeed_safe_globals after review."
        ) from None


class _SafeCheckpointEngine:
    """Stands in for a DeepSpeed engine's checkpoint engine while we load: every file DeepSpeed
    reads goes through safe_torch_load. Everything else is delegated."""

    def __init__(self, inner: Any, allow: list[Any]) -> None:
        self._inner = inner
        self._allow = allow

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_torch_load(path, map_location=map_location, allow=self._allow)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def deepspeed_loads_refusing_pickles(engine: Any) -> Iterator[None]:
    """Within the block, DeepSpeed's load_checkpoint on `engine` reads every file with
    weights_only=True (DeepSpeed's own checkpoint engine unpickles them without restriction)."""
    if engine.load_universal_checkpoint():
        # Universal checkpoints are read by the optimizer with its own, unrestricted torch.load.
        raise CheckpointError("DeepSpeed's 'checkpoint.load_universal' is on; its loader unpickles files without"
                              " restriction, so multiengine does not use it. Turn it off to resume.")
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _SafeCheckpointEngine(inner, deepspeed_safe_globals())
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


# --- code shipped inside model folders --------------------------------------------------------------
# A model or tokenizer folder can name Python files of its own (config.json's `auto_map`); transformers
# runs them only when trust_remote_code is true. That is the same hazard as a pickle: the folder becomes a
# program. Every from_pretrained / AutoTokenizer call of the library passes `trust_remote_code()`: False
# unless a run's config sets `trust_remote_code: true` (the lifecycle calls set_trust_remote_code). With
# False, a folder that needs its own code fails at once with transformers' message, never by prompting.
_TRUST_REMOTE_CODE = False


def trust_remote_code() -> bool:
    """Whether model/tokenizer folders may run their own Python code (default False: they may not)."""
    return _TRUST_REMOTE_CODE


def set_trust_remote_code(enabled: bool) -> None:
    """Process-wide switch behind trust_remote_code(); set from a run's config. Dangerous when True."""
    global _TRUST_REMOTE_CODE
    _TRUST_REMOTE_CODE = bool(enabled)


__all__ = [
    "CheckpointError",
    "UnsafeCheckpointError",
    "deepspeed_loads_refusing_pickles",
    "deepspeed_safe_globals",
    "fsync_path",
    "fsync_tree",
    "load_tree",
    "safe_torch_load",
    "save_tree",
    "set_trust_remote_code",
    "trust_remote_code",
]

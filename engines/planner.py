"""Per-role memory planning before any rank starts: parameter counts from safetensors headers (no weights read),
model states per rank for each placement as DeepSpeed allocates them, transient bytes (activation estimates, ZeRO
buffers, fixed overheads) and :func:`plan`, the cheapest placement per role that fits a per-GPU budget."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# Stated fixed overheads per rank (typical values on recent NVIDIA GPUs with CUDA 12; see docs/planning.md).
CUDA_CONTEXT_BYTES = 1 * GIB  # CUDA context, loaded kernels, cuBLAS/cuDNN workspaces of one process
NCCL_BYTES = GIB // 2  # NCCL communicator buffers (only when world size > 1)
FRAGMENTATION_MARGIN = 0.10  # caching-allocator fragmentation, as a fraction of everything above
HOST_RESERVE = 0.10  # share of host memory left to the OS, page cache and data loaders

# What the project's DeepSpeed config factories put in every stage-3 config (engines/config.py).
STAGE3_MAX_LIVE_PARAMETERS = int(3e7)
DEFAULT_PERSISTENCE_THRESHOLD = int(1e5)  # DeepSpeed's default, used when a model has no width to size from
DEFAULT_REDUCE_BUCKET = int(5e8)
STAGE3_SUB_GROUP_SIZE = int(1e9)  # DeepSpeed's default sub_group_size: fp32 gradients are made per sub-group

# Tensors that safetensors files may hold but that are buffers, not parameters. pos_embed.pos_embed: the
# sin-cos table diffusers' PatchEmbed saves when pos_embed_max_size is set (SD3: 192² x 1536 in SD3-medium).
_BUFFER_NAMES = re.compile(
    r"(^|\.)(position_ids|running_mean|running_var|num_batches_tracked|inv_freq|pos_embed\.pos_embed)$")


class PlanError(ValueError):
    """Bad planner input (a model folder that cannot be read, an impossible budget...), with the fix."""


# --- sizes ---
_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB, "k": KIB, "m": MIB, "g": GIB, "t": TIB,
}


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 80e9 (decimal), ``"512G"`` -> 512 GiB. A unit is required."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise PlanError(f"{what}={text!r} is not a size; give a number and a unit, e.g. 80GiB or 80GB "
                        f"(units: {', '.join(sorted(set(_UNITS)))}).")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Bytes in GiB with two decimals (MiB below 1 GiB), for tables."""
    if n == 0:
        return "0"
    if abs(n) < GIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / GIB:.2f} GiB"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# --- model folders ---
@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name: BF16, F32, ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """What a model's files say about its parameters (no weights read); ``class_name``: ``architectures[0]`` or
    diffusers' ``_class_name``."""

    source: str
    tensors: tuple[TensorEntry, ...]
    config: Mapping[str, Any] = field(default_factory=dict)
    class_name: str = ""

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def numels(self) -> list[int]:
        return [t.numel for t in self.tensors]

    @property
    def dtypes(self) -> dict[str, int]:
        """Stored dtype -> parameter count."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.numel
        return out

    def without(self, prefix: str) -> ModelInfo:
        """The same model without the tensors whose name starts with ``prefix`` (e.g. ``lm_head.``)."""
        return replace(self, tensors=tuple(t for t in self.tensors if not t.name.startswith(prefix)))

    def plus(self, name: str, shape: tuple[int, ...], dtype: str = "F32") -> ModelInfo:
        """The same model with one more parameter (e.g. a value head)."""
        return replace(self, tensors=(*self.tensors, TensorEntry(name, tuple(shape), dtype)))

    @property
    def moe(self) -> MoeCounts | None:
        """Its mixture-of-experts parameters (:func:`moe_counts`), None for a dense model."""
        return moe_counts(((t.name, t.numel) for t in self.tensors), self.config)

    @property
    def hidden_size(self) -> int | None:
        """The width ZeRO-3 buckets are sized from: config hidden_size / d_model / n_embd, else the largest of
        hidden_sizes, else the widest Linear/Conv weight."""
        for key in ("hidden_size", "d_model", "n_embd"):
            value = self.config.get(key)
            if isinstance(value, int) and value > 0:
                return value
        sizes = self.config.get("hidden_sizes")
        if isinstance(sizes, (list, tuple)) and sizes:
            return int(max(sizes))
        widest = 0
        for t in self.tensors:
            if t.name.endswith(".weight") and len(t.shape) in (2, 3, 4, 5):
                widest = max(widest, t.shape[0], t.shape[1])
        return widest or None


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``{tensor name: {"dtype": "BF16", "shape": [...], "data_offsets": [...]}}`` from a safetensors
    file's header; the weights are not read."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PlanError(f"{path} is not a safetensors file (shorter than its 8-byte header length).")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, 100 * MIB):
            raise PlanError(f"{path} is not a safetensors file (header length {length} for a {size}-byte file).")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path}: the safetensors header is not JSON ({exc}).") from None
    if not isinstance(header, dict):
        raise PlanError(f"{path}: the safetensors header is not a JSON object.")
    header.pop("__metadata__", None)
    return header


def _weight_files(folder: str, variant: str | None) -> list[str]:
    """The safetensors files of one model folder: a sharded index's files, else every *.safetensors
    (of the variant when given, e.g. diffusion_pytorch_model.fp16.safetensors)."""
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if variant:
        tagged = [n for n in indexes if f".{variant}." in n]
        indexes = tagged or indexes
    else:
        indexes = [n for n in indexes if n.count(".") == 3] or indexes  # model.safetensors.index.json
    if indexes:
        with open(os.path.join(folder, indexes[0]), encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        return sorted({os.path.join(folder, v) for v in weight_map.values()})
    files = [n for n in names if n.endswith(".safetensors")]
    if variant:
        tagged = [n for n in files if n.endswith(f".{variant}.safetensors")]
        files = tagged or files
    else:
        plain = [n for n in files if n.count(".") == 1]
        files = plain or files
    return [os.path.join(folder, n) for n in files]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def model_info(folder: str | os.PathLike, variant: str | None = None) -> ModelInfo:
    """Parameters of a transformers or diffusers model folder (``config.json`` + ``*.safetensors``)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise PlanError(f"model folder {folder!r} does not exist.")
    config_file = os.path.join(folder, "config.json")
    config = _read_json(config_file) if os.path.isfile(config_file) else {}
    files = _weight_files(folder, variant)
    if not files:
        bins = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = (f" It has {bins[0]}: convert it to safetensors (save_pretrained(..., safe_serialization=True))"
                if bins else "")
        raise PlanError(f"model folder {folder!r} has no *.safetensors file to count parameters from.{hint}")
    tensors = []
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if _BUFFER_NAMES.search(name):
                continue
            tensors.append(TensorEntry(name, tuple(int(d) for d in entry["shape"]), str(entry["dtype"])))
    archs = config.get("architectures") or []
    class_name = str(archs[0]) if archs else str(config.get("_class_name", ""))
    return ModelInfo(source=folder, tensors=tuple(tensors), config=config, class_name=class_name)


def pipeline_info(folder: str | os.PathLike, variant: str | None = None) -> dict[str, ModelInfo]:
    """Per component of a diffusers folder (``model_index.json``): every component with weights."""
    folder = os.fspath(folder)
    index_file = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index_file):
        raise PlanError(f"{folder!r} is not a diffusers folder: it has no model_index.json.")
    out = {}
    for name, value in _read_json(index_file).items():
        sub = os.path.join(folder, name)
        if isinstance(value, list) and value and value[0] and os.path.isdir(sub) and _weight_files(sub, variant):
            info = model_info(sub, variant)
            out[name] = replace(info, class_name=info.class_name or str(value[1]))
    return out


# --- mixtures of experts ---
_ROUTED = re.compile(r"(^|\.)experts\.")  # "mlp.experts.gate_up_proj" (fused) or "mlp.experts.3.w1.weight"
_SHARED = re.compile(r"(^|\.)shared_experts?\.")  # Qwen2-MoE's shared_expert, DeepSeek's shared_experts


@dataclass(frozen=True)
class MoeCounts:
    """An MoE model's parameters by use: ``routed``, the experts' weights, of which a token uses ``top_k`` of
    ``experts``; ``shared``, shared experts' weights (every token uses them); ``block``, the largest of the
    ``layers`` expert blocks (one module per layer: ZeRO-3 gathers it whole, every expert, in every pass)."""

    experts: int
    top_k: int
    total: int
    routed: int
    shared: int
    layers: int
    block: int

    @property
    def active(self) -> int:
        """Parameters one token uses: everything but the routed experts, plus top_k / experts of those."""
        return self.total - self.routed + self.routed * self.top_k // self.experts

    @property
    def expert_share(self) -> float:
        return self.routed / self.total if self.total else 0.0

    def describe(self, dtype: str) -> str:
        """One line for ``plan``: active of total, the experts' share, the ZeRO-3 gathers in ``dtype``."""
        b = DTYPE_BYTES[dtype]
        shared = f", shared experts {fmt_count(self.shared)}" if self.shared else ""
        return (f"mixture of experts, top {self.top_k} of {self.experts}: {self.active:,} active parameters per "
                f"token ({fmt_count(self.active)}) of {fmt_count(self.total)}; routed expert weights "
                f"{100 * self.expert_share:.1f}% of the total{shared}. At ZeRO-3 each pass gathers every expert: "
                f"{fmt_bytes(b * self.block)} per layer, {fmt_bytes(b * self.routed)} per forward over "
                f"{self.layers} layers (twice that per trained step)")

    def to_dict(self) -> dict[str, Any]:
        return {"experts": self.experts, "top_k": self.top_k, "total_params": self.total,
                "active_params": self.active, "routed_params": self.routed, "shared_params": self.shared,
                "expert_share": self.expert_share, "moe_layers": self.layers, "block_params": self.block}


def moe_counts(tensors: Iterable[tuple[str, int]], config: Mapping[str, Any] | None) -> MoeCounts | None:
    """The MoE counts of ``(name, numel)`` pairs (safetensors entries, or a live model's parameters) whose config
    routes (engines.moe.moe_shape); experts are told by name: ``experts.`` tensors (fused or one per expert) are
    routed, grouped into blocks by the name before it; ``shared_expert(s).`` ones shared. None for a dense model."""
    total = routed = shared = 0
    blocks: dict[str, int] = {}
    for name, numel in tensors:
        total += numel
        found = _ROUTED.search(name)
        if found:
            routed += numel
            blocks[name[:found.start()]] = blocks.get(name[:found.start()], 0) + numel
        elif _SHARED.search(name):
            shared += numel
    shape = _moe_shape(config) if routed and config else None
    if shape is None:
        return None
    return MoeCounts(shape.experts, shape.top_k, total, routed, shared, len(blocks), max(blocks.values()))


# --- ZeRO-3 persistence and LoRA ---
def persistence_threshold(hidden_size: int | None) -> int:
    """The registry's "auto" stage3_param_persistence_threshold: 10 x width, or DeepSpeed's 1e5."""
    return 10 * hidden_size if hidden_size else DEFAULT_PERSISTENCE_THRESHOLD


def persistent_params(numels: Iterable[int], threshold: int) -> int:
    """Elements of the parameters DeepSpeed keeps whole on every rank at ZeRO-3 (numel <= threshold)."""
    return sum(n for n in numels if n <= threshold)


def lora_tensors(tensors: Iterable[TensorEntry], rank: int, target_modules: Sequence[str]) -> list[int]:
    """Element counts of peft's adapters: lora_A (r x in*k*k) and lora_B (out x r) per targeted Linear/Conv (a
    module named a target or ending with "." + target)."""
    out = []
    for t in tensors:
        if not t.name.endswith(".weight") or len(t.shape) < 2:
            continue
        module = t.name[: -len(".weight")]
        if any(module == m or module.endswith("." + m) for m in target_modules):
            out += [rank * math.prod(t.shape[1:]), t.shape[0] * rank]
    return out


def lora_params(tensors: Iterable[TensorEntry], rank: int, target_modules: Sequence[str]) -> int:
    """Trainable elements of LoRA: r x (in + out) per targeted Linear (see lora_tensors)."""
    return sum(lora_tensors(tensors, rank, target_modules))


# --- model states per rank ---
@dataclass(frozen=True, order=True)
class Choice:
    """One placement of a role: ZeRO stage and what is offloaded to host memory."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def label(self) -> str:
        extra = [n for n, on in (("offload optimizer", self.offload_optimizer), ("offload params", self.offload_params))
                 if on]
        return f"stage {self.stage}" + "".join(f" + {e}" for e in extra)


def trainable_choices(offload_optimizer: bool = True, offload_params: bool = True) -> tuple[Choice, ...]:
    """A trainable role's placements, cheapest first: stages 0-3, then optimizer offload, then parameter offload."""
    out = [Choice(0), Choice(1), Choice(2), Choice(3)]
    if offload_optimizer:
        out += [Choice(2, offload_optimizer=True), Choice(3, offload_optimizer=True)]
    if offload_params:
        out.append(Choice(3, offload_optimizer=offload_optimizer, offload_params=True))
    return tuple(out)


def frozen_choices(offload_params: bool = True) -> tuple[Choice, ...]:
    """A frozen role's placements: stage 0 (ZeRO-1/2 split nothing without an optimizer), 3, 3 + offload."""
    return (Choice(0), Choice(3), Choice(3, offload_params=True)) if offload_params else (Choice(0), Choice(3))


@dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds for one role: on the accelerator (params, grads, optimizer) and in host memory."""

    params: int
    grads: int
    optimizer: int
    host: int = 0

    @property
    def accelerator(self) -> int:
        return self.params + self.grads + self.optimizer


def _partition(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def state_bytes(
    params: int,
    *,
    dtype: str,
    stage: int,
    world_size: int,
    trainable_params: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    persistent: int = 0,
    numels: Sequence[int] | None = None,
) -> StateBytes:
    """Per-rank bytes of one role's model states under DeepSpeed (Adam-type optimizer, two fp32 moments).

    With b = bytes per element, Ψ = params, T = trainable params, N = world size, P = persistent elements: stage 0
    holds b·Ψ parameters, b·T gradients, 12·T optimizer (8·T for fp32: no master); stage 1 12·T/N optimizer; stage 2
    also b·T/N gradients; stage 3 also b·(Ψ/N + P) parameters. ``offload_optimizer`` moves master, moments and fp32
    gradients to host (16·T/N, plus a b·T/N staging copy at stages 1-2); ``offload_params`` (stage 3) moves b·Ψ/N
    there. ``numels`` (one per tensor) makes the ZeRO-3 partition exact (each tensor padded to ceil(n/N))."""
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype={dtype!r}; use one of {sorted(DTYPE_BYTES)}.")
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"stage={stage!r}; use 0, 1, 2 or 3.")
    if offload_params and stage != 3:
        raise PlanError(f"offload_params needs stage 3 (got stage {stage}).")
    if offload_optimizer and (stage == 0 or not trainable_params):
        raise PlanError("offload_optimizer needs a trainable role at stage 1, 2 or 3.")
    b, n = DTYPE_BYTES[dtype], world_size
    t = trainable_params
    if not t and stage in (1, 2):
        stage = 0  # the registry builds a frozen ZeRO-1/2 role at stage 0
    host = 0
    if stage == 3:
        part = sum(_partition(x, n) for x in numels) if numels is not None else _partition(params, n)
        on_device = b * persistent
        if offload_params:
            host += b * part
        else:
            on_device += b * part
    else:
        on_device = b * params
    t_part = _partition(t, n)
    grads = optimizer = 0
    if t:
        if stage == 0:
            grads = b * t
            optimizer = (8 if b == 4 else 12) * t
        else:
            grads = b * (t if stage == 1 else t_part)
            optimizer = 12 * t_part
            if offload_optimizer:
                host += 16 * t_part + (b * t_part if stage < 3 else 0)
                optimizer = 0
                if stage > 1:
                    grads = 0
    return StateBytes(params=on_device, grads=grads, optimizer=optimizer, host=host)


def train_buffer_bytes(
    *, dtype: str, stage: int, world_size: int, trainable_params: int, offload_optimizer: bool = False,
    hidden_size: int | None = None,
) -> tuple[int, int]:
    """(during backward, at the optimizer step) bytes of a trainable role's step beyond its states: the reduce
    bucket at stages 1-3 (b·h²); the fp32 gradients, 4·T at stage 0 with 16-bit weights, 4·T/N at stages 1-3 (at
    most one 1e9-element sub-group at stage 3), none when the optimizer is offloaded."""
    b, t = DTYPE_BYTES[dtype], trainable_params
    if not t:
        return 0, 0
    if stage == 0:
        return 0, (4 * t if b < 4 else 0)
    bucket = b * (hidden_size * hidden_size if hidden_size else DEFAULT_REDUCE_BUCKET)
    part = _partition(t, world_size)
    fp32 = 0 if offload_optimizer else 4 * (min(part, STAGE3_SUB_GROUP_SIZE) if stage == 3 else part)
    return bucket, fp32


def gather_buffer_bytes(params: int, *, dtype: str, hidden_size: int | None = None, block: int = 0) -> int:
    """Accelerator bytes a ZeRO-3 role gathers while it runs layer by layer: at most
    stage3_max_live_parameters (3e7 in the project's configs), or the largest module gathered at once (``block``:
    an MoE layer's fused experts) when bigger, plus the prefetch bucket (0.9·h²)."""
    prefetch = int(0.9 * hidden_size * hidden_size) if hidden_size else int(5e7)
    return DTYPE_BYTES[dtype] * min(params, max(STAGE3_MAX_LIVE_PARAMETERS, block) + prefetch)


def comm_bytes(params: int, *, dtype: str, stage: int, trainable_params: int = 0,
               offload_optimizer: bool = False, offload_params: bool = False) -> int:
    """Relative traffic per step, only to rank placements: gradients 2·b·T; ZeRO-3 gathers 2·b·Ψ (trainable) or
    b·Ψ (frozen); offloads add host-device copies."""
    b, t = DTYPE_BYTES[dtype], trainable_params
    total = 2 * b * t
    if stage == 3:
        total += (2 if t else 1) * b * params
    if offload_optimizer:
        total += 2 * b * t
    if offload_params:
        total += (2 if t else 1) * b * params
    return total


# --- activation estimates (closed forms; estimates, not measurements) ---
@dataclass(frozen=True)
class TransformerDims:
    """The sizes of a transformer stack that the activation formulas need."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int = 0
    kv_hidden: int | None = None  # hidden size of K and V (grouped-query attention); None = hidden
    mlp: str = "gelu"  # "relu" | "gelu" | "gated" (SwiGLU / GeGLU: three MLP matrices)
    rms_norm: bool = False  # RMSNorm computing in fp32 (Llama, T5): keeps an fp32 copy of its input
    rotary: bool = False  # rotary position embeddings: q and k are kept before rotation too
    extra_per_layer: int = 0  # more elements per token per layer (see dit_dims; MoE routing)

    @property
    def kv(self) -> int:
        return self.kv_hidden or self.hidden


_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "mixtral", "phi3", "olmo", "olmo2",
               "granite", "cohere", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"}


def transformer_dims(config: Mapping[str, Any]) -> TransformerDims:
    """TransformerDims from a transformers config.json (OPT, Llama, Mistral, Qwen, GPT-2, CLIP, T5, ...)."""
    cfg = dict(config)
    cfg.update(cfg.get("text_config") or {})

    def first(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if isinstance(cfg.get(k), int) and cfg[k] > 0:
                return cfg[k]
        return default

    hidden = first("hidden_size", "d_model", "n_embd", "dim")
    layers = first("num_hidden_layers", "num_layers", "n_layer", "n_layers")
    if not hidden or not layers:
        raise PlanError(f"config has no hidden size / layer count the activation estimate can use (keys: "
                        f"{sorted(cfg)[:20]}...).")
    intermediate = first("intermediate_size", "ffn_dim", "d_ff", "n_inner", default=4 * hidden)
    heads = first("num_attention_heads", "num_heads", "n_head", default=1)
    kv_heads = first("num_key_value_heads", default=heads)
    head_dim = first("head_dim", "d_kv", default=hidden // heads)
    model_type = str(cfg.get("model_type", ""))
    act = (str(cfg.get("hidden_act", "")) + str(cfg.get("activation_function", ""))
           + str(cfg.get("feed_forward_proj", ""))).lower()
    llama_like = model_type in _LLAMA_LIKE
    mlp = "gated" if ("gated" in act or llama_like) else ("relu" if act == "relu" or act.endswith("relu") else "gelu")
    extra = 0
    shape = _moe_shape(cfg)
    if shape is not None:  # a token runs top_k experts (and the shared ones) instead of one wide MLP
        expert = first("moe_intermediate_size", default=intermediate)
        shared = first("shared_expert_intermediate_size", default=expert * first("n_shared_experts", default=0))
        intermediate = shape.top_k * expert + shared
        extra = 2 * shape.top_k * hidden + 2 * shape.experts  # each routed copy's input and output; router scores
    return TransformerDims(hidden=hidden, layers=layers, intermediate=intermediate,
                           vocab=first("vocab_size", default=0),
                           kv_hidden=kv_heads * head_dim if kv_heads != heads else None, mlp=mlp,
                           rms_norm=llama_like or model_type in {"t5", "umt5", "mt5"}, rotary=llama_like,
                           extra_per_layer=extra)


def _moe_shape(config: Mapping[str, Any]) -> Any:
    """engines.moe.moe_shape of a config that names experts (torch is imported only for those), else None."""
    if not any("expert" in str(k) for k in config):
        return None
    from .moe import moe_shape

    return moe_shape(dict(config))


def _layer_elements(d: TransformerDims, activation_bytes: int = 2) -> int:
    """Elements one layer saves for backward per token (fused attention, no dropout): 7·h + 2·h_kv + the MLP's
    wide tensors (i ReLU, 2·i GELU, 4·i gated), + 2·h for fp32 RMSNorm copies, + h + h_kv with rotary."""
    wide = {"relu": 1, "gelu": 2, "gated": 4}[d.mlp] * d.intermediate
    extra = (2 * d.hidden if d.rms_norm and activation_bytes < 4 else 0) + (d.hidden + d.kv if d.rotary else 0)
    return 7 * d.hidden + 2 * d.kv + wide + extra + d.extra_per_layer


def transformer_activation_bytes(
    dims: TransformerDims, *, batch: int, seq: int, dtype: str, trainable: bool,
    gradient_checkpointing: bool = False, logits: bool = False,
) -> int:
    """Estimated activation peak of one forward (+ backward when ``trainable``) of a transformer stack: per layer
    a·b·s·_layer_elements (34·b·s·h for GELU at a = 2, Korthikanti et al. 2022 without dropout masks); with
    gradient checkpointing only each layer's input plus one recomputed layer; ``logits`` adds a·b·s·V + 4·b·s·V
    for the fp32 log-softmax (+ 4·b·s·V for its gradient). A frozen forward keeps about one layer's working set."""
    a, tokens = DTYPE_BYTES[dtype], batch * seq
    layer = a * tokens * _layer_elements(dims, a)
    if not trainable:
        body = layer
    elif gradient_checkpointing:
        body = a * tokens * dims.hidden * dims.layers + layer
    else:
        body = layer * dims.layers
    body += 2 * a * tokens * dims.hidden  # embedding output and final norm input
    if logits and dims.vocab:
        body += tokens * dims.vocab * (a + 4 + (4 if trainable else 0))
    return body


def dit_dims(config: Mapping[str, Any]) -> TransformerDims:
    """TransformerDims of a diffusion transformer (SD3 MMDiT, FLUX): each block one layer with a 4·h GELU MLP,
    + 4·h per token for adaLN (21·h in all), + 7·h for FLUX's fp32 rotary and q/k norms (see activation_probe.py)."""
    hidden = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    layers = int(config.get("num_layers", 0)) + int(config.get("num_single_layers", 0))
    extra = 4 * hidden + (7 * hidden if "axes_dims_rope" in config else 0)
    return TransformerDims(hidden=hidden, layers=layers, intermediate=4 * hidden, mlp="gelu", extra_per_layer=extra)


def dit_tokens(config: Mapping[str, Any], *, height: int, width: int, text_tokens: int, vae_scale: int = 8) -> int:
    """Sequence length of a diffusion transformer: latent patches ((H/8/p) x (W/8/p)) + text tokens."""
    patch = int(config.get("patch_size", 2))
    if "axes_dims_rope" in config:  # FLUX packs 2x2 latent patches outside the model (patch_size 1)
        patch = 2
    return (height // vae_scale // patch) * (width // vae_scale // patch) + text_tokens


def kv_cache_bytes(dims: TransformerDims, *, batch: int, seq: int, dtype: str) -> int:
    """Generation's key/value cache: 2 (K and V) x layers x batch x tokens x h_kv x bytes."""
    return 2 * dims.layers * batch * seq * dims.kv * DTYPE_BYTES[dtype]


def _as_list(value: Any, n: int) -> list[int]:
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)] * n


def unet_activation_bytes(
    config: Mapping[str, Any], *, batch: int, latent_height: int, latent_width: int, dtype: str,
    trainable: bool = True, gradient_checkpointing: bool = False, text_tokens: int = 77,
) -> int:
    """Estimated activation peak of a diffusers ``UNet2DConditionModel`` step: per down/mid/up unit, in elements,
    a resnet 3·c_in + 3·c, a transformer block 30·c per token per layer + 3·c, a resampling conv its input.
    Gradient checkpointing keeps the units' inputs plus the largest unit; a frozen forward its largest unit."""
    a = DTYPE_BYTES[dtype]
    channels = [int(c) for c in config.get("block_out_channels", (320, 640, 1280, 1280))]
    levels = len(channels)
    down_types = list(config.get("down_block_types", ["CrossAttnDownBlock2D"] * (levels - 1) + ["DownBlock2D"]))
    up_types = list(config.get("up_block_types", ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * (levels - 1)))
    per_block = _as_list(config.get("layers_per_block", 2), levels)
    tlayers = _as_list(config.get("transformer_layers_per_block", 1), levels)
    n0 = latent_height * latent_width
    units: list[tuple[int, int]] = []  # (saved elements, input elements) per unit, one sample

    def resnet(c_in: int, c: int, n: int) -> None:
        units.append(((3 * c_in + 3 * c) * n, c_in * n))

    def attention(c: int, n: int, layers: int) -> None:
        units.append(((3 * c + 30 * c * layers) * n + 2 * c * layers * text_tokens, c * n))

    extra = 4 * n0 + 3 * channels[0] * n0  # conv_in input; norm, SiLU and conv_out inputs
    skips = [channels[0]]
    c_prev = channels[0]
    for level, c in enumerate(channels):
        n = n0 // 4**level
        for _ in range(per_block[level]):
            resnet(c_prev, c, n)
            if "CrossAttn" in down_types[level]:
                attention(c, n, tlayers[level])
            c_prev = c
            skips.append(c)
        if level < levels - 1:
            extra += c * n  # downsampling conv input
            skips.append(c)
    n_mid = n0 // 4 ** (levels - 1)
    resnet(c_prev, c_prev, n_mid)
    if "CrossAttn" in str(config.get("mid_block_type", "UNetMidBlock2DCrossAttn")):
        attention(c_prev, n_mid, tlayers[-1])
    resnet(c_prev, c_prev, n_mid)
    up_layers = list(reversed(tlayers))
    for i, c in enumerate(reversed(channels)):
        level = levels - 1 - i
        n = n0 // 4**level
        for _ in range(per_block[level] + 1):
            skip = skips.pop() if skips else c
            resnet(c_prev + skip, c, n)
            if i < len(up_types) and "CrossAttn" in up_types[i]:
                attention(c, n, up_layers[i])
            c_prev = c
        if level > 0:
            extra += c * n * 4  # upsampling conv input (after 2x nearest upsampling)
    largest = max(s for s, _ in units)
    if not trainable:
        elements = largest
    elif gradient_checkpointing:
        elements = sum(i for _, i in units) + largest + extra
    else:
        elements = sum(s for s, _ in units) + extra
    return a * batch * elements


def conv_frozen_activation_bytes(*, batch: int, height: int, width: int, channels: int, dtype: str) -> int:
    """Estimated peak of a frozen convolutional forward (a VAE encode): about four tensors of its
    first level's width at full resolution live at once (input, conv output, norm and SiLU outputs)."""
    return 4 * DTYPE_BYTES[dtype] * batch * height * width * channels


# --- roles and the placement chooser ---
@dataclass(frozen=True)
class RoleRequest:
    """One role as the planner sees it. ``phases``: (label, bytes) of placement-independent transient uses;
    ``full_gather``: phases during which a stage-3 role is gathered whole; ``follows``: the role whose stage this
    one takes (``follows_all``: the whole placement); ``current``: the placement the config asks for."""

    name: str
    params: int
    dtype: str
    trainable_params: int = 0
    numels: tuple[int, ...] | None = None
    hidden_size: int | None = None
    persistence_threshold: int | None = None
    lora: bool = False
    phases: tuple[tuple[str, int], ...] = ()
    full_gather: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()
    current: Choice | None = None
    follows: str | None = None
    follows_all: bool = False
    source: str = ""
    note: str = ""
    gather_hint: str = ""  # how the config turns the whole-model gather off (for the message)
    moe: MoeCounts | None = None  # a mixture of experts' counts (active parameters, expert blocks)

    @property
    def trainable(self) -> bool:
        return self.trainable_params > 0

    @property
    def persistent(self) -> int:
        threshold = self.persistence_threshold or persistence_threshold(self.hidden_size)
        if self.numels is None:
            return 0
        return persistent_params(self.numels, threshold)

    def allowed(self) -> tuple[Choice, ...]:
        if self.choices:
            return self.choices
        return trainable_choices() if self.trainable else frozen_choices()


@dataclass(frozen=True)
class RoleOption:
    """One placement of one role, costed."""

    choice: Choice
    states: StateBytes
    transient: int  # the role's largest transient use at this placement (see cost_role)
    transient_phase: str
    comm: int

    @property
    def accelerator_peak(self) -> int:
        return self.states.accelerator + self.transient


def _normalise(req: RoleRequest, choice: Choice) -> Choice:
    if not req.trainable and choice.stage in (1, 2):
        return Choice(0, offload_params=False)
    return choice


def cost_role(req: RoleRequest, choice: Choice, world_size: int) -> RoleOption:
    """Bytes and relative traffic of ``req`` at ``choice``. Transient peak: the largest phase (plus at stage 3 the
    gathered parameters, plus the reduce bucket when training) or the optimizer step's fp32 gradients."""
    choice = _normalise(req, choice)
    n = world_size
    states = state_bytes(req.params, dtype=req.dtype, stage=choice.stage, world_size=n,
                         trainable_params=req.trainable_params, offload_optimizer=choice.offload_optimizer,
                         offload_params=choice.offload_params, persistent=req.persistent if choice.stage == 3 else 0,
                         numels=req.numels)
    bucket, fp32_grads = train_buffer_bytes(dtype=req.dtype, stage=choice.stage, world_size=n,
                                            trainable_params=req.trainable_params,
                                            offload_optimizer=choice.offload_optimizer, hidden_size=req.hidden_size)
    # ZeRO-3 fetches parameters for each use when they are split over ranks or offloaded to the host
    sharded = choice.stage == 3 and (n > 1 or choice.offload_params)
    best, best_label = fp32_grads, "optimizer step"
    for label, nbytes in req.phases:
        extra = nbytes
        if sharded:
            if label in req.full_gather:
                extra += DTYPE_BYTES[req.dtype] * req.params - states.params  # the rest of the model
            else:
                extra += gather_buffer_bytes(req.params, dtype=req.dtype, hidden_size=req.hidden_size,
                                             block=req.moe.block if req.moe else 0)
        if req.trainable and label.startswith("train"):
            extra += bucket
        if extra > best:
            best, best_label = extra, label
    comm = comm_bytes(req.params, dtype=req.dtype, stage=choice.stage, trainable_params=req.trainable_params,
                      offload_optimizer=choice.offload_optimizer, offload_params=choice.offload_params)
    return RoleOption(choice, states, best, best_label, comm if n > 1 else 0)


@dataclass(frozen=True)
class Budget:
    """What one rank may use: accelerator bytes per GPU, host bytes per node, ranks per node."""

    world_size: int
    gpu_bytes: int
    host_bytes: int | None = None
    gpus_per_node: int | None = None
    cuda_context: int = CUDA_CONTEXT_BYTES
    nccl: int = NCCL_BYTES
    margin: float = FRAGMENTATION_MARGIN
    host_reserve: float = HOST_RESERVE

    @property
    def fixed(self) -> int:
        return self.cuda_context + (self.nccl if self.world_size > 1 else 0)

    @property
    def ranks_per_node(self) -> int:
        return self.gpus_per_node or self.world_size


def budget_for(gpus: int, gpu_mem: str, nodes: int = 1, cpu_mem: str | None = None,
               margin: float | None = None) -> Budget:
    """The Budget of ``gpus`` GPUs of ``gpu_mem`` each (e.g. "80GiB") spread evenly over ``nodes``, ``cpu_mem`` of
    host memory per node (None: not checked); PlanError naming the command-line flag when one is impossible."""
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: plan for at least 1 GPU")
    if nodes < 1 or gpus % nodes:
        raise PlanError(f"--gpus {gpus} is not a multiple of --nodes {nodes}; give the total number of GPUs, spread "
                        "evenly over the nodes")
    if margin is not None and not 0 <= margin < 1:
        raise PlanError(f"--margin {margin}: give a fraction in [0, 1), e.g. 0.1")
    return Budget(world_size=gpus, gpus_per_node=gpus // nodes, gpu_bytes=parse_bytes(gpu_mem, "--gpu-mem"),
                  host_bytes=parse_bytes(cpu_mem, "--cpu-mem") if cpu_mem else None,
                  margin=FRAGMENTATION_MARGIN if margin is None else margin)


def parse_assume(items: Sequence[str]) -> dict[str, str]:
    """``--assume ROLE=MODEL`` options as {role: model}."""
    out = {}
    for item in items:
        role, sep, model = item.partition("=")
        if not sep or not role or not model:
            raise PlanError(f"--assume {item!r}: expected ROLE=MODEL, e.g. --assume actor=facebook/opt-1.3b")
        out[role] = model
    return out


@dataclass
class RolePlan:
    request: RoleRequest
    options: list[RoleOption]  # one per allowed choice, in the request's order
    chosen: RoleOption
    current: RoleOption | None


@dataclass
class Plan:
    budget: Budget
    roles: list[RolePlan]
    fits: bool
    message: str
    model_states: int = 0
    transient: int = 0
    transient_role: str = ""
    transient_phase: str = ""
    fixed: int = 0
    margin: int = 0
    total: int = 0
    host_per_node: int = 0
    load_peak_per_node: int = 0
    current_total: int | None = None
    current_fits: bool | None = None
    notes: list[str] = field(default_factory=list)

    def role(self, name: str) -> RolePlan:
        for r in self.roles:
            if r.request.name == name:
                return r
        raise KeyError(name)

    def placements(self) -> dict[str, Choice]:
        return {r.request.name: r.chosen.choice for r in self.roles}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (summary.json / --json): per role its chosen placement and per-rank bytes."""
        def option(o: RoleOption) -> dict[str, Any]:
            return {"stage": o.choice.stage, "offload_optimizer": o.choice.offload_optimizer,
                    "offload_params": o.choice.offload_params, "param_bytes": o.states.params,
                    "grad_bytes": o.states.grads, "optimizer_bytes": o.states.optimizer,
                    "host_bytes": o.states.host, "transient_bytes": o.transient, "transient_phase": o.transient_phase}

        return {
            "world_size": self.budget.world_size, "gpus_per_node": self.budget.ranks_per_node,
            "gpu_bytes": self.budget.gpu_bytes, "host_bytes": self.budget.host_bytes,
            "fits": self.fits, "message": self.message,
            "per_gpu": {"model_states": self.model_states, "transient": self.transient,
                        "transient_role": self.transient_role, "transient_phase": self.transient_phase,
                        "fixed": self.fixed, "margin": self.margin, "total": self.total},
            "current": {"total": self.current_total, "fits": self.current_fits},
            "host_per_node": self.host_per_node, "load_peak_per_node": self.load_peak_per_node,
            "roles": {
                r.request.name: {
                    "params": r.request.params, "trainable_params": r.request.trainable_params,
                    "dtype": r.request.dtype, "lora": r.request.lora, "persistent_params": r.request.persistent,
                    "source": r.request.source, "moe": r.request.moe.to_dict() if r.request.moe else None,
                    "chosen": option(r.chosen),
                    "current": option(r.current) if r.current else None,
                    "options": [option(o) for o in r.options],
                } for r in self.roles
            },
            "notes": list(self.notes),
        }


def follower_choice(req: RoleRequest, leader: Choice, own: Choice) -> Choice:
    """A follower's placement given its leader's (an EMA takes the stage, keeps its own offload)."""
    if req.follows_all:
        return Choice(leader.stage, leader.offload_optimizer and req.trainable, leader.offload_params)
    stage = leader.stage if (req.trainable or leader.stage in (0, 3)) else 0
    return Choice(stage, False, own.offload_params and stage == 3)


def _totals(options: Sequence[RoleOption], budget: Budget) -> tuple[int, int, int, int, int]:
    states = sum(o.states.accelerator for o in options)
    peak = max((o.transient for o in options), default=0)
    base = states + peak + budget.fixed
    margin = int(base * budget.margin)
    host = budget.ranks_per_node * sum(o.states.host for o in options)
    return states, peak, margin, base + margin, host


def plan(roles: Sequence[RoleRequest], budget: Budget) -> Plan:
    """The cheapest placement per role such that one rank's peak (Σ model states + the largest transient + fixed
    overheads, times 1 + margin) fits ``budget.gpu_bytes`` and offloads fit the host, over every combination.
    "Cheapest": fewest offloaded-parameter bytes, then offloaded-optimizer bytes, communication, lowest stages."""
    if budget.world_size < 1:
        raise PlanError(f"world size {budget.world_size}: plan for at least one GPU.")
    names = [r.name for r in roles]
    if len(set(names)) != len(names):
        raise PlanError(f"role names repeat: {names}")
    by_name = {r.name: r for r in roles}
    for r in roles:
        if r.follows and r.follows not in by_name:
            raise PlanError(f"role '{r.name}' follows '{r.follows}', which is not planned.")
    n = budget.world_size
    free = [r for r in roles if not r.follows]
    followers = [r for r in roles if r.follows]
    host_limit = None if budget.host_bytes is None else budget.host_bytes * (1 - budget.host_reserve)
    cache: dict[tuple[str, Choice], RoleOption] = {}

    def costed(req: RoleRequest, choice: Choice) -> RoleOption:
        key = (req.name, choice)
        if key not in cache:
            cache[key] = cost_role(req, choice, n)
        return cache[key]

    def assemble(assignment: dict[str, Choice]) -> list[RoleOption]:
        chosen = dict(assignment)
        for f in followers:
            own = chosen.get(f.name) or (f.current or f.allowed()[0])
            chosen[f.name] = follower_choice(f, chosen[f.follows], own)
        return [costed(by_name[name], chosen[name]) for name in names]

    follower_offload = [f for f in followers if not f.follows_all
                        and any(c.offload_params for c in f.allowed())]
    spaces = [r.allowed() for r in free] + [
        tuple(sorted({Choice(3, offload_params=False), Choice(3, offload_params=True)})) for _ in follower_offload
    ]
    best: tuple | None = None
    best_options: list[RoleOption] | None = None
    leanest: tuple | None = None  # the smallest total, reported when nothing fits
    leanest_options: list[RoleOption] = []
    for combo in itertools.product(*spaces):
        assignment = {r.name: c for r, c in zip(free, combo)}
        for f, c in zip(follower_offload, combo[len(free):]):
            assignment[f.name] = c
        options = assemble(assignment)
        states, _, _, total, host = _totals(options, budget)
        if leanest is None or (total, states) < leanest:
            leanest, leanest_options = (total, states), options
        if total > budget.gpu_bytes or (host_limit is not None and host > host_limit):
            continue
        key = (
            sum(o.states.host for o in options if o.choice.offload_params),
            sum(o.states.host for o in options if o.choice.offload_optimizer and not o.choice.offload_params),
            sum(o.comm for o in options),
            sum(o.choice.stage for o in options),
            total,
        )
        if best is None or key < best:
            best, best_options = key, options

    current_options = None
    if all(r.current is not None for r in roles):
        current_options = assemble({r.name: r.current for r in roles})  # type: ignore[misc]
    fits = best_options is not None
    if not fits:
        best_options = leanest_options  # report the most memory-saving combination
    assert best_options is not None
    states, peak, margin, total, host = _totals(best_options, budget)
    peak_option = max(best_options, key=lambda o: o.transient)
    peak_role = names[best_options.index(peak_option)]
    role_plans = []
    for i, r in enumerate(roles):
        opts = [costed(r, c) for c in r.allowed()]
        role_plans.append(RolePlan(r, opts, best_options[i], current_options[i] if current_options else None))
    result = Plan(budget=budget, roles=role_plans, fits=fits, message="", model_states=states, transient=peak,
                  transient_role=peak_role, transient_phase=peak_option.transient_phase, fixed=budget.fixed,
                  margin=margin, total=total, host_per_node=host)
    result.load_peak_per_node = budget.ranks_per_node * max((4 * r.params for r in roles), default=0)
    if current_options is not None:
        _, _, _, cur_total, cur_host = _totals(current_options, budget)
        result.current_total = cur_total
        result.current_fits = cur_total <= budget.gpu_bytes and (host_limit is None or cur_host <= host_limit)
    result.message = _message(result, host_limit)
    return result


def _message(p: Plan, host_limit: float | None) -> str:
    gpu = fmt_bytes(p.budget.gpu_bytes)
    if p.fits:
        peak = f" (peak during {p.transient_role} {p.transient_phase})" if p.transient else ""
        return f"fits: {fmt_bytes(p.total)} of {gpu} per GPU on {p.budget.world_size} GPU(s){peak}."
    biggest = max(p.roles, key=lambda r: r.chosen.accelerator_peak)
    o = biggest.chosen
    lines = [
        f"does not fit: even with every role at its leanest placement one GPU needs {fmt_bytes(p.total)} "
        f"(budget {gpu} on {p.budget.world_size} GPU(s)).",
        f"The biggest role is '{biggest.request.name}' ({fmt_count(biggest.request.params)} parameters, "
        f"{biggest.request.dtype}): {fmt_bytes(o.states.accelerator)} of model states at {o.choice.label} "
        f"plus {fmt_bytes(o.transient)} during its {o.transient_phase}.",
    ]
    if host_limit is not None and p.host_per_node > host_limit:
        lines.append(f"Offloaded states need {fmt_bytes(p.host_per_node)} of host memory per node "
                     f"(usable: {fmt_bytes(host_limit)}).")
    gathered = o.transient_phase in biggest.request.full_gather and o.choice.stage == 3
    if gathered and o.transient > o.states.accelerator:
        lines.append(f"Its {o.transient_phase} gathers the whole role on every GPU "
                     f"({fmt_bytes(DTYPE_BYTES[biggest.request.dtype] * biggest.request.params)}): gather it layer by "
                     f"layer instead{' (' + biggest.request.gather_hint + ')' if biggest.request.gather_hint else ''}.")
    elif o.transient > o.states.accelerator:
        lines.append("Activations dominate: lower the micro batch or sequence/image size, or turn on gradient "
                     "checkpointing.")
    else:
        lines.append("Use more GPUs, LoRA for the biggest trainable role, or a smaller model.")
    return " ".join(lines)


# --- tables ---
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_plan(p: Plan, title: str = "") -> str:
    """The per-role option tables, the chosen placements and the per-GPU total, as text."""
    out = []
    if title:
        out.append(title)
    b = p.budget
    out.append(f"{b.world_size} GPU(s), {b.ranks_per_node} per node, {fmt_bytes(b.gpu_bytes)} per GPU"
               + (f", {fmt_bytes(b.host_bytes)} host memory per node" if b.host_bytes else "")
               + ". Bytes are per GPU (rank); activations are estimates.")
    for rp in p.roles:
        r = rp.request
        kind = (f"trainable, LoRA, {r.trainable_params:,} trainable" if r.lora else "trainable") if r.trainable \
            else ("frozen, with LoRA adapters" if r.lora else "frozen")
        head = f"\nrole {r.name}: {r.params:,} parameters ({fmt_count(r.params)}), {r.dtype}, {kind}"
        if r.source:
            head += f"\n  model: {r.source}"
        if r.note:
            head += f"\n  note: {r.note}"
        if r.moe:
            head += f"\n  moe: {r.moe.describe(r.dtype)}"
        if r.phases:
            head += "\n  transient: " + "; ".join(f"{label} {fmt_bytes(v)}" for label, v in r.phases)
        out.append(head)
        rows = []
        for o in rp.options:
            marks = []
            if rp.current is not None and o.choice == rp.current.choice:
                marks.append("config")
            if o.choice == rp.chosen.choice:
                marks.append("chosen")
            rows.append([o.choice.label, fmt_bytes(o.states.params), fmt_bytes(o.states.grads),
                         fmt_bytes(o.states.optimizer), fmt_bytes(o.states.accelerator), fmt_bytes(o.states.host),
                         fmt_bytes(o.transient), ", ".join(marks)])
        if rp.chosen.choice not in [o.choice for o in rp.options]:
            o = rp.chosen
            rows.append([o.choice.label + f" (follows {r.follows})", fmt_bytes(o.states.params),
                         fmt_bytes(o.states.grads), fmt_bytes(o.states.optimizer), fmt_bytes(o.states.accelerator),
                         fmt_bytes(o.states.host), fmt_bytes(o.transient), "chosen"])
        out.append(_indent(_table(["placement", "params", "grads", "optimizer", "states", "host", "transient", ""],
                                  rows)))
    out.append("")
    rows = []
    for rp in p.roles:
        cur = rp.current.choice.label if rp.current else "-"
        rows.append([rp.request.name, cur, rp.chosen.choice.label, fmt_bytes(rp.chosen.states.accelerator),
                     fmt_bytes(rp.chosen.states.host)])
    out.append(_table(["role", "config", "chosen", "states/GPU", "host/GPU"], rows))
    out.append("")
    out.append(f"per GPU: model states {fmt_bytes(p.model_states)} + peak transient {fmt_bytes(p.transient)} "
               f"({p.transient_role} {p.transient_phase}) + fixed {fmt_bytes(p.fixed)} "
               f"+ margin {fmt_bytes(p.margin)} = {fmt_bytes(p.total)}")
    if p.host_per_node:
        out.append(f"host per node: offloaded states {fmt_bytes(p.host_per_node)}")
    if b.host_bytes and p.load_peak_per_node > b.host_bytes * (1 - b.host_reserve):
        out.append(f"warning: loading may need up to {fmt_bytes(p.load_peak_per_node)} of host memory per node "
                   f"(every rank holding the largest role in fp32 while it is built)")
    if p.current_total is not None:
        out.append(f"as configured: {fmt_bytes(p.current_total)} per GPU -> "
                   + ("fits" if p.current_fits else "does NOT fit"))
    out.extend(f"note: {n}" for n in p.notes)
    out.append(p.message)
    return "\n".join(out)


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line for line in text.splitlines())

"""DeepSpeed config factories (plain dicts) and per-role resolution of "auto" values at build time; why each
performance default is what it is (benchmarks/config_ablation.py) is said where it is set."""

from __future__ import annotations

import copy
import difflib
import json
import os
from typing import Any

import torch

from .settings import DTYPES, SettingsError

AUTO = "auto"


# Top-level keys DeepSpeed understands (the common ones). Anything else is almost always a typo,
# which DeepSpeed itself would silently ignore; we reject it with a suggestion instead.
KNOWN_TOP_LEVEL_KEYS = frozenset(
    {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "steps_per_print", "wall_clock_breakdown", "dump_state", "prescale_gradients",
        "gradient_predivide_factor", "gradient_clipping", "sparse_gradients", "zero_optimization",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "optimizer", "scheduler",
        "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "data_types", "communication_data_type",
        "seq_parallel_communication_data_type", "activation_checkpointing", "flops_profiler",
        "comms_logger", "tensorboard", "wandb", "csv_monitor", "comet", "aio", "checkpoint",
        "data_efficiency", "curriculum_learning", "elasticity", "autotuning", "pipeline",
        "compression_training", "hybrid_engine", "memory_breakdown", "disable_allgather",
        "load_universal_checkpoint", "use_node_local_storage", "graph_harvesting", "compile",
        "weight_quantization", "nebula", "eigenvalue", "progressive_layer_drop", "quantize_training",
        "sequence_parallel_size", "timers", "zero_quantized_weights", "zero_quantized_gradients",
        "mics_shard_size", "mics_hierarchical_params_gather", "dataloader_drop_last",
        "use_data_before_expert_parallelism", "expert_parallel", "tensor_parallel", "monitor_config",
        "gradient_accumulation_dtype", "seed",
    }
)


class ConfigError(SettingsError):
    """A config value that DeepSpeed (or this project) would reject, with the key, the value and the fix."""


def _suggest(key: str, valid: Any) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _dtype_section(dtype: str) -> dict[str, Any]:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {list(DTYPES)}.")
    fp16: dict[str, Any] = {"enabled": dtype == "fp16"}
    if dtype == "fp16":
        # dynamic loss scaling from 2^16, halved after 2 overflows, raised after 1000 clean steps
        fp16.update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    return {"bf16": {"enabled": dtype == "bf16"}, "fp16": fp16}


def _zero_section(stage: int, offload_params: bool, offload_optimizer: bool, trainable: bool) -> dict[str, Any]:
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3.")
    if offload_params and stage != 3:
        raise ConfigError(
            f"offload_params=True needs stage=3 (got stage={stage}): only ZeRO-3 partitions parameters."
        )
    if offload_optimizer and (not trainable or stage == 0):
        raise ConfigError(
            "offload_optimizer=True needs a trainable role at stage 1, 2 or 3 "
            f"(got stage={stage}, trainable={trainable})."
        )
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(
            {
                "offload_param": {"device": "cpu" if offload_params else "none"},
                "stage3_param_persistence_threshold": AUTO,
                "stage3_prefetch_bucket_size": AUTO,
                "stage3_max_live_parameters": 3e7,
                "stage3_max_reuse_distance": 1e7,
                "stage3_gather_16bit_weights_on_model_save": True,
                # true (DeepSpeed's default) replaces F.linear for the whole process once any ZeRO-3 model is
                # built: every linear call of every role, whole weights too, pays for ZeRO-3's wrapper.
                "memory_efficient_linear": False,
            }
        )
    if trainable and stage >= 1:
        zero["offload_optimizer"] = {"device": "cpu" if offload_optimizer else "none"}
        zero["reduce_bucket_size"] = AUTO
        zero["contiguous_gradients"] = True
        zero["overlap_comm"] = AUTO  # on where the accelerator has streams to overlap on (resolve_bucket_sizes)
    return zero


def train_ds_config(stage: int = 2, dtype: str = "bf16", micro_batch_size: int | str = AUTO,
                    grad_accum: int | str = AUTO, train_batch_size: int | str = AUTO, offload_optimizer: bool = False,
                    offload_params: bool = False, gradient_clipping: float = 1.0,
                    steps_per_print: int = 10**9) -> dict[str, Any]:
    """DeepSpeed config for a trainable role; "auto" batch keys resolved at build time. ``gradient_clipping``: the
    norm, 0.0 = off, written as given (DeepSpeed's default is 1.0 since 0.19)."""
    if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
            or not gradient_clipping >= 0:
        raise ConfigError(f"gradient_clipping={gradient_clipping!r} must be a number >= 0 (0.0 = no clipping).")
    cfg: dict[str, Any] = {
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "steps_per_print": steps_per_print,
        "zero_optimization": _zero_section(stage, offload_params, offload_optimizer, trainable=True),
        "wall_clock_breakdown": False,
        # Optimizers come from the role's factory (any torch optimizer), as in transformers' Trainer.
        "zero_allow_untested_optimizer": True,
    }
    cfg.update(_dtype_section(dtype))
    cfg["gradient_clipping"] = float(gradient_clipping)
    cfg["prescale_gradients"] = False
    cfg["gradient_predivide_factor"] = 1.0
    return cfg


def deepspeed_clipping_default() -> float:
    """The clip norm DeepSpeed applies to a config without ``gradient_clipping`` (the torch backend does too)."""
    try:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    except ImportError:
        return 0.0
    return float(GRADIENT_CLIPPING_DEFAULT)


def eval_ds_config(stage: int = 0, dtype: str = "bf16", offload_params: bool = False,
                   micro_batch_size: int | str = AUTO) -> dict[str, Any]:
    """DeepSpeed config for a frozen role (forward only; the batch keys only because DeepSpeed insists). ZeRO-1/2
    split only what a frozen role lacks (DeepSpeed refuses them without an optimizer): built at stage 0."""
    cfg: dict[str, Any] = {
        "train_batch_size": AUTO,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": _zero_section(stage, offload_params, False, trainable=False),
        "wall_clock_breakdown": False,
    }
    cfg.update(_dtype_section(dtype))
    return cfg


def load_ds_config(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A deep copy of a config dict, or the dict read from a DeepSpeed JSON file."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise ConfigError(f"ds_config={path!r} is neither a dict nor an existing JSON file.")
    with open(path) as f:
        return json.load(f)


def zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    if config.get("bf16", config.get("bfloat16", {})).get("enabled") is True:
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.float32


def validate_ds_config(role: str, config: dict[str, Any]) -> None:
    """Reject keys and values DeepSpeed would reject (or silently ignore), naming the role and key."""
    for key in config:
        if key not in KNOWN_TOP_LEVEL_KEYS:
            hint = _suggest(key, KNOWN_TOP_LEVEL_KEYS)
            raise ConfigError(f"role '{role}': unknown DeepSpeed config key '{key}'.{hint}")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"role '{role}': 'zero_optimization' must be a dict, got {zero!r}.")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # pydantic model that forbids extras

    fields = set(DeepSpeedZeroConfig.model_fields)
    aliases = {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
    for key in zero:
        if key not in fields and key not in aliases:
            raise ConfigError(f"role '{role}': unknown key 'zero_optimization.{key}'.{_suggest(key, fields | aliases)}")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"role '{role}': zero_optimization.stage={stage!r}; use 0, 1, 2 or 3.")
    check_offload_devices(role, zero)
    if config.get("fp16", {}).get("enabled") and config.get("bf16", {}).get("enabled"):
        raise ConfigError(f"role '{role}': fp16.enabled and bf16.enabled are both true; pick one.")


def check_offload_devices(role: str, zero: dict[str, Any]) -> None:
    """Offload devices DeepSpeed knows, and NVMe offload with the folder it swaps to: without nvme_path DeepSpeed
    fails only inside zero.Init, where the error reads as the role's model factory failing."""
    for section in ("offload_param", "offload_optimizer"):
        offload = zero.get(section)
        if not isinstance(offload, dict):
            continue
        device = str(offload.get("device", "none")).lower()
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"role '{role}': zero_optimization.{section}.device={offload.get('device')!r}; use "
                              "'none', 'cpu' or 'nvme'.")
        if device == "nvme" and not offload.get("nvme_path"):
            raise ConfigError(f"role '{role}': zero_optimization.{section}.device='nvme' needs "
                              f"zero_optimization.{section}.nvme_path, a folder on a local NVMe drive to swap to; "
                              "set it, or use device='cpu'.")


def model_hidden_size(model: torch.nn.Module) -> int | None:
    """The width ZeRO-3 buckets are sized from: config.hidden_size (d_model, n_embd, hidden_sizes), else the widest
    Linear/Conv (a UNet has no hidden_size: why accelerate's "auto" fails on it)."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        for attr in ("hidden_size", "d_model", "n_embd"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        sizes = getattr(cfg, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes:
            return int(max(sizes))
    widest = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            widest = max(widest, module.in_features, module.out_features)
        elif isinstance(module, torch.nn.modules.conv._ConvNd):
            widest = max(widest, module.in_channels, module.out_channels)
    return widest or None


def model_param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters, trainable parameters) of a model, whole sizes also for ZeRO-3 partitions."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


# DeepSpeed's own defaults (sized for models of a billion parameters and more).
DS_DEFAULT_BUCKETS = {"reduce_bucket_size": int(5e8), "stage3_prefetch_bucket_size": int(5e7),
                      "stage3_param_persistence_threshold": int(1e5)}


def auto_bucket_sizes(hidden_size: int | None, num_params: int | None = None,
                      trainable_params: int | None = None) -> dict[str, int]:
    """The numbers "auto" ZeRO bucket sizes resolve to for one role (the rule: :func:`resolve_bucket_sizes`)."""
    h = int(hidden_size or 0)
    reduce = max(DS_DEFAULT_BUCKETS["reduce_bucket_size"], h * h)
    prefetch = max(DS_DEFAULT_BUCKETS["stage3_prefetch_bucket_size"], int(0.9 * h * h))
    reduce_cap = trainable_params or num_params
    if reduce_cap:
        reduce = min(reduce, int(reduce_cap))
    if num_params:
        prefetch = min(prefetch, int(num_params))
    persistence = 10 * h if h else DS_DEFAULT_BUCKETS["stage3_param_persistence_threshold"]
    return {"reduce_bucket_size": reduce, "stage3_prefetch_bucket_size": prefetch,
            "stage3_param_persistence_threshold": persistence}


def resolve_batch_keys(role: str, config: dict[str, Any], dp_world_size: int) -> None:
    """Fill "auto" batch keys in place: train_batch_size = micro * accumulation * dp. Any two determine the third;
    a value that cannot be met is an error naming the keys, never a silent correction."""
    tbs = config.get("train_batch_size", AUTO)
    micro = config.get("train_micro_batch_size_per_gpu", AUTO)
    gas = config.get("gradient_accumulation_steps", AUTO)
    for key, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if value != AUTO and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"role '{role}': {key}={value!r} must be a positive integer or \"auto\".")
    if tbs == AUTO:
        micro = 1 if micro == AUTO else micro
        gas = 1 if gas == AUTO else gas
        tbs = micro * gas * dp_world_size
    elif micro == AUTO:
        gas = 1 if gas == AUTO else gas
        if tbs % (gas * dp_world_size):
            raise ConfigError(f"role '{role}': train_batch_size={tbs} is not divisible by gradient_accumulation_steps="
                              f"{gas} x data-parallel size {dp_world_size}; set train_batch_size to a multiple of "
                              f"{gas * dp_world_size} or give train_micro_batch_size_per_gpu.")
        micro = tbs // (gas * dp_world_size)
    elif gas == AUTO:
        if tbs % (micro * dp_world_size):
            raise ConfigError(f"role '{role}': train_batch_size={tbs} is not divisible by train_micro_batch_size_per_"
                              f"gpu={micro} x data-parallel size {dp_world_size}; set train_batch_size to a multiple "
                              f"of {micro * dp_world_size}.")
        gas = tbs // (micro * dp_world_size)
    elif tbs != micro * gas * dp_world_size:
        raise ConfigError(f"role '{role}': train_batch_size={tbs} != train_micro_batch_size_per_gpu={micro} x "
                          f"gradient_accumulation_steps={gas} x data-parallel size {dp_world_size} = "
                          f"{micro * gas * dp_world_size}; set train_batch_size to \"auto\" or fix one of the three.")
    config.update(train_batch_size=tbs, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)


def auto_overlap_comm(device_name: str | None = None) -> bool:
    """"auto" ``overlap_comm``: true where the accelerator has streams to overlap the reduction with the backward
    pass on (GPUs), false on DeepSpeed's CPU accelerator (measured no gain there)."""
    if device_name is None:
        try:
            from deepspeed.accelerator import get_accelerator
        except ImportError:  # torch backend: the key is never read
            return False
        device_name = get_accelerator().device_name()
    return device_name != "cpu"


def resolve_bucket_sizes(config: dict[str, Any], hidden_size: int | None, num_params: int | None = None,
                         trainable_params: int | None = None, device_name: str | None = None) -> None:
    """Fill "auto" ZeRO bucket sizes and ``overlap_comm`` in place for one role of width ``h``: reduce bucket 5e8 (h²
    if wider) capped at the trainable parameters, prefetch 5e7 (0.9 h² if wider) capped at the parameters,
    persistence threshold 10 h. Why: below DeepSpeed's billion-parameter defaults a step pays latency, not size; the
    caps keep small roles from allocating whole 5e8 buckets; a 1e4/1e5 persistence floor was no faster and left
    small roles unsharded (76% of a 32-wide text encoder per rank of 2 at 1e4, 51% at 10 h)."""
    zero = config.get("zero_optimization", {})
    for key, value in auto_bucket_sizes(hidden_size, num_params, trainable_params).items():
        if zero.get(key) == AUTO:
            zero[key] = value
    if zero.get("overlap_comm") == AUTO:
        zero["overlap_comm"] = auto_overlap_comm(device_name)
    for key, value in zero.items():
        if value == AUTO:
            raise ConfigError(f"zero_optimization.{key}=\"auto\" cannot be resolved; give a number.")


def find_auto(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value still set to "auto"."""
    found: list[str] = []
    if isinstance(config, dict):
        for key, value in config.items():
            path = f"{prefix}.{key}" if prefix else key
            if value == AUTO:
                found.append(path)
            elif isinstance(value, dict):
                found.extend(find_auto(value, path))
    return found

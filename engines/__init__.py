"""The engine registry: one DeepSpeed engine per model role, each with its own config.

The names below load on first use (torch with them; transformers, diffusers and peft only where a function needs
them), so what needs no torch starts fast: the typed settings (``settings``) and the recipe language built on them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it
_WHERE: dict[str, str] = {
    "CheckpointError": "checkpoint", "UnsafeCheckpointError": "checkpoint", "latest_tag": "checkpoint",
    "list_checkpoints": "checkpoint",
    "AUTO": "config", "ConfigError": "config", "eval_ds_config": "config", "load_ds_config": "config",
    "model_hidden_size": "config", "train_ds_config": "config",
    "DistEnv": "dist", "all_reduce_sum": "dist", "barrier": "dist", "global_moments": "dist",
    "mean_over_ranks": "dist", "read_env": "dist", "sum_over_ranks": "dist",
    "ema_decay": "ema", "ema_update": "ema",
    "atomic_dir": "export", "cast_folder": "export", "save_role": "export", "write_role": "export",
    "MemoryReport": "memory", "current_rss_bytes": "memory", "gather_memory": "memory", "peak_rss_bytes": "memory",
    "MetricsLogger": "metrics", "plot_curves": "metrics", "read_jsonl": "metrics", "setup_logging": "metrics",
    "write_summary": "metrics",
    "NonFiniteError": "nonfinite", "NonFiniteUpdate": "nonfinite",
    "build_optimizer": "optim",
    "local_tensors": "partition", "refresh_full_copies": "partition",
    "EngineRegistry": "registry", "JointLossError": "registry", "Role": "registry", "UnknownRoleError": "registry",
    "LoraSpec": "roles", "OptimSpec": "roles", "Placement": "roles", "RoleSpec": "roles", "apply_lora": "roles",
    "frozen_role": "roles",
    "is_lora": "roles", "set_gradient_checkpointing": "roles", "torch_dtype": "roles", "trainable_role": "roles",
    "set_trust_remote_code": "safe_io", "trust_remote_code": "safe_io",
    "ShardedBatches": "sampler", "ShardedEpochSampler": "sampler", "shard_batches": "sampler",
    "derive_seed": "seeding", "generator": "seeding", "seed_everything": "seeding",
    "zero_init_paused": "deepspeed_adapter",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:  # what static checkers and IDEs see
    from .checkpoint import CheckpointError, UnsafeCheckpointError, latest_tag, list_checkpoints
    from .config import AUTO, ConfigError, eval_ds_config, load_ds_config, model_hidden_size, train_ds_config
    from .deepspeed_adapter import zero_init_paused
    from .dist import DistEnv, all_reduce_sum, barrier, global_moments, mean_over_ranks, read_env, sum_over_ranks
    from .ema import ema_decay, ema_update
    from .export import atomic_dir, cast_folder, save_role, write_role
    from .memory import MemoryReport, current_rss_bytes, gather_memory, peak_rss_bytes
    from .metrics import MetricsLogger, plot_curves, read_jsonl, setup_logging, write_summary
    from .nonfinite import NonFiniteError, NonFiniteUpdate
    from .optim import build_optimizer
    from .partition import local_tensors, refresh_full_copies
    from .registry import EngineRegistry, JointLossError, Role, UnknownRoleError
    from .roles import (
        LoraSpec,
        OptimSpec,
        Placement,
        RoleSpec,
        apply_lora,
        frozen_role,
        is_lora,
        set_gradient_checkpointing,
        torch_dtype,
        trainable_role,
    )
    from .safe_io import set_trust_remote_code, trust_remote_code
    from .sampler import ShardedBatches, ShardedEpochSampler, shard_batches
    from .seeding import derive_seed, generator, seed_everything

__all__ = [
    "AUTO", "CheckpointError", "ConfigError", "DistEnv", "EngineRegistry", "JointLossError", "LoraSpec",
    "MemoryReport", "MetricsLogger", "NonFiniteError", "NonFiniteUpdate", "OptimSpec", "Placement", "Role",
    "RoleSpec", "ShardedBatches", "ShardedEpochSampler", "UnknownRoleError", "UnsafeCheckpointError",
    "all_reduce_sum", "apply_lora", "atomic_dir", "barrier", "build_optimizer", "cast_folder", "current_rss_bytes",
    "derive_seed", "ema_decay", "ema_update", "eval_ds_config", "frozen_role", "gather_memory", "generator",
    "global_moments", "is_lora", "latest_tag", "list_checkpoints", "load_ds_config", "local_tensors",
    "mean_over_ranks", "model_hidden_size", "peak_rss_bytes", "plot_curves", "read_env", "read_jsonl",
    "refresh_full_copies", "save_role", "seed_everything", "set_gradient_checkpointing", "set_trust_remote_code",
    "setup_logging", "shard_batches", "sum_over_ranks", "torch_dtype", "train_ds_config", "trainable_role",
    "trust_remote_code", "write_role", "write_summary", "zero_init_paused"
]

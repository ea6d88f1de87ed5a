"""The engine registry: one DeepSpeed engine per model role, each with its own config.

Imports only torch (and deepspeed, lazily where it is used); transformers, diffusers and peft
are imported where they are needed.
"""

from .checkpoint import CheckpointError, UnsafeCheckpointError, latest_tag, list_checkpoints
from .config import AUTO, ConfigError, eval_ds_config, load_ds_config, model_hidden_size, train_ds_config
from .dist import DistEnv, all_reduce_sum, barrier, global_moments, mean_over_ranks, read_env, sum_over_ranks
from .ema import ema_decay, ema_update
from .export import atomic_dir, cast_folder, save_role, write_role
from .memory import MemoryReport, current_rss_bytes, gather_memory, peak_rss_bytes
from .metrics import MetricsLogger, plot_curves, read_jsonl, setup_logging, write_summary
from .nonfinite import NonFiniteError, NonFiniteUpdate
from .optim import build_optimizer
from .partition import local_tensors, refresh_full_copies
from .registry import EngineRegistry, JointLossError, Role, RoleSpec, UnknownRoleError
from .roles import (
    LoraSpec,
    OptimSpec,
    Placement,
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
from .zero_scope import zero_init_paused

__all__ = [
    "AUTO",
    "CheckpointError",
    "ConfigError",
    "DistEnv",
    "EngineRegistry",
    "JointLossError",
    "LoraSpec",
    "MemoryReport",
    "MetricsLogger",
    "NonFiniteError",
    "NonFiniteUpdate",
    "OptimSpec",
    "Placement",
    "Role",
    "RoleSpec",
    "ShardedBatches",
    "ShardedEpochSampler",
    "UnknownRoleError",
    "UnsafeCheckpointError",
    "all_reduce_sum",
    "apply_lora",
    "atomic_dir",
    "barrier",
    "build_optimizer",
    "cast_folder",
    "current_rss_bytes",
    "derive_seed",
    "ema_decay",
    "ema_update",
    "eval_ds_config",
    "frozen_role",
    "gather_memory",
    "generator",
    "global_moments",
    "is_lora",
    "latest_tag",
    "list_checkpoints",
    "load_ds_config",
    "local_tensors",
    "mean_over_ranks",
    "model_hidden_size",
    "peak_rss_bytes",
    "plot_curves",
    "read_env",
    "read_jsonl",
    "refresh_full_copies",
    "save_role",
    "seed_everything",
    "set_gradient_checkpointing",
    "set_trust_remote_code",
    "setup_logging",
    "shard_batches",
    "sum_over_ranks",
    "torch_dtype",
    "train_ds_config",
    "trainable_role",
    "trust_remote_code",
    "write_role",
    "write_summary",
    "zero_init_paused",
]

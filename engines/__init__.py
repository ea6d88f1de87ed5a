"""The engine registry: one DeepSpeed engine per model role, each with its own config.

Imports only torch (and deepspeed, lazily where it is used); transformers, diffusers and peft
are imported where they are needed.
"""

from .checkpoint import CheckpointError, latest_tag, list_checkpoints
from .config import AUTO, ConfigError, eval_ds_config, load_ds_config, model_hidden_size, train_ds_config
from .dist import DistEnv, read_env
from .ema import ema_decay, ema_update
from .memory import MemoryReport, current_rss_bytes, peak_rss_bytes
from .registry import EngineRegistry, Role, RoleSpec, UnknownRoleError
from .zero_scope import zero_init_paused

__all__ = [
    "AUTO",
    "CheckpointError",
    "ConfigError",
    "DistEnv",
    "EngineRegistry",
    "MemoryReport",
    "Role",
    "RoleSpec",
    "UnknownRoleError",
    "current_rss_bytes",
    "ema_decay",
    "ema_update",
    "eval_ds_config",
    "latest_tag",
    "list_checkpoints",
    "load_ds_config",
    "model_hidden_size",
    "peak_rss_bytes",
    "read_env",
    "train_ds_config",
    "zero_init_paused",
]

"""What the RLHF recipes share beyond the engines: the embedded tiny assets, the built-in judge and loading on
rank 0 first (a role's tokenizer: pipelines.checks)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from multiengine.engines import EngineRegistry, barrier

from . import tiny

logger = logging.getLogger(__name__)

__all__ = ["builtin_judge", "on_rank0_first", "prepare_tiny_assets"]


def prepare_tiny_assets(root: str, registry: EngineRegistry, seed: int = 0,
                        size: tiny.TinySettings | None = None) -> dict[str, str]:
    """The embedded default under ``root``: built-in dataset (``root/data/{split}.jsonl``), word-level
    tokenizer and a random tiny OPT of ``size``. Rank 0 builds on first use, the others wait at a barrier."""
    paths = {"data": os.path.join(root, "data"), "tokenizer": os.path.join(root, "tokenizer"),
             "model": os.path.join(root, "model")}
    done = os.path.join(root, ".complete")
    if registry.is_main and not os.path.isfile(done):
        # 30k preference pairs: with the default 6k a tiny reward model memorises them and stays at ~75%
        # held-out accuracy, which PPO then exploits; 512 evaluation prompts: a judge mean over 256 sampled
        # answers has a standard error of ~0.02
        size = size or tiny.TinySettings()
        tiny.prepare_builtin(root, seed=seed, hidden=size.hidden, layers=size.layers, heads=size.heads, n_reward=30000,
                            n_eval=512)
        with open(done, "w") as f:
            f.write("ok\n")
    barrier()
    return paths


def builtin_judge(prompts: Sequence[str], enabled: bool = True) -> Callable[[str, str], float] | None:
    """The built-in task's programmatic judge when every prompt is one of its prompts, else None (a
    judge of a different task would score everything 0)."""
    if enabled and prompts and all(tiny.parse_prompt(p) is not None for p in prompts):
        return tiny.judge
    return None


def on_rank0_first(registry: EngineRegistry, load: Callable[[], Any]) -> Any:
    """``load()`` on rank 0, then on the others (rank 0 fills the datasets cache, the others read it instead
    of racing to write the same files). A failure on rank 0 fails every rank, never leaves them waiting."""
    import torch.distributed as dist

    if registry.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return load()
    error: BaseException | None = None
    result = None
    if registry.is_main:
        try:
            result = load()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        from multiengine.engines.settings import SettingsError

        raise SettingsError(f"rank 0 could not load the data: {box[0]}")
    return result if registry.is_main else load()

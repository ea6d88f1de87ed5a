"""Plumbing shared by the RLHF recipes (steps 1-3 and the all-in-one run): the embedded tiny
assets, datasets split across ranks, resumable batch streams, memory rows, summaries and the plot."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from multiengine.engines import EngineRegistry, peak_rss_bytes
from multiengine.engines.dist import barrier

from . import tiny
from .data import ShardedEpochSampler, load_rlhf_dataset

logger = logging.getLogger(__name__)

__all__ = [
    "BatchStream",
    "builtin_judge",
    "fixed_batches",
    "gather_memory",
    "load_split",
    "plot_curves",
    "prepare_tiny_assets",
    "resolve_tokenizer",
]


def prepare_tiny_assets(root: str, registry: EngineRegistry, seed: int = 0, hidden: int = 64,
                        layers: int = 2) -> dict[str, str]:
    """The embedded default under ``root``: built-in dataset (``root/data/{split}.jsonl``), word-level
    tokenizer and a random tiny OPT. Rank 0 builds on first use, the others wait at a barrier."""
    paths = {"data": os.path.join(root, "data"), "tokenizer": os.path.join(root, "tokenizer"),
             "model": os.path.join(root, "model")}
    done = os.path.join(root, ".complete")
    if registry.is_main and not os.path.isfile(done):
        # 30k preference pairs: with the default 6k a tiny reward model memorises them and stays at ~75%
        # held-out accuracy, which PPO then exploits; 512 evaluation prompts: a judge mean over 256 sampled
        # answers has a standard error of ~0.02
        tiny.prepare_builtin(root, seed=seed, hidden=hidden, layers=layers, n_reward=30000, n_eval=512)
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


def resolve_tokenizer(*candidates: str) -> Any:
    """``AutoTokenizer`` from the first folder that has one (exports carry their tokenizer)."""
    from transformers import AutoTokenizer

    for path in candidates:
        if path and os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            tok = AutoTokenizer.from_pretrained(path)
            if tok.pad_token_id is None:
                tok.pad_token = tok.eos_token  # decoder-only models often ship without a pad token
            return tok
    raise FileNotFoundError(f"no tokenizer in any of {[c for c in candidates if c]}")


def load_split(source: str, stage: str, registry: EngineRegistry, hf_split: str = "train") -> Any:
    """``load_rlhf_dataset`` with rank 0 first: it fills the datasets cache, the others then read it
    instead of racing to write the same files. ``hf_split`` applies to hub datasets only."""
    if os.path.exists(source):
        hf_split = "train"  # local json/jsonl/parquet files load as one "train" split
    if not registry.is_main:
        barrier()
    dataset = load_rlhf_dataset(source, stage, hf_split=hf_split)
    if registry.is_main:
        barrier()
    return dataset


class BatchStream:
    """Endless, resumable batches of this rank's shard: a :class:`ShardedEpochSampler` (equal shards,
    so every rank makes the same number of steps) feeding ``collate``. Its state is the sampler's."""

    def __init__(self, rows: Any, collate: Callable[[list[Any]], dict[str, Any]], batch_size: int,
                 registry: EngineRegistry, seed: int = 0, shuffle: bool = True) -> None:
        self.rows = rows
        self.collate = collate
        self.batch_size = batch_size
        self.sampler = ShardedEpochSampler(len(rows), registry.world_size, registry.rank, seed=seed, shuffle=shuffle)
        if len(self.sampler) < batch_size:
            raise ValueError(f"{len(rows)} rows give {len(self.sampler)} per rank, fewer than a batch of {batch_size}.")
        self._it: Iterator[int] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        index: list[int] = []
        while len(index) < self.batch_size:
            if self._it is None:
                self._it = iter(self.sampler)
            try:
                index.append(next(self._it))
            except StopIteration:
                self._it = None  # the next iter() moves the sampler to the next epoch
        return self.collate([self.rows[i] for i in index])

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._it = None


def fixed_batches(rows: Any, collate: Callable[[list[Any]], dict[str, Any]], batch_size: int,
                  registry: EngineRegistry, limit: int = 0) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all if 0), split evenly over ranks (the tail that does not divide is
    dropped so every rank runs the same forwards) and batched: a deterministic evaluation set."""
    n = len(rows) if not limit else min(limit, len(rows))
    per_rank = n // registry.world_size
    mine = list(range(registry.rank, per_rank * registry.world_size, registry.world_size))
    return [collate([rows[i] for i in mine[j:j + batch_size]]) for j in range(0, len(mine), batch_size)]


def gather_memory(registry: EngineRegistry) -> list[dict[str, Any]]:
    """Per rank: the registry's per-role memory rows and the process's peak RSS (collective)."""
    mine = {"rank": registry.rank, "roles": list(registry.memory_report()), "peak_rss_bytes": peak_rss_bytes()}
    if torch.cuda.is_available():
        mine["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if registry.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    out: list[Any] = [None] * registry.world_size
    torch.distributed.all_gather_object(out, mine)
    return out


def plot_curves(records: Sequence[dict[str, Any]], out_png: str, panels: Sequence[tuple[str, Sequence[str]]],
                title: str = "") -> str | None:
    """One panel per ``(ylabel, metric keys)`` against ``step``; returns the PNG path, or None (with a
    log line) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: skipping the plot %s (pip install matplotlib)", out_png)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (label, keys) in zip(axes[0], panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 15 else None, markersize=3, label=key)
        ax.set_xlabel("PPO step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png

"""What the RLHF recipes share beyond the engines: the embedded tiny assets, the built-in judge,
tokenizer resolution and dataset loading with rank 0 first."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from multiengine.engines import EngineRegistry, barrier

from . import tiny
from .data import load_rlhf_dataset

logger = logging.getLogger(__name__)

__all__ = ["builtin_judge", "load_split", "prepare_tiny_assets", "resolve_tokenizer"]


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

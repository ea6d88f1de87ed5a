"""RLHF data: loading DeepSpeed-Chat style datasets, collators for steps 1-3, the resumable sampler.

Schema (DeepSpeed-Chat): ``prompt`` and ``response`` for SFT (``chosen`` is accepted in place of
``response``, as DeepSpeed-Chat's step 1 does), ``prompt``/``chosen``/``rejected`` for the reward
model, ``prompt`` for PPO.

Token layout: every collator encodes the prompt the same way (the tokenizer's special tokens, e.g. a
leading BOS, then the prompt text, truncated from the left so the end of the prompt survives) and the
response without special tokens followed by EOS, so the reward model in step 2 sees exactly the token
sequences the actor produces in step 3.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# One resumable distributed sampler for every pipeline: the diffusion one (same contract: seed + epoch
# permutation, equal shard per rank, (epoch, position) state) is re-exported rather than duplicated.
from multiengine.engines.sampler import ShardedEpochSampler

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

__all__ = [
    "REQUIRED_COLUMNS",
    "PairCollator",
    "PromptCollator",
    "SFTCollator",
    "ShardedEpochSampler",
    "load_rlhf_dataset",
]

REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "response"),
    "reward": ("prompt", "chosen", "rejected"),
    "ppo": ("prompt",),
    "eval": ("prompt",),
}
_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _file_for_split(folder: Path, split: str) -> Path:
    for ext in _LOADERS:
        candidate = folder / f"{split}{ext}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"no {split}.json/.jsonl/.parquet in {folder} (write one with tiny.write_builtin_dataset)"
    )


def load_rlhf_dataset(source: str | Path, split: str, hf_split: str = "train") -> Dataset:
    """Load the rows of one RLHF stage as a ``datasets.Dataset`` and check its columns.

    Args:
        source: a ``.json``/``.jsonl``/``.parquet`` file (loader chosen by extension); a folder
            holding ``{split}.jsonl`` (or ``.json``/``.parquet``), as written by
            ``tiny.write_builtin_dataset``; or a hub dataset name (needs network or a local cache).
        split: the RLHF stage, one of ``sft``, ``reward``, ``ppo``, ``eval``; sets required columns.
        hf_split: the split of the loaded dataset to take (``train`` for local files).

    Raises:
        ValueError: unknown ``split``, unknown file extension, or missing columns (named).
    """
    from datasets import load_dataset

    if split not in REQUIRED_COLUMNS:
        raise ValueError(f"unknown RLHF split {split!r}; expected one of {sorted(REQUIRED_COLUMNS)}")
    path = Path(source)
    if path.is_dir():
        path = _file_for_split(path, split)
    if path.is_file():
        loader = _LOADERS.get(path.suffix.lower())
        if loader is None:
            raise ValueError(f"unsupported data file {path} (expected one of {sorted(_LOADERS)})")
        dataset = load_dataset(loader, data_files=str(path), split=hf_split)
    elif path.suffix.lower() in _LOADERS:
        raise FileNotFoundError(f"data file {path} does not exist")
    else:
        dataset = load_dataset(str(source), split=hf_split)

    columns = set(dataset.column_names)
    if split == "sft" and "response" not in columns and "chosen" in columns:
        dataset = dataset.rename_column("chosen", "response")  # DeepSpeed-Chat step 1 trains on chosen
        columns = set(dataset.column_names)
    missing = [c for c in REQUIRED_COLUMNS[split] if c not in columns]
    if missing:
        raise ValueError(
            f"dataset {source!s} ({split}) is missing column(s) {missing}; it has {sorted(columns)}. "
            f"The {split} stage needs {list(REQUIRED_COLUMNS[split])}."
        )
    logger.info("loaded %d %s rows from %s", len(dataset), split, source)
    return dataset


# --------------------------------------------------------------------------------------------------
# collators
# --------------------------------------------------------------------------------------------------


def _pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token")
    return int(pad)


def _field(example: Mapping[str, Any] | str, key: str) -> str:
    if isinstance(example, str):
        if key != "prompt":
            raise TypeError(f"a bare string example has no {key!r}")
        return example
    return example[key]


class _Encoder:
    """Shared prompt/response encoding, so SFT, reward and PPO see the same token layout."""

    def __init__(self, tokenizer: Any, max_prompt_len: int, max_response_len: int = 64) -> None:
        if max_prompt_len < 1 or max_response_len < 1:
            raise ValueError("max_prompt_len and max_response_len must be >= 1")
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.max_response_len = max_response_len
        self.pad_id = _pad_token_id(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos token; responses must end with one")
        self.eos_id = int(tokenizer.eos_token_id)

    def prompt_ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        if len(ids) <= self.max_prompt_len:
            return ids
        # keep the end (what the answer continues from) and a leading BOS the model was trained with.
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[0] == bos and self.max_prompt_len > 1:
            return [bos] + ids[-(self.max_prompt_len - 1) :]
        return ids[-self.max_prompt_len :]

    def response_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids[: self.max_response_len - 1]) + [self.eos_id]


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        if not row:
            continue
        if left:
            out[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        else:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


class PromptCollator(_Encoder):
    """Left-padded prompts for generation (step 3).

    Returns ``input_ids`` ``[B, C]``, ``attention_mask`` ``[B, C]`` (left padded, so every prompt ends
    at column ``C - 1`` and generation continues from there) and ``prompts`` (the texts, for judges).
    """

    def __init__(self, tokenizer: Any, max_prompt_len: int) -> None:
        super().__init__(tokenizer, max_prompt_len)

    def __call__(self, examples: Sequence[Mapping[str, Any] | str]) -> dict[str, Any]:
        texts = [_field(e, "prompt") for e in examples]
        ids = [self.prompt_ids(t) for t in texts]
        input_ids = _pad(ids, self.pad_id, left=True)
        attention_mask = _pad([[1] * len(r) for r in ids], 0, left=True)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": texts}


class SFTCollator(_Encoder):
    """``prompt + response + EOS``, right padded, for supervised fine-tuning (step 1).

    Returns ``input_ids``, ``attention_mask`` and ``labels``, each ``[B, L]``; ``labels`` is -100 on
    the prompt and the padding so only the response (and its EOS) is learned.
    """

    def __init__(self, tokenizer: Any, max_prompt_len: int, max_response_len: int = 64) -> None:
        super().__init__(tokenizer, max_prompt_len, max_response_len)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        seqs, labels = [], []
        for e in examples:
            p, r = self.prompt_ids(_field(e, "prompt")), self.response_ids(_field(e, "response"))
            seqs.append(p + r)
            labels.append([-100] * len(p) + r)
        return {
            "input_ids": _pad(seqs, self.pad_id, left=False),
            "attention_mask": _pad([[1] * len(s) for s in seqs], 0, left=False),
            "labels": _pad(labels, -100, left=False),
        }


class PairCollator(_Encoder):
    """Chosen and rejected sequences in one right-padded batch for the reward model (step 2).

    Returns ``input_ids`` and ``attention_mask`` ``[2B, L]``: rows ``0..B-1`` are
    ``prompt + chosen + EOS``, rows ``B..2B-1`` the matching ``prompt + rejected + EOS``; split the
    model's scores with ``scores[:B], scores[B:]``.
    """

    def __init__(self, tokenizer: Any, max_prompt_len: int, max_response_len: int = 64) -> None:
        super().__init__(tokenizer, max_prompt_len, max_response_len)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chosen, rejected = [], []
        for e in examples:
            p = self.prompt_ids(_field(e, "prompt"))
            chosen.append(p + self.response_ids(_field(e, "chosen")))
            rejected.append(p + self.response_ids(_field(e, "rejected")))
        seqs = chosen + rejected
        return {
            "input_ids": _pad(seqs, self.pad_id, left=False),
            "attention_mask": _pad([[1] * len(s) for s in seqs], 0, left=False),
        }

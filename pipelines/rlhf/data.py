"""RLHF data: formats, sources and collators of every stage, and the ``data`` sections of the RLHF recipes.

Formats (TRL's conventions), detected from the columns after the column mapping:

========================= =============================================== ======================
format                    columns                                         stages
========================= =============================================== ======================
language modelling        ``text``                                        sft
prompt-completion         ``prompt`` + ``response`` (or ``completion``)   sft (and ppo/eval)
preference                ``prompt`` + ``chosen`` + ``rejected``          reward, sft (chosen)
implicit preference       ``chosen`` + ``rejected`` (shared prompt prefix) reward
prompt-only               ``prompt``                                      ppo, eval
conversation              ``messages``                                    sft (ppo/eval: its prompt)
========================= =============================================== ======================

Each of ``prompt``/``response``/``chosen``/``rejected`` may be a string or a list of ``{"role", "content"}``
messages (conversational, rendered with the tokenizer's chat template: prompts with ``add_generation_prompt=True``;
SFT learns only the assistant tokens). Every collator encodes a prompt the same way (left-truncated, so its end
survives) and the response after it ending with EOS, so the reward model of step 2 sees exactly the token sequences
the actor produces in step 3.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

# One resumable distributed sampler for every pipeline (seed + epoch permutation, equal shard per rank).
from multiengine.engines.sampler import ShardedEpochSampler
from multiengine.engines.settings import Range, Satisfies, Settings, section, setting
from multiengine.pipelines.sources import (
    DataSource,
    DataSourceError,
    TrainEval,
    as_sources,
    load_source,
    map_columns,
    parse_eval_split,
    split_train_eval,
)

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

__all__ = ["FIELDS", "REQUIRED_COLUMNS", "Columns", "DataFormat", "DataSettings", "DataSource", "PairCollator",
           "PromptCollator", "PromptData", "ResponseData", "SFTCollator", "ShardedEpochSampler", "TrainEval",
           "chat_template_roles", "check_chat_roles", "check_chat_template", "check_rlhf_data", "detect_format",
           "is_conversation", "load_rlhf_data", "load_rlhf_dataset", "load_stage", "prompt_stream", "prompt_text",
           "training_batches"]

# the minimal columns of each stage's standard format
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "sft": ("prompt", "response"),
    "reward": ("prompt", "chosen", "rejected"),
    "ppo": ("prompt",),
    "eval": ("prompt",),
}
# every field a column can be mapped to (``completion`` is read as ``response``)
FIELDS: tuple[str, ...] = ("prompt", "response", "completion", "chosen", "rejected", "text", "messages")
_ACCEPTS: dict[str, str] = {
    "sft": "text | messages | prompt+response (or completion) | prompt+chosen",
    "reward": "prompt+chosen+rejected | chosen+rejected (the prompt is their shared beginning)",
    "ppo": "prompt | messages (the prompt is everything before the last assistant turn)",
    "eval": "prompt | messages (the prompt is everything before the last assistant turn)",
}
_EXAMPLE_MAPPING = {"sft": "prompt=question data.columns.response=answer",
                    "reward": "chosen=good data.columns.rejected=bad",
                    "ppo": "prompt=question", "eval": "prompt=question"}


# --- the data sections ---------------------------------------------------------------------------------------------
def _eval_split_ok(value: Any) -> bool:
    try:
        parse_eval_split(value)
    except DataSourceError:
        return False
    return True


@dataclass(frozen=True)
class Columns(Settings):
    """Your column names per field (``data.columns.<field>=<column>``); "" = a column named like the field."""

    prompt: str = setting("", "your column holding the prompt (\"\" = a column named prompt)")
    response: str = setting("", "... the response (completion is read as response)")
    completion: str = setting("", "... the completion")
    chosen: str = setting("", "... the preferred answer")
    rejected: str = setting("", "... the worse answer")
    text: str = setting("", "... plain text (language modelling)")
    messages: str = setting("", "... a conversation: a list of {role, content}")

    def mapping(self) -> dict[str, str]:
        """``{field: column}`` of the fields that are mapped."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name)}


@dataclass(frozen=True)
class DataSettings(Settings):
    """Where a stage's training and evaluation rows come from (docs/data.md)."""

    source: str = setting("", ".jsonl/.json/.csv/.parquet file, save_to_disk folder, split-files folder, hub name; "
                              "\"\" = built-in")
    sources: list[dict[str, Any]] = setting([], "several sources blended by weight, [{path, weight, columns, split}]; "
                                                "replaces data.source",
                                            Satisfies(lambda v: isinstance(v, (list, tuple)),
                                                      "a list of {path, weight, columns, split}"))
    columns: Columns = section(Columns, "your column names per field: data.columns.<field>=<column>")
    train_split: str = setting("train", "the split of a hub dataset / DatasetDict folder to train on")
    eval_source: str = setting("", "separate evaluation rows (the forms of data.source); never a training source")
    eval_split: str = setting("auto", "auto (the eval/test split, else 5% of rows held out) | none | 0.05 | 200 | a "
                                      "split name",
                              Satisfies(_eval_split_ok, "auto, none, a fraction in (0, 1), a row count >= 1 or a split "
                                                        "name"))

    @property
    def builtin(self) -> bool:
        """Neither ``source`` nor ``sources`` is set: the built-in task's data."""
        return not (self.source or self.sources)

    def train_source(self) -> Any:
        """``sources`` when set, else ``source``."""
        return list(self.sources) or self.source

    def overrides(self, source: str | None = None) -> list[str]:
        """``key=value`` overrides that give another recipe these data (``source``: the built-in data's folder)."""
        import json

        out = [f"data.source={self.source if source is None else source}"]
        if self.sources:
            out.append(f"data.sources={json.dumps(list(self.sources))}")
        out += [f"data.columns.{k}={v}" for k, v in self.columns.mapping().items()]
        return out + [f"data.{k}={getattr(self, k)}" for k in ("train_split", "eval_source", "eval_split")]


@dataclass(frozen=True)
class PromptData(DataSettings):
    max_prompt_len: int = setting(16, "prompt tokens kept (a longer prompt loses its beginning)", Range(1))


@dataclass(frozen=True)
class ResponseData(PromptData):
    """Rows with prompts and answers (demonstrations or preference pairs)."""

    max_response_len: int = setting(16, "response tokens kept, EOS included", Range(1))
    heldout_size: int = setting(128, "evaluation rows (pairs) scored for the held-out figures (0 = all of them)",
                                Range(0))


# --- formats -------------------------------------------------------------------------------------------------------
def is_conversation(value: Any) -> bool:
    """A list of ``{"role", "content"}`` messages (a conversational value)."""
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value))


@dataclass(frozen=True)
class DataFormat:
    """What a dataset's rows are: ``kind`` (``text``, ``messages``, ``prompt``, ``prompt_response``,
    ``preference``, ``implicit_preference``) and whether its values are conversations."""

    kind: str
    conversational: bool

    def __str__(self) -> str:
        return f"{self.kind} ({'conversational' if self.conversational else 'standard'})"


def detect_format(columns: Sequence[str], example: Mapping[str, Any] | None = None) -> DataFormat | None:
    """The format of rows with these columns (after the mapping), or None; ``example`` (one row) decides standard vs
    conversational (without it, only ``messages`` is conversational)."""
    cols = set(columns)
    has_response = "response" in cols or "completion" in cols
    if {"prompt", "chosen", "rejected"} <= cols:
        kind = "preference"
    elif {"chosen", "rejected"} <= cols:
        kind = "implicit_preference"
    elif "prompt" in cols and has_response:
        kind = "prompt_response"
    elif "messages" in cols:
        kind = "messages"
    elif "prompt" in cols:
        kind = "prompt"
    elif "text" in cols:
        kind = "text"
    else:
        return None
    conversational = kind == "messages"
    if example is not None and not conversational:
        conversational = any(is_conversation(example.get(k)) for k in ("prompt", "response", "completion", "chosen",
                                                                          "rejected") if k in cols)
    return DataFormat(kind, conversational)


def _common_prefix(a: Any, b: Any) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _split_implicit(row: Mapping[str, Any]) -> dict[str, Any]:
    """``chosen``/``rejected`` sharing their beginning -> ``prompt`` + the two different endings."""
    chosen, rejected = row["chosen"], row["rejected"]
    if is_conversation(chosen):
        n = _common_prefix(chosen, rejected)
        return {"prompt": list(chosen[:n]), "chosen": list(chosen[n:]), "rejected": list(rejected[n:])}
    n = _common_prefix(chosen, rejected)
    if 0 < n < len(chosen) and chosen[n - 1] == " ":
        n -= 1  # the space belongs to the answer, as a tokenizer would split it
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _prompt_of_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Everything before the last assistant turn (the whole list when there is none)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    return [dict(m) for m in messages[:last]]


def _normalise(ds: Dataset, stage: str, source: str, key: str) -> Dataset:
    """Rows of ``ds`` in the canonical fields of ``stage`` (``completion`` -> ``response``, implicit
    prompts made explicit, ...); other columns are kept."""
    if len(ds) == 0:
        raise DataSourceError(f"{key}={source!r} has no rows ({stage} stage)")
    columns = set(ds.column_names)
    if "completion" in columns and "response" not in columns:
        ds = ds.rename_column("completion", "response")
        columns = set(ds.column_names)
    if stage == "sft":
        ok = ({"prompt", "response"} <= columns or {"prompt", "chosen"} <= columns
              or "messages" in columns or "text" in columns)
    elif stage == "reward":
        ok = {"chosen", "rejected"} <= columns
    else:
        ok = "prompt" in columns or "messages" in columns
    if not ok:
        missing = [c for c in REQUIRED_COLUMNS[stage] if c not in columns]
        raise DataSourceError(
            f"{key}={source!r} ({stage} stage) has columns {sorted(columns)}: missing {missing} for "
            f"{'+'.join(REQUIRED_COLUMNS[stage])}, and no other {stage} format fits ({_ACCEPTS[stage]}). Map your "
            f"columns, e.g. data.columns.{_EXAMPLE_MAPPING[stage]}")
    if stage == "sft" and "response" not in columns and {"prompt", "chosen"} <= columns:
        ds = ds.rename_column("chosen", "response")  # DeepSpeed-Chat step 1 trains on chosen
    if stage == "reward" and "prompt" not in columns:
        ds = ds.map(_split_implicit, desc="prompt from the shared beginning of chosen/rejected")
    if stage in ("ppo", "eval") and "prompt" not in columns:
        ds = ds.map(lambda r: {"prompt": _prompt_of_messages(r["messages"])}, desc="prompts of conversations")
    return ds


# --- loading -------------------------------------------------------------------------------------------------------
def _load_one(source: DataSource, stage: str, split: str | None, default_split: str, key: str,
              columns: Mapping[str, str] | None, cache_dir: str | None) -> Dataset:
    wanted = split or source.split or default_split
    names = (split,) if split else (stage, wanted)
    ds = load_source(source.path, names=names, split=wanted, key=key, split_required=split is not None,
                     cache_dir=cache_dir)
    mapping = {**(columns or {}), **dict(source.columns)}
    ds = map_columns(ds, mapping, FIELDS, source.path, key="data.columns")
    return _normalise(ds, stage, source.path, key)


def load_rlhf_dataset(source: str | Path, split: str, hf_split: str = "train", columns: Mapping[str, str] | None = None,
                      cache_dir: str | None = None, key: str = "data.source") -> Dataset:
    """The format-checked rows of one stage (``split``: sft, reward, ppo or eval) from one source: a data file, a
    ``save_to_disk`` folder, a folder of split files (``{split}.jsonl``, or ``{hf_split}.*``) or a hub dataset
    (``hf_split`` of it), with the ``{field: column}`` mapping ``columns``; errors name ``key`` and the fix."""
    if split not in REQUIRED_COLUMNS:
        raise ValueError(f"unknown RLHF split {split!r}; expected one of {sorted(REQUIRED_COLUMNS)}")
    ds = _load_one(DataSource(str(source)), split, None, hf_split, key, columns, cache_dir)
    logger.info("loaded %d %s rows (%s) from %s", len(ds), split, detect_format(ds.column_names, ds[0]), source)
    return ds


def _canonical(ds: Dataset, stage: str) -> Dataset:
    keep = {"sft": ("prompt", "response", "messages", "text"), "reward": ("prompt", "chosen", "rejected"),
            "ppo": ("prompt",), "eval": ("prompt",)}[stage]
    return ds.select_columns([c for c in ds.column_names if c in keep])


def _settings(data: Any) -> DataSettings:
    """A data section, or a path (list of sources) as the data section of that source alone."""
    if isinstance(data, DataSettings):
        return data
    return DataSettings(sources=list(data)) if isinstance(data, (list, tuple)) else DataSettings(source=str(data))


def load_rlhf_data(data: DataSettings | str, stage: str, *, seed: int = 0, eval_stage: str | None = None,
                   source: Any = None, evaluate: bool = True, size: int | None = None) -> TrainEval:
    """Training and evaluation rows of one ``stage`` (sft, reward, ppo) from a data section (or one path): its
    source or weighted blend of sources, column mapping, ``train_split``, evaluation rows from ``eval_source`` or
    ``eval_split`` (:func:`~multiengine.pipelines.sources.split_train_eval`) in the formats of ``eval_stage``
    (default ``stage``; ``eval`` for prompt-only rows); ``seed``: held-out selection and blend order. ``source``
    replaces the training source (PPO's pretraining rows); ``evaluate=False``: training rows only. A blend has ``size``
    rows (default: the sources' together) and keeps only the stage's fields."""
    if stage not in REQUIRED_COLUMNS:
        raise ValueError(f"unknown RLHF stage {stage!r}; expected one of {sorted(REQUIRED_COLUMNS)}")
    data = _settings(data)
    eval_stage = eval_stage or stage
    source = source or data.train_source()
    sources = as_sources(source, "data.sources" if isinstance(source, (list, tuple)) else "data.source")
    several = len(sources) > 1
    key, columns, split = "data.sources" if several else "data.source", data.columns.mapping(), data.train_split

    def load(src: DataSource, name: str | None) -> Dataset:
        this_stage = stage if name is None else eval_stage
        ds = _load_one(src, this_stage, name, split, key, columns, None)
        return _canonical(ds, this_stage) if several else ds

    def load_eval(src: DataSource, name: str | None) -> Dataset:
        return _load_one(src, eval_stage, None, split, "data.eval_source", columns, None)

    result = split_train_eval(load, sources, eval_source=as_sources(data.eval_source, "data.eval_source"),
                              load_eval=load_eval, eval_split=parse_eval_split(data.eval_split), seed=seed,
                              size=size, source_key=key, evaluate=evaluate)
    logger.info("%s rows: %d for training (%s); evaluation: %s%s", stage, len(result.train),
                " + ".join(f"{s.path} x{s.weight:g}" for s in sources), result.eval_origin,
                f" ({len(result.eval)} rows)" if result.eval is not None else "")
    return result


# --- up-front checks (no model is built) ------------------------------------------------------------------------------
def check_chat_template(tokenizer: Any, conversational: bool, key: str = "data.source",
                        tokenizer_key: str = "roles.actor.model") -> None:
    """Raise when conversational data meets a tokenizer without a chat template."""
    if conversational and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataSourceError(
            f"{key} is conversational (lists of {{role, content}} messages) but the tokenizer of {tokenizer_key} "
            f"({name}) has no chat template. Give the tokenizer one (set tokenizer.chat_template and save_pretrained "
            f"it into the model folder), use a chat model's tokenizer, or use standard (string) data.")


# roles tried when saying which ones a chat template takes
COMMON_CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")
_ROLE_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unknown_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return sum(i == tokenizer.unk_token_id for i in ids)


def _takes_role(tokenizer: Any, role: str) -> bool:
    """Whether the chat template renders a message of ``role`` (alone, or after a user turn, for templates that
    want one first) without raising, and without more unknown tokens than a user message in its place: a
    template that pastes the role's name into its markup turns a role the vocabulary lacks into ``<unk>``."""
    for before in ([], [{"role": "user", "content": ""}]):
        try:
            unknown = _unknown_tokens(tokenizer, [*before, {"role": role, "content": ""}])
        except Exception:  # any template error (e.g. raise_exception('roles must alternate')) refuses this shape
            continue
        if tokenizer.unk_token_id is None:
            return True
        try:
            return unknown <= _unknown_tokens(tokenizer, [*before, {"role": "user", "content": ""}])
        except Exception:
            return unknown == 0
    return False


def chat_template_roles(tokenizer: Any, roles: Sequence[str] = COMMON_CHAT_ROLES) -> dict[str, bool]:
    """``{role: whether the tokenizer's chat template takes it}`` (see :func:`_takes_role`), remembered per
    tokenizer and template."""
    template = str(getattr(tokenizer, "chat_template", None))
    try:
        verdicts = _ROLE_VERDICTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no memory
        verdicts = {}
    out = {}
    for role in roles:
        if (template, role) not in verdicts:
            verdicts[(template, role)] = _takes_role(tokenizer, role)
        out[role] = verdicts[(template, role)]
    return out


def check_chat_roles(tokenizer: Any, roles: Sequence[str], key: str = "data.source",
                     tokenizer_key: str = "roles.actor.model", where: str = "") -> None:
    """Raise when a message role is one the tokenizer's chat template does not take (with a template that
    pastes role names into its markup it would be trained on as ``<unk>`` tokens), naming the roles it takes.
    ``where``: which row, for the message."""
    roles = sorted({str(r) for r in roles})
    verdicts = chat_template_roles(tokenizer, [*COMMON_CHAT_ROLES, *[r for r in roles if r not in COMMON_CHAT_ROLES]])
    refused = [r for r in roles if not verdicts[r]]
    if not refused:
        return
    taken = [r for r in COMMON_CHAT_ROLES if verdicts[r]]
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    which = "role " + repr(refused[0]) if len(refused) == 1 else "roles " + ", ".join(map(repr, refused))
    raise DataSourceError(
        f"{key}: chat messages{where} have {which}, which the chat template of {tokenizer_key} ({name}) does not "
        f"take (it takes {', '.join(taken) or 'none of ' + ', '.join(COMMON_CHAT_ROLES)}); rename those messages' "
        f"role to one it takes, or use a tokenizer whose chat template has {which}")


def _conversation_columns(ds: Dataset) -> list[str]:
    example = ds[0]
    return [c for c in ds.column_names if is_conversation(example[c])]


def _message_roles(ds: Dataset) -> set[str]:
    """Every role of the conversational columns of ``ds`` (read from the Arrow table: no Python row objects)."""
    import pyarrow.compute as pc

    roles: set[str] = set()
    for column in _conversation_columns(ds):
        try:
            flat = pc.list_flatten(ds.data.column(column))
            roles.update(str(r) for r in pc.unique(pc.struct_field(flat, "role")).to_pylist() if r is not None)
        except Exception:  # a column Arrow does not hold as list<struct<role, ...>>: row by row
            roles.update(str(m["role"]) for messages in ds[column] for m in messages or ())
    return roles


def _first_row(ds: Dataset, role: str) -> int:
    """The first row (from 0) with a message of ``role``."""
    for column in _conversation_columns(ds):
        for i, messages in enumerate(ds[column]):
            if any(str(m["role"]) == role for m in messages or ()):
                return i
    return 0


def check_rlhf_data(data: DataSettings | str, stage: str, tokenizer: Any = None, *, source: Any = None,
                    key: str | None = None, tokenizer_key: str = "roles.actor.model") -> dict[str, Any]:
    """Every source of one stage (``source``, else the data section's training sources), before any rank starts: it
    exists, its columns (after mapping) form an accepted format, it has rows, and conversational rows meet a
    tokenizer with a chat template taking their roles. Returns ``{"rows", "sources": [{"path", "rows", "format"}],
    "conversational"}``; raises ``DataSourceError`` naming ``key``, the file and the fix."""
    if stage not in REQUIRED_COLUMNS:
        raise ValueError(f"unknown RLHF stage {stage!r}; expected one of {sorted(REQUIRED_COLUMNS)}")
    data = _settings(data)
    source = source or data.train_source()
    key = key or ("data.sources" if isinstance(source, (list, tuple)) else "data.source")
    sources = as_sources(source, key)
    if not sources:
        raise DataSourceError(f"{key} is empty: give a data file, folder or hub dataset name")
    report = []
    for src in sources:
        ds = _load_one(src, stage, None, data.train_split, key, data.columns.mapping(), None)
        fmt = detect_format(ds.column_names, ds[0])
        report.append({"path": src.path, "rows": len(ds), "format": str(fmt), "conversational": fmt.conversational})
        if fmt.conversational and tokenizer is not None and getattr(tokenizer, "chat_template", None):
            refused = [r for r, ok in chat_template_roles(tokenizer, sorted(_message_roles(ds))).items() if not ok]
            if refused:
                check_chat_roles(tokenizer, refused, key, tokenizer_key,
                                 where=f" of {src.path} (row {_first_row(ds, refused[0]) + 1})")
    kinds = {r["conversational"] for r in report}
    if len(kinds) > 1:
        raise DataSourceError(f"{key}: some sources are conversational and some standard ({report}); a blend must "
                              f"be all one or the other")
    conversational = kinds.pop()
    if tokenizer is not None:
        check_chat_template(tokenizer, conversational, key, tokenizer_key)
    return {"rows": sum(r["rows"] for r in report), "sources": report, "conversational": conversational}


# --- collators -----------------------------------------------------------------------------------------------------
def _pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("tokenizer has neither a pad nor an eos token")
    return int(pad)


def _field(example: Mapping[str, Any] | str, key: str) -> Any:
    if isinstance(example, str):
        if key != "prompt":
            raise TypeError(f"a bare string example has no {key!r}")
        return example
    if key == "prompt" and "prompt" not in example and "messages" in example:
        return _prompt_of_messages(example["messages"])
    if key == "response" and "response" not in example and "completion" in example:
        return example["completion"]
    return example[key]


def prompt_text(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """A prompt as text for judges and logs: the string itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return str(users[-1] if users else prompt[-1]["content"]) if prompt else ""


def _as_messages(value: Any, role: str = "assistant") -> list[dict[str, Any]]:
    if is_conversation(value):
        return [dict(m) for m in value]
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    raise TypeError(f"expected a string or a list of {{role, content}} messages, got {type(value).__name__}")


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

    # --- standard (string) rows ------------------------------------------------------------------
    def _kept(self, ids: Sequence[int]) -> list[int]:
        """Positions of a prompt that survive truncation: the end (what the answer continues from) and a
        leading BOS the model was trained with."""
        n, cap = len(ids), self.max_prompt_len
        if n <= cap:
            return list(range(n))
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids[0] == bos and cap > 1:
            return [0, *range(n - cap + 1, n)]
        return list(range(n - cap, n))

    def _truncate_prompt(self, ids: list[int]) -> list[int]:
        return [ids[k] for k in self._kept(ids)]

    def prompt_ids(self, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
        """A prompt's ids: a string with the tokenizer's special tokens, a conversation rendered by the chat
        template with the generation prompt; truncated from the left."""
        if is_conversation(prompt):
            return self._truncate_prompt(self._ids(self.render(prompt, add_generation_prompt=True)))
        return self._truncate_prompt(list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"]))

    def response_ids(self, text: str, eos: bool = True) -> list[int]:
        """A string response: its ids without special tokens, truncated, then EOS (``eos=False``: a response
        that was cut off before its EOS)."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not eos:
            return list(ids[: self.max_response_len])
        return list(ids[: self.max_response_len - 1]) + [self.eos_id]

    # --- conversations ---------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        # a rendered template carries its own special tokens (e.g. BOS): none are added
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        check_chat_template(self.tokenizer, True, key="the data")
        check_chat_roles(self.tokenizer, [m["role"] for m in messages], key="the data", tokenizer_key="the collator")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _prefix(self, messages: Sequence[Mapping[str, Any]], cut: int, full: str, add_generation_prompt: bool) -> int:
        """Length of the rendering of ``messages[:cut]`` inside ``full`` (the rendering of all of them)."""
        head = self.render(messages[:cut], add_generation_prompt=add_generation_prompt) if cut else ""
        if not full.startswith(head):
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name_or_path', 'the tokenizer')} does not render the "
                f"start of a conversation as a prefix of the whole conversation, so the assistant tokens cannot be "
                f"located (start ...{head[-60:]!r}, whole ...{full[max(0, len(head) - 60):len(head) + 20]!r})")
        return len(head)

    def _end_response(self, ids: list[int], eos: bool = True) -> list[int]:
        """A rendered assistant turn as a response: cut after its last EOS (what generation stops on) or given
        one, truncated to ``max_response_len`` like a string response."""
        if self.eos_id in ids:
            ids = ids[: len(ids) - ids[::-1].index(self.eos_id) - 1]  # drop from the last EOS on
        if not eos:
            return ids[: self.max_response_len]
        return ids[: self.max_response_len - 1] + [self.eos_id]

    def conversation_ids(self, prompt: Any, completion: Any, eos: bool = True) -> tuple[list[int], list[int]]:
        """``(prompt ids, response ids)`` of a conversational prompt and its assistant completion (a string or
        messages): the prompt rendered with the generation prompt, the response the rest of the rendered
        conversation."""
        prompt_msgs = _as_messages(prompt, role="user")
        messages = prompt_msgs + _as_messages(completion)
        full = self.render(messages, add_generation_prompt=False)
        start = self._prefix(messages, len(prompt_msgs), full, add_generation_prompt=True)
        return self._truncate_prompt(self._ids(full[:start])), self._end_response(self._ids(full[start:]), eos)

    def messages_ids(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[int], list[int]]:
        """A whole conversation for SFT: ``(prompt ids, prompt labels, response ids)``, the prompt everything before
        the last assistant turn with its earlier assistant turns labelled (the rest -100). Each piece of the rendering
        is tokenized on its own, so the labelled spans are exactly the assistant turns."""
        messages = [dict(m) for m in messages]
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise ValueError(f"a conversation for SFT has no assistant message: {messages[:3]}")
        last = assistant[-1]
        messages = messages[: last + 1]  # anything after the last assistant turn teaches nothing
        full = self.render(messages, add_generation_prompt=False)
        spans = [(self._prefix(messages, i, full, True),
                  self._prefix(messages, i + 1, full, False) if i < last else len(full)) for i in assistant]
        ids: list[int] = []
        labels: list[int] = []
        pos = 0
        for start, end in spans[:-1]:
            plain, turn = self._ids(full[pos:start]), self._ids(full[start:end])
            ids += plain + turn
            labels += [-100] * len(plain) + turn
            pos = end
        plain = self._ids(full[pos:spans[-1][0]])
        ids += plain
        labels += [-100] * len(plain)
        keep = self._kept(ids)
        ids, labels = [ids[k] for k in keep], [labels[k] for k in keep]
        return ids, labels, self._end_response(self._ids(full[spans[-1][0]:]))

    def sft_ids(self, example: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """``(input ids, labels)`` of one SFT row in any accepted format."""
        if "messages" in example and example.get("prompt") is None:
            p, p_labels, r = self.messages_ids(example["messages"])
            return p + r, p_labels + r
        if "text" in example and example.get("response") is None and example.get("prompt") is None:
            p, r = self.prompt_ids(""), self.response_ids(example["text"])
        else:
            prompt, response = _field(example, "prompt"), _field(example, "response")
            if is_conversation(prompt) or is_conversation(response):
                p, r = self.conversation_ids(prompt, response)
            else:
                p, r = self.prompt_ids(prompt), self.response_ids(response)
        return p + r, [-100] * len(p) + r

    def pair_ids(self, prompt: Any, response: Any, eos: bool = True) -> list[int]:
        """``prompt + response`` ids for scoring (standard or conversational)."""
        if is_conversation(prompt) or is_conversation(response):
            p, r = self.conversation_ids(prompt, response, eos)
        else:
            p, r = self.prompt_ids(prompt), self.response_ids(response, eos)
        return p + r


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
    """Left-padded prompts for generation (step 3): ``input_ids`` and ``attention_mask`` ``[B, C]`` (every prompt ends
    at column ``C - 1``), ``prompts`` (texts for judges: a conversation's last user message), for conversations
    ``prompt_messages`` (to re-render them for a role with another tokenizer), and ``columns`` ``{name: [a value per
    row]}`` of the rows' other columns (reward functions get them as keyword arguments)."""

    def __init__(self, tokenizer: Any, max_prompt_len: int) -> None:
        super().__init__(tokenizer, max_prompt_len)

    def __call__(self, examples: Sequence[Mapping[str, Any] | str]) -> dict[str, Any]:
        prompts = [_field(e, "prompt") for e in examples]
        ids = [self.prompt_ids(p) for p in prompts]
        input_ids = _pad(ids, self.pad_id, left=True)
        attention_mask = _pad([[1] * len(r) for r in ids], 0, left=True)
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": [prompt_text(p) for p in prompts]}
        if any(is_conversation(p) for p in prompts):
            out["prompt_messages"] = [_as_messages(p, role="user") for p in prompts]
        names = list(dict.fromkeys(k for e in examples if isinstance(e, Mapping) for k in e if k != "prompt"))
        if names:
            out["columns"] = {k: [e.get(k) if isinstance(e, Mapping) else None for e in examples] for k in names}
        return out


class SFTCollator(_Encoder):
    """SFT rows, right padded (step 1): ``prompt + response + EOS`` (``text`` rows: all learned; conversations: the
    chat template's rendering, assistant tokens learned); ``input_ids``, ``attention_mask`` and ``labels`` ``[B, L]``,
    ``labels`` -100 where nothing is learned."""

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        seqs, labels = [], []
        for e in examples:
            ids, lab = self.sft_ids(e)
            seqs.append(ids)
            labels.append(lab)
        return {"input_ids": _pad(seqs, self.pad_id, left=False),
                "attention_mask": _pad([[1] * len(s) for s in seqs], 0, left=False),
                "labels": _pad(labels, -100, left=False)}


class PairCollator(_Encoder):
    """Preference pairs in one right-padded batch (step 2): ``input_ids`` and ``attention_mask`` ``[2B, L]``, rows
    ``0..B-1`` ``prompt + chosen + EOS``, rows ``B..2B-1`` ``prompt + rejected + EOS`` (scores split ``[:B], [B:]``)."""

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        chosen, rejected = [], []
        for e in examples:
            prompt = _field(e, "prompt")
            chosen.append(self.pair_ids(prompt, _field(e, "chosen")))
            rejected.append(self.pair_ids(prompt, _field(e, "rejected")))
        seqs = chosen + rejected
        return {
            "input_ids": _pad(seqs, self.pad_id, left=False),
            "attention_mask": _pad([[1] * len(s) for s in seqs], 0, left=False),
        }


def load_stage(registry: Any, data: DataSettings, seed: int, stage: str, assets: Mapping[str, str], *,
               eval_stage: str | None = None, source: Any = None, evaluate: bool = True) -> TrainEval:
    """The training and evaluation rows of one stage from ``data`` (the built-in data of ``assets`` when it names
    none; ``source``: another training source), loaded on rank 0 first."""
    from .runs import on_rank0_first

    source = source or data.train_source() or assets.get("data", "")
    return on_rank0_first(registry, lambda: load_rlhf_data(data, stage, seed=seed, eval_stage=eval_stage,
                                                           source=source, evaluate=evaluate))


def training_batches(registry: Any, data: DataSettings, seed: int, rows: TrainEval, collate: Any,
                     batch_size: int) -> tuple[Any, list[Any]]:
    """The training rows as a checkpointed stream of ``batch_size`` rows (registry state ``batches``), and the
    held-out batches of at most ``data.heldout_size`` evaluation rows (0 = all), never trained on."""
    from multiengine.engines import ShardedBatches, shard_batches

    w, rank = registry.world_size, registry.rank
    batches = registry.add_state("batches", ShardedBatches(rows.train, collate, batch_size, w, rank, seed=seed))
    heldout = [] if rows.eval is None else shard_batches(rows.eval, collate, batch_size, w, rank,
                                                         limit=data.heldout_size)
    return batches, heldout


def prompt_stream(registry: Any, data: DataSettings, seed: int, rows: TrainEval, tokenizer: Any,
                  batch_size: int) -> tuple[Any, bool, dict[str, Any]]:
    """The training prompts as a checkpointed stream (registry state ``prompts``), whether they are conversations,
    and the columns of the training and evaluation rows (what reward functions may read)."""
    from multiengine.engines import ShardedBatches

    collate = PromptCollator(tokenizer, data.max_prompt_len)
    prompts = registry.add_state("prompts", ShardedBatches(rows.train, collate, batch_size, registry.world_size,
                                                           registry.rank, seed=seed))
    columns = {"train": rows.train.column_names, "eval": rows.eval.column_names if rows.eval is not None else None}
    return prompts, "prompt_messages" in collate([rows.train[0]]), columns

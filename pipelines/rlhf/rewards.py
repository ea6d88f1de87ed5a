"""Where a rollout's scalar reward comes from: reward-model roles and/or Python reward functions, summed with
weights; and a running normaliser of the combined score.

A reward function is written as for TRL's GRPOTrainer, ``fn(prompts, completions, **kwargs) -> list[float]``: called
once per batch with the rows' prompt texts (a conversation's last user message), ``completions`` (the answers up to
the first EOS, decoded without special tokens; also ``responses``), ``completion_ids`` and every other column of the
rows as a keyword argument (e.g. ``answer=[...]``), one value per row after the ``n_samples_per_prompt`` repetition.
It returns one float per row, or None where it does not apply (0 in the sum, left out of its mean). A function
without ``**kwargs`` gets only what it names; one naming none of these gets ``(prompts, completions)`` by position.
It is named by a spec: ``package.module:function``, ``/path/to/file.py:function`` (your code: it runs) or
``builtin:judge`` (the built-in task's judge). Functions run on every rank over its rows; a reward-model role runs
one forward per rollout on every rank (collective under ZeRO-3) and, with its own tokenizer, scores the actor's text
re-encoded (:class:`~multiengine.pipelines.rlhf.retokenize.Retokenizer`), never the actor's ids.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import ConfigError, EngineRegistry, all_reduce_sum

from . import tiny
from .scoring import scoring_mode, sequence_scores

__all__ = ["BUILTIN_REWARD_FUNCTIONS", "RESERVED_ARGUMENTS", "RESERVED_NAMES", "RewardCall", "RewardFn",
           "RewardFunctionError", "RewardSource", "RunningMoments", "call_reward_function", "check_reward_columns",
           "check_sources", "compute_scores", "judge_reward", "load_reward_function", "reencoded", "reward_function",
           "reward_model"]

RewardFn = Callable[..., Sequence[float | None]]

# the arguments every reward function may take besides the rows' columns (a column of the same name is refused)
RESERVED_ARGUMENTS = ("prompts", "completions", "responses", "completion_ids")
# metric names under reward/ that a source's name must not take
RESERVED_NAMES = ("mean", "std", "group_std", "flat_groups", "total_mean")


def judge_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The built-in word-listing task's judge (``tiny.judge``) as a batched reward function, in [0, 1]."""
    return [tiny.judge(p, r) for p, r in zip(prompts, responses)]


BUILTIN_REWARD_FUNCTIONS: dict[str, RewardFn] = {"judge": judge_reward}


def load_reward_function(spec: str) -> RewardFn:
    """The callable of a reward-function spec (module docstring); ValueError naming the spec and the fix."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward function {spec!r}: expected 'package.module:function', "
                         "'/path/to/file.py:function' or 'builtin:<name>'.")
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"reward function {spec!r}: both the module (or file) and the function name are needed.")
    if target == "builtin":
        if name not in BUILTIN_REWARD_FUNCTIONS:
            raise ValueError(f"reward function {spec!r}: no built-in {name!r}; "
                             f"available: {sorted(BUILTIN_REWARD_FUNCTIONS)}.")
        return BUILTIN_REWARD_FUNCTIONS[name]
    if target.endswith(".py") or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise ValueError(f"reward function {spec!r}: file {path} does not exist.")
        module_name = "multiengine_reward_" + os.path.splitext(os.path.basename(path))[0]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"reward function {spec!r}: {path} cannot be loaded as a Python module.")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"reward function {spec!r}: cannot import {target!r} ({exc}); "
                             "is it on PYTHONPATH, or did you mean a file path ending in .py?") from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k in vars(module) if not k.startswith("_") and callable(getattr(module, k)))
        raise ValueError(f"reward function {spec!r}: {target} has no {name!r}; callables there: {public[:12]}.")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {name!r} is a {type(fn).__name__}, not a function.")
    return fn


class RewardFunctionError(ConfigError):
    """A reward function that raised, or returned something other than one float (or None) per row: the
    user's code, named in the message; the run stops with one error line (exit 2), not a crash report."""

    fix = ("fix the reward function (it runs on every rank over that rank's rows; each rank's traceback is in "
           "output_dir/logs)")


@dataclass(frozen=True)
class RewardCall:
    """How a reward function is called, read once from its signature: ``positional`` (``(prompts, completions)`` by
    position: it names none of :data:`RESERVED_ARGUMENTS`), ``names`` (passed by name when offered), ``required``
    (those without a default) and ``var_keyword`` (it takes ``**kwargs``: the texts, ids and every column)."""

    positional: bool
    names: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    var_keyword: bool = False

    @classmethod
    def of(cls, fn: Callable[..., Any], label: str = "") -> RewardCall:
        """Read ``fn``'s signature. Raises ``ValueError`` (naming ``label``) when it cannot take the rows."""
        label = label or getattr(fn, "__name__", repr(fn))
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or C callable without a signature: the old positional call
            return cls(positional=True)
        P = inspect.Parameter
        params = list(sig.parameters.values())
        var_keyword = any(p.kind is P.VAR_KEYWORD for p in params)
        by_name = [p for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
        keyword_style = var_keyword or any(p.name in RESERVED_ARGUMENTS for p in by_name)
        if keyword_style:
            stuck = [p.name for p in params if p.kind is P.POSITIONAL_ONLY and p.default is P.empty]
            if stuck:
                raise ValueError(f"reward function {label!r}{sig}: positional-only parameters {stuck} cannot be "
                                 "passed by name; write it as fn(prompts, completions, **kwargs).")
            named = by_name
        else:
            leading = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)][:2]
            if len(leading) < 2 and not any(p.kind is P.VAR_POSITIONAL for p in params):
                raise ValueError(f"reward function {label!r}{sig} cannot take the rows: write it as "
                                 "fn(prompts, completions, **kwargs) -> list[float] (extra dataset columns arrive "
                                 "as keyword arguments, e.g. answer=[...]).")
            named = [p for p in by_name if p not in leading]
            stuck = [p.name for p in params if p.kind is P.POSITIONAL_ONLY and p not in leading
                     and p.default is P.empty]
            if stuck:
                raise ValueError(f"reward function {label!r}{sig}: positional-only parameters {stuck} cannot be "
                                 "passed by name; write it as fn(prompts, completions, **kwargs).")
        return cls(positional=not keyword_style, names=tuple(p.name for p in named),
                   required=tuple(p.name for p in named if p.default is P.empty), var_keyword=var_keyword)

    def missing(self, columns: Sequence[str]) -> list[str]:
        """Required parameters that neither the texts nor ``columns`` give."""
        offered = set(RESERVED_ARGUMENTS) | set(columns)
        return [n for n in self.required if n not in offered]


def call_reward_function(
    fn: Callable[..., Any],
    call: RewardCall,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    label: str = "",
) -> list[float]:
    """``fn`` called on one batch as ``call`` says: one float per row, ``nan`` where it returned None. ValueError
    for a required parameter no column gives or a column named like an argument; RewardFunctionError for what the
    function raised or returned (not one finite float or None per row)."""
    label = label or getattr(fn, "__name__", "reward function")
    columns = dict(columns or {})
    B = len(prompts)
    clash = sorted(set(columns) & set(RESERVED_ARGUMENTS))
    if clash:
        raise ValueError(f"reward function {label!r}: the data has columns {clash}, named like reward-function "
                         f"arguments {list(RESERVED_ARGUMENTS)}; rename them in the data.")
    for name, values in columns.items():
        if len(values) != B:
            raise ValueError(f"reward function {label!r}: column {name!r} has {len(values)} values for {B} rows.")
    missing = call.missing(list(columns))
    if missing:
        raise ValueError(f"reward function {label!r} needs {missing}, which the rows do not have (their other "
                         f"columns: {sorted(columns) or 'none'}); add the column to the data or give the "
                         "parameter a default.")
    ids = [list(x) for x in completion_ids] if completion_ids is not None else None
    offered: dict[str, Any] = {"prompts": list(prompts), "completions": list(completions),
                               "responses": list(completions), "completion_ids": ids, **columns}
    kwargs = {n: offered[n] for n in call.names if n in offered}
    if call.var_keyword:
        extra = {"prompts": offered["prompts"], "completions": offered["completions"],
                 "completion_ids": ids, **columns}
        kwargs = {**extra, **kwargs}
    try:
        out = fn(list(prompts), list(completions), **kwargs) if call.positional else fn(**kwargs)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RewardFunctionError(f"reward function {label!r} raised {type(exc).__name__}"
                                  f"{': ' + first if first else ''}") from exc
    if out is None or isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise RewardFunctionError(f"reward function {label!r} returned {type(out).__name__}; it must return one "
                                  f"float (or None) per row, a list of {B}.")
    try:
        values = [math.nan if v is None else float(v) for v in out]
    except (TypeError, ValueError) as exc:
        raise RewardFunctionError(f"reward function {label!r} returned a value that is not a number ({exc}); it "
                                  "must return one float (or None) per row.") from None
    if len(values) != B:
        raise RewardFunctionError(f"reward function {label!r} returned {len(values)} values for {B} rows.")
    bad = [v for v, raw in zip(values, out) if raw is not None and not math.isfinite(v)]
    if bad:
        raise RewardFunctionError(f"reward function {label!r} returned non-finite rewards {bad[:4]} (return None "
                                  "for a row the function does not apply to).")
    return values


@dataclass(frozen=True)
class RewardSource:
    """One term of the reward: ``weight *`` a reward-model role's score or a reward function's value."""

    name: str
    weight: float = 1.0
    role: str | None = None
    fn: RewardFn | None = None
    # a reward-model role whose tokenizer differs from the actor's: re-encodes the rows before scoring
    retokenizer: Any = None
    # how ``fn`` is called (read from its signature when the source is made)
    call: RewardCall | None = None

    def __post_init__(self) -> None:
        if (self.role is None) == (self.fn is None):
            raise ValueError(f"reward source {self.name!r}: give exactly one of role= or fn=.")
        if self.fn is not None and self.call is None:
            object.__setattr__(self, "call", RewardCall.of(self.fn, self.name))
        if self.retokenizer is not None and self.role is None:
            raise ValueError(f"reward source {self.name!r}: a retokenizer applies to reward-model roles only.")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward source {self.name!r}: weight must be finite, got {self.weight}.")


def reward_model(role: str = "reward", weight: float = 1.0, name: str | None = None,
                 retokenizer: Any = None) -> RewardSource:
    """A frozen scalar-head role of the registry (score at the last real token). ``retokenizer``: a
    :class:`~multiengine.pipelines.rlhf.retokenize.Retokenizer` from the actor's tokenizer to this model's,
    when they differ (one whose ``needed`` is False is dropped: the actor's ids are used as they are)."""
    if retokenizer is not None and not retokenizer.needed:
        retokenizer = None
    return RewardSource(name=name or role, weight=float(weight), role=role, retokenizer=retokenizer)


def reward_function(fn: RewardFn | str, weight: float = 1.0, name: str | None = None) -> RewardSource:
    """A Python reward function, or a spec string resolved with :func:`load_reward_function`."""
    if isinstance(fn, str):
        label = name or fn.rpartition(":")[2]
        fn = load_reward_function(fn)
    else:
        label = name or getattr(fn, "__name__", "reward_fn")
    return RewardSource(name=label, weight=float(weight), fn=fn)


def check_sources(sources: Sequence[RewardSource], registry: EngineRegistry) -> None:
    """Reject an empty list, duplicate or reserved names and reward-model roles the registry does not have."""
    if not sources:
        raise ValueError("no reward source: give at least one reward_model(...) or reward_function(...).")
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"reward source names must be unique, got {names}; pass name= to tell them apart.")
    taken = [n for n in names if n in RESERVED_NAMES]
    if taken:
        raise ValueError(f"reward source names {taken} would overwrite the metrics reward/{taken[0]}; pass another "
                         f"name= (reserved: {list(RESERVED_NAMES)}).")
    for s in sources:
        if s.role is not None and s.role not in registry:
            raise ValueError(f"reward source {s.name!r}: role {s.role!r} is not in the registry "
                             f"(roles: {registry.names()}).")


def check_reward_columns(sources: Sequence[RewardSource], columns: Sequence[str], where: str = "the data") -> None:
    """Every reward function's required parameters are among ``columns`` (besides ``prompt``) and no column is named
    like a reward-function argument; ValueError naming the function, the parameter, ``where``'s columns and the fix."""
    if not any(s.fn is not None for s in sources):
        return
    columns = [c for c in columns if c != "prompt"]
    clash = sorted(set(columns) & set(RESERVED_ARGUMENTS))
    if clash:
        raise ValueError(f"{where} has columns {clash}, named like reward-function arguments "
                         f"{list(RESERVED_ARGUMENTS)}; rename them (e.g. to answer) in the data.")
    for s in sources:
        if s.fn is None or s.call is None:
            continue
        missing = s.call.missing(columns)
        if missing:
            raise ValueError(f"reward function {s.name!r} needs {missing}, which {where} does not have (its columns "
                             f"besides prompt: {sorted(columns) or 'none'}); add the column to the data or give the "
                             "parameter a default.")


def reencoded(retokenizer: Any, sequences: torch.Tensor, attention_mask: torch.Tensor, context_length: int,
              prompts: Sequence[str] | None = None, prompt_messages: Sequence[Any] | None = None,
              align: bool = False) -> dict[str, Any]:
    """The actor's rows ``[B, C + T]`` re-encoded by ``retokenizer`` for a role with its own tokenizer, on
    the rows' device (``prompts``: the original prompt strings; ``prompt_messages``: the conversations)."""
    C = context_length
    out = retokenizer(sequences[:, :C].cpu(), attention_mask[:, :C].cpu(), sequences[:, C:].cpu(),
                      attention_mask[:, C:].cpu(), prompts=prompts, prompt_messages=prompt_messages, align=align)
    return {k: v.to(sequences.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


@torch.no_grad()
def compute_scores(
    registry: EngineRegistry,
    sources: Sequence[RewardSource],
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompts: Sequence[str] | None = None,
    responses: Sequence[str] | None = None,
    *,
    context_length: int | None = None,
    prompt_messages: Sequence[Any] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(total [B] float32, {source: [B] unweighted score})``: the weighted sum of every source's score of the rows
``sequences`` ``[B, L]`` (prompt + response, ``attention_mask`` covering the actions; collective). Reward functions
need the texts ``prompts``/``responses`` and get ``columns`` (``{name: [B values]}``) as keyword arguments; a reward
model with a retokenizer needs ``context_length`` (where the responses start) and ``prompt_messages`` (conversations).
A function's score is ``nan`` on rows it returned None for (they add 0 to the total)."""
    B = sequences.shape[0]
    total = torch.zeros(B, dtype=torch.float32, device=sequences.device)
    parts: dict[str, torch.Tensor] = {}
    completion_ids = None
    for src in sources:
        if src.role is not None:
            ids, mask = sequences, attention_mask
            if src.retokenizer is not None:
                if context_length is None:
                    raise ValueError(f"reward model {src.name!r} has its own tokenizer: pass context_length= (where "
                                     "the responses start) so its rows can be re-encoded.")
                batch = reencoded(src.retokenizer, sequences, attention_mask, context_length, prompts, prompt_messages)
                ids, mask = batch["input_ids"], batch["attention_mask"]
            with scoring_mode(registry, src.role) as engine:
                value = sequence_scores(engine, ids, mask).float()
            total = total + src.weight * value
        else:
            if prompts is None or responses is None or len(prompts) != B or len(responses) != B:
                raise ValueError(f"reward function {src.name!r} needs the prompt and response texts of all {B} "
                                 "rows (batch['prompts'] and a decode function).")
            if completion_ids is None and context_length is not None:
                actions = attention_mask[:, context_length:].bool().cpu()
                completion_ids = [row[keep].tolist() for row, keep in zip(sequences[:, context_length:].cpu(), actions)]
            out = call_reward_function(src.fn, src.call or RewardCall.of(src.fn, src.name), prompts, responses,
                                       columns, completion_ids, label=src.name)
            value = torch.tensor(out, dtype=torch.float32, device=sequences.device)
            total = total + src.weight * torch.nan_to_num(value, nan=0.0)
        parts[src.name] = value
    return total, parts


class RunningMoments:
    """Running mean and variance of a stream of scores over every rank (parallel-variance merge of each batch's global
    count, mean and M2), to normalise rewards as ``(r - mean) / (std + eps)``; ``update`` is collective, the state the
    same on every rank and checkpointed, so a resumed run normalises the same way."""

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = float(eps)
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().to(torch.float64).reshape(-1).cpu()
        total, total_sq, n = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(),
                                                         torch.tensor(float(x.numel()), dtype=x.dtype)])).tolist()
        if n == 0:
            return
        batch_mean = total / n
        batch_m2 = max(total_sq - n * batch_mean * batch_mean, 0.0)
        delta = batch_mean - self.mean
        new_count = self.count + n
        self.mean += delta * n / new_count
        self.m2 += batch_m2 + delta * delta * self.count * n / new_count
        self.count = new_count

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.std + self.eps)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "eps": self.eps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.count = float(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
        self.eps = float(state.get("eps", self.eps))

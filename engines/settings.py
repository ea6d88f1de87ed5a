"""Typed settings: frozen dataclasses whose fields carry a default, one line of help and a check (:func:`setting`,
:func:`section`, :class:`Settings`); an object that exists is a valid one. ``when="env"``: a field that means
something only while ``env`` is set refuses any value but its default or an off one otherwise. Standard library only."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import typing
from pathlib import Path
from typing import Any

# transformers' scheduler names (SchedulerType) of every release this project supports, checked without importing
# transformers.trainer_utils (it imports peft: seconds in every process); other names are looked up there.
SCHEDULERS = frozenset({"linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"})


def scheduler_names() -> list[str]:
    """Every ``transformers.get_scheduler`` name."""
    from transformers import SchedulerType

    return [s.value for s in SchedulerType]


def is_scheduler_name(name: str) -> bool:
    return name in SCHEDULERS or name in scheduler_names()


# The dtypes a config names -> torch's (and vLLM's) name of each.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# LoRA's targets on a decoder whose config names none: the attention projections of OPT (out_proj) and of Llama,
# Mistral, Qwen and Gemma (o_proj). The diffusion families name their own (pipelines.diffusion.families).
DECODER_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")


__all__ = ["DECODER_LORA_TARGETS", "DTYPES", "OPTIMIZER_CHECKS", "Check", "Choice", "Each", "FieldError", "Length",
           "PathExists", "Range", "Satisfies", "Settings",
           "SettingsError", "config_problem", "field_checks", "field_help", "optional", "section", "setting",
           "reads_of", "SCHEDULERS", "is_scheduler_name", "scheduler_names", "set_key", "sets_feature", "track_reads",
           "tracking_reads", "when_holds", "when_problem"]


class SettingsError(ValueError):
    """A user error in a setting, naming it and the fix: the command line prints it as one ``error:`` line and
    exits 2 (the recipe language's errors and the engines' ``ConfigError`` are kinds of it)."""

    def __init__(self, message: str, *, key: str | None = None, value: Any = None, fix: str | None = None) -> None:
        super().__init__(message)
        self.key, self.value, self.fix = key, value, fix


class FieldError(SettingsError):
    """A value that breaks its field's check: ``problem`` completes "<field> ..." (e.g. "must be >= 1")."""

    def __init__(self, key: str, value: Any, problem: str, fix: str) -> None:
        super().__init__(f"{key}={value!r} {problem}; fix: {fix}", key=key, value=value, fix=fix)
        self.problem = problem


def config_problem(key: str, value: Any, problem: str, fix: str) -> SettingsError:
    """The error of a check across settings: ``problem`` completes "config key '<key>' ...", e.g.
    ``config_problem("data.source", path, "has no rows", "point data.source at a non-empty JSONL file")``."""
    return SettingsError(f"config key '{key}' {problem} (value {value!r}); fix: {fix}", key=key, value=value, fix=fix)


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _choice_text(choice: Any) -> str:
    """A choice as a user types it: strings bare, except the empty one (shown as "")."""
    return choice if isinstance(choice, str) and choice else json.dumps(choice)


class Check:
    """A constraint on one value: ``problem(value)`` is None or what is wrong ("must be >= 1"), ``describe()`` the
    phrase ``--help`` shows, ``fix(key, value)`` the advice."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def fix(self, key: str, value: Any) -> str:
        return f"set {key} to a value that is {self.describe()}"


class Range(Check):
    """min <= value <= max for ints and floats (either bound optional; exclusive if asked)."""

    def __init__(self, min: float | None = None, max: float | None = None, *, min_exclusive: bool = False,
                 max_exclusive: bool = False) -> None:
        if min is None and max is None:
            raise TypeError("Range needs min, max or both")
        self.min, self.max, self.min_exclusive, self.max_exclusive = min, max, min_exclusive, max_exclusive

    def describe(self) -> str:
        if self.max is None:
            return f"{'>' if self.min_exclusive else '>='} {_fmt(self.min)}"
        if self.min is None:
            return f"{'<' if self.max_exclusive else '<='} {_fmt(self.max)}"
        left, right = "(" if self.min_exclusive else "[", ")" if self.max_exclusive else "]"
        return f"in {left}{_fmt(self.min)}, {_fmt(self.max)}{right}"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {self.describe()}"
        low = self.min is None or (value > self.min if self.min_exclusive else value >= self.min)
        high = self.max is None or (value < self.max if self.max_exclusive else value <= self.max)
        return None if low and high and value == value else f"must be {self.describe()}"  # NaN fails


class Choice(Check):
    """One of a fixed set of values."""

    def __init__(self, *choices: Any) -> None:
        if not choices:
            raise TypeError("Choice needs at least one choice")
        self.choices = choices

    def describe(self) -> str:
        return "one of " + ", ".join(_choice_text(c) for c in self.choices)

    def problem(self, value: Any) -> str | None:
        ok = any(value == c and type(value) is type(c) for c in self.choices)
        return None if ok else f"must be {self.describe()}"

    def fix(self, key: str, value: Any) -> str:
        close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
        hint = f"did you mean {key}={close[0]}? " if close else ""
        return f"{hint}use one of: {', '.join(_choice_text(c) for c in self.choices)}"


class Length(Check):
    """A list or string with at least ``min`` / at most ``max`` items (characters)."""

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        if min is None and max is None:
            raise TypeError("Length needs min, max or both")
        self.min, self.max = min, max

    def describe(self) -> str:
        if self.max is None:
            return "non-empty" if self.min == 1 else f"at least {self.min} long"
        return f"at most {self.max} long" if self.min is None else f"{self.min} to {self.max} long"

    def problem(self, value: Any) -> str | None:
        try:
            n = len(value)
        except TypeError:
            return f"must be a list or string, {self.describe()}"
        if (self.min is not None and n < self.min) or (self.max is not None and n > self.max):
            return f"must be {self.describe()} (it has {n})"
        return None


class PathExists(Check):
    """A path that must exist: kind "file", "dir" or "any". An empty string means unset and passes."""

    def __init__(self, kind: str = "any") -> None:
        if kind not in ("any", "file", "dir"):
            raise TypeError(f"PathExists kind must be 'any', 'file' or 'dir', got {kind!r}")
        self.kind = kind

    def describe(self) -> str:
        return {"any": "an existing path", "file": "an existing file", "dir": "an existing folder"}[self.kind]

    def problem(self, value: Any) -> str | None:
        if value == "":
            return None
        path = Path(str(value)).expanduser()
        if {"any": path.exists, "file": path.is_file, "dir": path.is_dir}[self.kind]():
            return None
        if path.exists():
            return f"must be {self.describe()} (it is a {'folder' if path.is_dir() else 'file'})"
        return f"must be {self.describe()} (no such path)"

    def fix(self, key: str, value: Any) -> str:
        return f"point {key} at {self.describe()}, or create it"


class Each(Check):
    """A check applied to every item of a list."""

    def __init__(self, check: Check) -> None:
        self.check = check

    def describe(self) -> str:
        return f"a list whose items are each {self.check.describe()}"

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"must be {self.describe()}"
        for i, item in enumerate(value):
            p = self.check.problem(item)
            if p:
                return f"item {i} ({item!r}) {p}"
        return None


class Satisfies(Check):
    """A rule of one value: ``predicate(value) -> bool`` with the phrase that describes it."""

    def __init__(self, predicate: Any, description: str) -> None:
        self.predicate, self.description = predicate, description

    def describe(self) -> str:
        return self.description

    def problem(self, value: Any) -> str | None:
        try:
            ok = bool(self.predicate(value))
        except (TypeError, ValueError, AttributeError):
            ok = False
        return None if ok else f"must be {self.description}"


class _SchedulerName(Check):
    def describe(self) -> str:
        return "a transformers scheduler name (constant, constant_with_warmup, linear, cosine, ...)"

    def problem(self, value: Any) -> str | None:
        return None if isinstance(value, str) and is_scheduler_name(value) else f"must be {self.describe()}"

    def fix(self, key: str, value: Any) -> str:
        close = difflib.get_close_matches(str(value), scheduler_names(), n=1)
        return (f"did you mean {key}={close[0]}? " if close else "") + f"use one of {', '.join(scheduler_names())}"


# The optimizer settings' checks, defined once: the recipe language declares its role keys (roles.<name>.lr, ...)
# with them and engines.OptimSpec applies them to what a registry user passes.
OPTIMIZER_CHECKS: dict[str, tuple[Check, ...]] = {
    "lr": (Range(0, min_exclusive=True),), "weight_decay": (Range(0),), "eps": (Range(0, min_exclusive=True),),
    "betas": (Length(2, 2), Each(Range(0, 1, max_exclusive=True))), "warmup_steps": (Range(0),),
    "max_grad_norm": (Satisfies(lambda v: not isinstance(v, bool) and v >= 0, "a number >= 0 (0.0 = no clipping)"),),
    "scheduler": (_SchedulerName(),)}


# --- declaring fields ----------------------------------------------------------------------------------------------
def setting(default: Any, help: str, check: Check | list[Check] | None = None, *, when: str = "",
            example: Any = None, items_when: dict[str, str] | None = None) -> Any:
    """A settings field: default (lists/dicts copied per object), one line of help, check(s), ``when`` (the sibling
    that must be set, ``"name"`` or ``"name=value"``, for this one to differ from its default; a dotted name is a key
    from the config's root, e.g. ``"generation.engine=vllm"``) and ``example`` (a valid non-default value where the
    type and check give none); ``items_when``: a list's items that ask for a feature, ``{item: condition}``
    (``{"ema": "ema.enabled"}``), a condition on a key the config lacks not applying."""
    checks = tuple(check) if isinstance(check, (list, tuple)) else (check,) if check is not None else ()
    meta = {"help": help, "checks": checks, "when": when, "example": example,
            "items_when": tuple((items_when or {}).items())}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, help: str, **defaults: Any) -> Any:
    """A field holding a nested settings object of ``cls`` (its own defaults, changed by ``defaults``)."""
    for f in dataclasses.fields(cls):
        if f.name in defaults and f.metadata.get("when"):
            raise TypeError(f"{cls.__name__}.{f.name} applies only when {f.metadata['when']} is set: its default "
                            "cannot be changed by a section")
    unknown = set(defaults) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return dataclasses.field(default_factory=functools.partial(cls, **defaults),
                             metadata={"help": help, "section": cls, "defaults": defaults})


def field_help(f: dataclasses.Field) -> str:
    return str(f.metadata.get("help", ""))


def field_checks(f: dataclasses.Field) -> tuple[Check, ...]:
    return tuple(f.metadata.get("checks", ()))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def optional(annotation: Any) -> bool:
    """Whether a field's type admits None (``float | None``, ``Any``)."""
    if annotation is Any:
        return True
    return type(None) in typing.get_args(annotation)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def value_problem(name: str, value: Any, checks: tuple[Check, ...], annotation: Any, default: Any
                  ) -> tuple[str, str] | None:
    """(what is wrong, the fix) of ``value`` for the field ``name``, or None. None passes where the type admits it
    (or the default is None)."""
    if value is None:
        if optional(annotation) or default is None:
            return None
        return (f"must be set ({checks[0].describe()})" if checks else "must be set",
                f"set {name} to a value" + (f" that is {checks[0].describe()}" if checks else ""))
    for check in checks:
        problem = check.problem(value)
        if problem is not None:
            return problem, check.fix(name, value)
    return None


def when_holds(when: str, get: Any) -> bool:
    """Whether a ``when`` condition holds: ``"name"`` (that field is set: truthy) or ``"name=value"``."""
    name, eq, wanted = when.partition("=")
    value = get(name)
    return str(value).lower() == wanted.lower() if eq else bool(value)


def sets_feature(value: Any, default: Any) -> bool:
    """Whether a ``when`` key's value asks for something: not its default and not an off value (false, 0, "", [])."""
    return value != default and bool(value)


def when_problem(when: str) -> str:
    name, eq, wanted = when.partition("=")
    if eq:
        return f"applies only with {name}={wanted}" if wanted else f"applies only while {name} is empty"
    return f"applies only when {name} is set"


# Which settings fields a run reads (:func:`track_reads`): how a test finds a key that is accepted and then ignored.
_READS: set[tuple[int, str]] | None = None


def track_reads(on: bool = True) -> None:
    """Start (``on``) or stop recording which fields of keyed settings objects are read (see :func:`reads_of`)."""
    global _READS
    _READS = set() if on else None


def tracking_reads() -> bool:
    return _READS is not None


def reads_of(root: Any) -> set[str]:
    """The dotted keys of ``root``'s tree (a loaded config) read since :func:`track_reads`."""
    return {path for tree, path in (_READS or ()) if tree == id(root)}


def set_key(obj: Any, root: Any, prefix: str = "") -> None:
    """Name a settings object, and every one nested in it, by its place in a config tree (``root``, keys under
    ``prefix``): reads of their fields are recorded under those keys while :func:`track_reads` is on."""
    if isinstance(obj, Settings):
        object.__setattr__(obj, "_key", (id(root), prefix))
        values = object.__getattribute__(obj, "__dict__")
        for f in dataclasses.fields(obj):
            set_key(values[f.name], root, f"{prefix}{f.name}.")
    elif hasattr(obj, "items") and not isinstance(obj, dict):  # a container of settings (a recipe's roles)
        for name, value in obj.items():
            set_key(value, root, f"{prefix}{name}.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of the settings dataclasses: checks every field on construction (its checks, then ``when``), then the
    cross-field rules of :meth:`check`; :meth:`to_dict` gives plain values (for summaries and YAML)."""

    def __getattribute__(self, name: str) -> Any:
        value = object.__getattribute__(self, name)
        if _READS is not None and not name.startswith("_"):
            key = object.__getattribute__(self, "__dict__").get("_key")
            if key is not None and name in object.__getattribute__(self, "__dataclass_fields__"):
                _READS.add((key[0], key[1] + name))
        return value

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            if f.metadata.get("section"):
                continue
            value = getattr(self, f.name)
            found = value_problem(f.name, value, field_checks(f), hints.get(f.name, Any), _field_default(f))
            if found is not None:
                raise FieldError(f.name, value, *found)
            when = f.metadata.get("when")
            if when and "." not in when.partition("=")[0] and not when_holds(when, lambda name: getattr(self, name)) \
                    and sets_feature(value, _field_default(f)):  # a dotted name is a key of the config: checked there
                raise FieldError(f.name, value, when_problem(when), f"set {when}, or leave {f.name} at its default "
                                 f"{_field_default(f)!r}")
        self.check()

    def check(self) -> None:
        """Rules across this object's fields; raise :class:`FieldError` naming the field."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values of every field (not counted as reads: a summary is no use of a setting)."""
        values = object.__getattribute__(self, "__dict__")
        return {f.name: _plain(values[f.name]) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (checked again), keeping this object's place in its config tree."""
        values = object.__getattribute__(self, "__dict__")
        new = type(self)(**{**{f.name: values[f.name] for f in dataclasses.fields(self) if f.init}, **changes})
        if "_key" in values:
            object.__setattr__(new, "_key", values["_key"])
        return new


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value

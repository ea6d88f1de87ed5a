"""The ``reward`` section of the RL recipes: the reward sources a config names, checked and resolved.

``models``: reward-model roles, each ``{role, model, weight}`` plus an optional ``tokenizer`` (a folder; "" = the
model folder's own, re-encoded when it differs from the actor's) and optional placement keys (``stage, dtype,
offload_params, gather_forward``) over ``roles.reward``'s; ``role`` is ``reward`` or ``reward_<name>``, and only
``reward`` may leave ``model`` empty (then ``roles.reward.model``).
``functions``: ``fn(prompts, completions, **kwargs) -> list[float]`` (TRL's form; see rewards.py) as
``"pkg.mod:fn"``, ``"/path/file.py:fn"`` or ``"builtin:judge"`` (weight 1), or ``{fn: <spec>, weight: w}``.
The score is the weighted sum.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from multiengine.engines import Placement
from multiengine.engines.settings import Settings, SettingsError, setting

if TYPE_CHECKING:  # rewards.py pulls in the model code: imported where used, so importing this stays light
    from .rewards import RewardSource

__all__ = ["RewardModelRole", "RewardSettings", "reward_entries", "reward_roles", "reward_tokenizer_checks",
           "with_retokenizers"]

_MODEL_KEYS = ("role", "model", "weight", "tokenizer", "stage", "dtype", "offload_params", "gather_forward")
_FUNCTION_KEYS = ("fn", "weight")


@dataclass(frozen=True)
class RewardModelRole:
    """A frozen reward-model role to build: its name, folder, weight in the sum and placement."""

    role: str
    path: str
    weight: float
    placement: Any  # engines.Placement
    tokenizer: str = ""  # its tokenizer folder; "" = the model folder's own


def _weight(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SettingsError(f"{key}={value!r}: a reward weight is a finite number (e.g. 1.0).")
    return float(value)


def _check_keys(key: str, entry: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    for name in entry:
        if name == "path" and "model" in valid:  # the old name of an entry's folder
            raise SettingsError(f"config key '{key}.path' (value {entry[name]!r}) is now '{key}.model': a "
                                    f"role's folder is its `model` everywhere. Fix: write model: {entry[name]}.")
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(valid)}."
            raise SettingsError(f"unknown key '{key}.{name}' (value {entry[name]!r}).{hint}")


def reward_entries(models: Any, functions: Any, key: str = "reward", default_model: str = ""
                   ) -> tuple[list[dict[str, Any]], list[tuple[str, float]]]:
    """The checked entries of ``{key}.models`` and ``{key}.functions``, without building or importing anything
    heavy: ``([{role, model, weight, <placement keys>}], [(function spec, weight)])``. Every reward function is
    resolved once here, so a typo in a spec fails before any rank starts. ``default_model``:
    ``roles.reward.model``, which an entry for the ``reward`` role may leave empty but not contradict.

    Raises:
        SettingsError: naming the key, the value and the fix.
    """
    from .rewards import load_reward_function

    if not isinstance(models, list):
        raise SettingsError(f"{key}.models={models!r}: expected a list, e.g. [{{role: reward, weight: 1.0}}].")
    if not isinstance(functions, list):
        raise SettingsError(f"{key}.functions={functions!r}: expected a list, e.g. [builtin:judge].")
    roles: list[dict[str, Any]] = []
    for i, entry in enumerate(models):
        where = f"{key}.models[{i}]"
        if isinstance(entry, str):
            entry = {"role": entry}
        if not isinstance(entry, dict):
            raise SettingsError(f"{where}={entry!r}: expected a mapping such as {{role: reward, weight: 1.0}}.")
        _check_keys(where, entry, _MODEL_KEYS)
        role = entry.get("role", "reward")
        if not isinstance(role, str) or not (role == "reward" or (role.startswith("reward_") and len(role) > 7)):
            raise SettingsError(f"{where}.role={role!r}: a reward-model role is named 'reward' or "
                                    "'reward_<name>' (e.g. reward_safety).")
        if any(r["role"] == role for r in roles):
            raise SettingsError(f"{where}.role={role!r} appears twice in {key}.models; give each a new name.")
        path = entry.get("model", "") or ""
        if not isinstance(path, str):
            raise SettingsError(f"{where}.model={path!r}: expected a model folder or hub name.")
        if not path and role != "reward":
            raise SettingsError(f"{where}.model is empty: only the 'reward' role defaults to roles.reward.model; "
                                    f"give {role!r} its own folder.")
        if path and role == "reward" and default_model and path != default_model:
            raise SettingsError(f"{where}.model={path!r} and roles.reward.model={default_model!r} both set the "
                                    "'reward' role's folder; keep one (roles.reward.model is the usual place).")
        roles.append({**entry, "role": role, "model": path, "weight": _weight(f"{where}.weight",
                                                                             entry.get("weight", 1.0))})
    specs: list[tuple[str, float]] = []
    for i, entry in enumerate(functions):
        where = f"{key}.functions[{i}]"
        if isinstance(entry, str):
            entry = {"fn": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("fn"), str):
            raise SettingsError(f"{where}={entry!r}: expected 'pkg.module:function', '/path/file.py:function', "
                                    "'builtin:judge' or {fn: <one of those>, weight: 1.0}.")
        _check_keys(where, entry, _FUNCTION_KEYS)
        try:
            load_reward_function(entry["fn"])
        except ValueError as exc:
            raise SettingsError(f"{where}: {exc}") from None
        if any(s == entry["fn"] for s, _ in specs):
            raise SettingsError(f"{where}={entry['fn']!r} appears twice in {key}.functions; merge the weights.")
        specs.append((entry["fn"], _weight(f"{where}.weight", entry.get("weight", 1.0))))
    return roles, specs


def reward_roles(entries: list[dict[str, Any]], specs: list[tuple[str, float]], default_path: str | None,
                 base: Placement, key: str = "reward", default_tokenizer: str = ""
                 ) -> tuple[list[RewardModelRole], list[RewardSource]]:
    """The reward-model roles to build and every reward source of checked entries (:func:`reward_entries`).
    With neither models nor functions the reward is the ``reward`` role at ``default_path``
    (``roles.reward.model``, with ``default_tokenizer``: ``roles.reward.tokenizer``); ``None`` then is an error,
    "" a folder not known yet (checks before any rank starts). ``base`` is ``roles.reward``'s resolved
    placement, which each entry's own placement keys override."""
    from .rewards import RESERVED_NAMES, reward_function, reward_model

    if not entries and not specs:
        if default_path is None:
            raise SettingsError(f"no reward source: set roles.reward.model (a reward-model folder), {key}.models "
                                    f"or {key}.functions (e.g. {key}.functions=[builtin:judge] on the built-in task).")
        entries = [{"role": "reward", "model": "", "weight": 1.0}]
    roles = []
    for i, entry in enumerate(entries):
        path = entry["model"] or default_path
        if path is None:
            raise SettingsError(f"{key}.models[{i}] (role 'reward') has no model and roles.reward.model is empty.")
        stage = entry.get("stage", base.stage)
        try:
            place = Placement(stage=base.stage if stage is None or stage < 0 else int(stage),
                              dtype=entry.get("dtype") or base.dtype,
                              offload_params=bool(entry.get("offload_params", base.offload_params)),
                              gather_forward=bool(entry.get("gather_forward", base.gather_forward)))
        except ValueError as exc:  # the engines' ConfigError: name the entry it came from
            raise SettingsError(f"{key}.models[{i}] (role {entry['role']!r}): {exc}") from None
        tokenizer = entry.get("tokenizer") or (default_tokenizer if entry["role"] == "reward" else "")
        roles.append(RewardModelRole(entry["role"], path, entry["weight"], place, str(tokenizer or "")))
    sources = [reward_model(r.role, r.weight) for r in roles]
    labels = [spec.rpartition(":")[2] for spec, _ in specs]
    taken = {r.role for r in roles} | set(RESERVED_NAMES)
    for (spec, weight), label in zip(specs, labels):
        # a function's metric name (reward/<name>) is its own name, or the whole spec where that would be
        # ambiguous or take the name of another metric (reward/mean, ...)
        unique = labels.count(label) == 1 and label not in taken
        sources.append(reward_function(spec, weight, name=label if unique else spec))
    return roles, sources


@dataclass(frozen=True)
class RewardSettings(Settings):
    """The reward sources: reward-model roles and functions, summed with weights."""

    models: list[Any] = setting([], "reward-model roles [{role, model, weight, tokenizer, stage, ...}]; [] and no "
                                    "functions = the `reward` role (roles.reward), weight 1")
    functions: list[Any] = setting([], "reward functions: pkg.mod:fn, /path/file.py:fn, builtin:judge or {fn, weight}")
    normalize: bool = setting(False, "running mean/std of the combined score over all ranks, before clipping")

    def entries(self, default_model: str = "") -> tuple[list[dict[str, Any]], list[tuple[str, float]]]:
        """The checked ``models`` and ``functions`` entries (:func:`reward_entries`); ``default_model``:
        ``roles.reward.model``."""
        return reward_entries(self.models, self.functions, "reward", default_model)

    def wants_reward_role(self) -> bool:
        """The ``reward`` role takes its folder from ``roles.reward.model``: no source is named (the default), or a
        ``models`` entry names the role without a folder."""
        entries, functions = self.entries()
        return (not entries and not functions) or any(e["role"] == "reward" and not e["model"] for e in entries)

    def sources(self, default_path: str | None, base: Placement, default_tokenizer: str = ""
                ) -> tuple[list[RewardModelRole], list[RewardSource]]:
        """The reward-model roles to build and every reward source (:func:`reward_roles`): ``default_path`` is
        ``roles.reward.model`` (None = none may be used), ``base`` ``roles.reward``'s placement."""
        entries, specs = self.entries(default_path or "")
        return reward_roles(entries, specs, default_path, base, "reward", default_tokenizer)


def reward_tokenizer_checks(roles: list[RewardModelRole]) -> list[tuple[str, str, str, str]]:
    """``(role, folder, tokenizer, tokenizer key)`` of each reward-model role, for a check of scoring tokenizers."""
    return [(r.role, r.path, r.tokenizer, "roles.reward.tokenizer" if r.role == "reward"
             else f"reward.models ({r.role}).tokenizer") for r in roles]


def with_retokenizers(sources: list[RewardSource], retokenizers: Mapping[str, Any]) -> list[RewardSource]:
    """Each reward-model source with its role's ``Retokenizer`` (``None``: it reads the actor's ids)."""
    return [replace(src, retokenizer=retokenizers.get(src.role)) if src.role else src for src in sources]

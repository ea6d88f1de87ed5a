"""Every key a recipe accepts changes what its run builds, or is refused before launch naming it.

The walk sets each declared key of each recipe, one at a time, to a valid value other than its default (the field's
``example``, else one derived from its type and check) and compares what the run would build (``Recipe.describe``:
every role's RoleSpec, DeepSpeed config included, and every section as handed on) with the defaults'. A key that
neither changes it nor is refused by ``load_config``/``validate`` fails the test, so a key added later without an
effect fails it too. The distributed tests check the other half: every key is read by a real run
(tests/distributed/conftest.py ``assert_keys_read``).
"""

from __future__ import annotations

import json
import typing

import pytest
from multiengine.engines.settings import Choice, Range, SettingsError
from multiengine.recipes.language.config import (
    leaves,
    list_recipes,
    load_config,
    load_recipe,
    recipe_schema,
    validate_config,
)


def _valid(leaf, value) -> bool:
    return all(c.problem(value) is None for c in leaf.checks)


def example_value(leaf):
    """A valid value other than the leaf's default: its ``example``, else one derived from its type and checks."""
    if leaf.example is not None:
        return leaf.example
    default, ann = leaf.default, leaf.annotation
    if type(None) in typing.get_args(ann):  # X | None
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    base = ann if typing.get_origin(ann) in (list, tuple) else (typing.get_origin(ann) or ann)
    choices = [c for c in leaf.checks if isinstance(c, Choice)]
    if choices:
        return next(c for c in choices[0].choices if c != default)
    if base is bool:
        return not default if default is not None else True
    if base in (int, float):
        start = default if default is not None else 0
        steps = [1, -1, 2, 3, 8] if base is int else [0.5, 2.0, 0.1, 0.9, 3.0]
        cands = ([start + s for s in steps] if base is int else
                 [start * s for s in steps if start] + [start + s for s in steps] + steps)
        return next(v for v in cands if v != default and _valid(leaf, base(v)))
    if base is str:  # a local path: a bare name would be looked up on the hub (retries, no network here)
        return "./not-a-real-value"
    origin = typing.get_origin(base) or base
    if origin in (list, tuple):
        item = (typing.get_args(base) or [None])[0]
        if item is float:
            return [v * 0.5 for v in default] if default else [0.5]
        if item is str:
            return ["./x"] if default != ["./x"] else ["./y"]
        return [] if default else ["./x"]
    raise AssertionError(f"no example value for a key of type {ann}: give its setting an example=")


def example_values(leaf):
    """The example value, and for a choice every other one (a follower's `dtype: fp32` is no change when the role it
    follows is fp32 already)."""
    choices = [c for c in leaf.checks if isinstance(c, Choice)]
    first = example_value(leaf)
    return [first, *(c for c in (choices[0].choices if choices else ()) if c not in (first, leaf.default))]


# what a recipe's defaults lack to pass validate: rlhf_grpo names no reward source (each of its configs names one)
NEEDS = {"rlhf_grpo": ["reward.functions=[builtin:judge]"]}


def _changes(recipe, cls, base, base_overrides, key, value) -> bool:
    """Whether ``key=value`` is refused naming the key, or changes what the run builds."""
    try:
        cfg = load_config(recipe, None, [*base_overrides, _override(key, value)])
        validate_config(recipe, cfg)
    except SettingsError as err:
        assert key in str(err) or key.rsplit(".", 1)[-1] in str(err), (key, str(err))
        return True
    return cls.describe(cfg) != base


def _override(key, value) -> str:
    return f"{key}={json.dumps(value) if not isinstance(value, str) else value}"


@pytest.mark.parametrize("recipe", sorted(list_recipes()))
def test_every_key_changes_what_is_built_or_is_refused(recipe, tmp_path):
    cls = load_recipe(recipe)
    base_overrides = [f"output_dir={tmp_path / 'out'}", *NEEDS.get(recipe, [])]
    base = cls.describe(load_config(recipe, None, base_overrides))
    silent = []
    for key, leaf in leaves(recipe_schema(cls)).items():
        if key == "output_dir":
            continue
        if not any(_changes(recipe, cls, base, base_overrides, key, value) for value in example_values(leaf)):
            silent.append(f"{key}={example_value(leaf)!r}")
    assert not silent, f"{recipe}: accepted, and nothing built or run differs: {silent}"


def test_example_values_are_valid_and_differ():
    leaf = recipe_schema(load_recipe("gan")).children["gan"].children["width"]
    value = example_value(leaf)
    assert value != leaf.default and _valid(leaf, value)
    assert isinstance(leaf.checks[0], Range)

"""Which recipes are on the recipe contract yet (a module whose ``RECIPE`` names its class): tests parametrized over
recipes skip the others until they land. Read from the module's text, since importing one that is not fails."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from multiengine.recipes.language.config import list_recipes


def migrated(recipe: str) -> bool:
    spec = importlib.util.find_spec(f"multiengine.recipes.{recipe}")
    return spec is not None and re.search(r"^RECIPE = ", Path(spec.origin).read_text(), re.M) is not None


def recipe_param(recipe: str, *values: object) -> object:
    """``pytest.param(recipe, *values)``, skipped while ``recipe`` is not migrated."""
    return pytest.param(recipe, *values, marks=pytest.mark.skipif(
        not migrated(recipe), reason=f"{recipe} is not on the recipe contract yet (its module defines no RECIPE)"))


def recipe_params(names: list[str] | None = None) -> list[object]:
    """``recipe_param`` of each of ``names`` (default: every recipe with shipped configs)."""
    return [recipe_param(r) for r in (sorted(list_recipes()) if names is None else names)]

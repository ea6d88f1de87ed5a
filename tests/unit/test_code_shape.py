"""The library's shape, read from its source: functions take settings objects rather than long argument lists (at
most 10 parameters), the library stays within its line budget, and engines/ names no recipe or recipe key."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("engines", "pipelines", "recipes")
MAX_PARAMS = 10
MAX_LINES = 27_000


def _sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py"))


def test_no_function_takes_more_than_ten_parameters():
    over = []
    for path in _sources(*LIBRARY):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(names) - int(bool(names) and names[0] in ("self", "cls"))
                if count > MAX_PARAMS:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({count})")
    assert not over, f"take a settings object instead of more than {MAX_PARAMS} parameters: {over}"


def test_the_library_stays_within_its_line_budget():
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in _sources(*LIBRARY))
    assert 10_000 < lines <= MAX_LINES, f"engines/ + pipelines/ + recipes/ hold {lines} lines (budget {MAX_LINES})"


def test_engines_name_no_recipe_or_recipe_language():
    recipes = {p.stem for p in (ROOT / "recipes").glob("*.py") if not p.stem.startswith("_")} - {"common"}
    pattern = re.compile(r"multiengine\.recipes|from \.\.recipes|\brecipes/|CONFIGS_DIR|" + "|".join(
        rf"\b{re.escape(r)}\b" for r in sorted(recipes)))
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in _sources("engines")
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert len(recipes) >= 13 and not hits, hits


def test_every_recipe_class_extends_recipe_directly_and_holds_its_own_workflow():
    """A recipe file reads top to bottom: its class extends Recipe alone (shared code is functions called by name)
    and defines its own build and train_step."""
    from multiengine.recipes.language.config import list_recipes, load_recipe
    from multiengine.recipes.language.lifecycle import Recipe

    names = list_recipes()
    assert len(names) >= 13, names
    for name in names:
        cls = load_recipe(name)
        assert cls.__bases__ == (Recipe,), f"{name}: {cls.__name__} extends {cls.__bases__}, not Recipe alone"
        assert {"build", "train_step"} <= set(vars(cls)), f"{name}: {cls.__name__} defines no build/train_step"

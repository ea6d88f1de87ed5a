"""The README carries exactly two set-up commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.DOTALL)


def test_readme_has_two_setup_commands_that_install_what_they_need():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    for command in commands:
        assert "\n" not in command
        assert command.startswith("python -m pip install torch==2.13.0 && python -m pip install -e ")
    assert "multiengine run" in main_job and "--nproc-per-node 2" in main_job and "--config tiny" in main_job
    assert "pytest" in tests and '".[test' in tests
    # the lint runs after the install and before the tests, so a finding fails the command before the long part
    steps = tests.split(" && ")
    lint = steps.index("python -m ruff check .")
    assert all("pip install" in step for step in steps[:lint]), steps
    assert [i for i, step in enumerate(steps) if "pytest" in step] == [len(steps) - 1], steps


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    command = _readme_commands()[1]
    quiet = command.replace("pip install ", "pip install -q ")
    # the command is the script's last line: the first failure in its `&&` chain (a lint finding, pytest's exit 5
    # when it collects no test) is the script's exit status, which `set -e` alone would not give after an `&&` list
    assert ci.strip().splitlines()[-1] == quiet, (quiet, ci)


def test_the_test_extra_pins_the_ruff_the_command_runs():
    pyproject = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^test = \[(.*)\]$", pyproject, flags=re.MULTILINE)
    assert extra, "pyproject.toml has no `test` extra"
    # one exact version: a newer ruff can add checks to the selected rules and fail CI on an unchanged tree
    assert re.search(r'"ruff==[0-9.]+"', extra.group(1)), extra.group(0)
    assert "\n[tool.ruff]\n" in pyproject and "\n[tool.ruff.lint]\n" in pyproject


def test_registry_guide_names_every_public_engine_name():
    import multiengine.engines as engines

    guide = (ROOT / "docs" / "registry-guide.md").read_text()
    missing = [name for name in engines.__all__ if f"`{name}`" not in guide and f"`{name}," not in guide]
    assert not missing, missing


def test_test_files_have_unique_basenames():
    # tests/ has no __init__.py files: pytest imports each file by its basename, so two files with one name
    # in unit/ and distributed/ make collection fail.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("doc", ["testing.md", "benchmarks.md"])
def test_doc_examples_compile_and_import_what_the_helpers_define(doc):
    # docs/testing.md's 2-rank worker and test, docs/benchmarks.md's benchmark: copied by newcomers, so held to the
    # helpers' real names
    import ast

    import multiengine.engines as engines

    defined = {}
    helpers = {"common": "tests/distributed/workers/common.py", "conftest": "tests/distributed/conftest.py",
               "benchmarks.common": "benchmarks/common.py"}
    for module, path in helpers.items():
        tree = ast.parse((ROOT / path).read_text())
        defined[module] = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined["multiengine.engines"] = set(engines.__all__)
    blocks = re.findall(r"```python\n(.*?)\n```", (ROOT / "docs" / doc).read_text(), flags=re.DOTALL)
    assert blocks, f"docs/{doc} has lost its examples"
    imported = []
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module in defined:
                imported += [(node.module, alias.name) for alias in node.names]
    missing = [(module, name) for module, name in imported if name not in defined[module]]
    assert imported and not missing, missing

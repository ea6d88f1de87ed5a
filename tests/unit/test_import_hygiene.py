"""What importing the public names pulls in, each in a fresh process: the layering rule (engines/ imports only torch
and deepspeed at import time, never the pipelines or the recipes; pipelines/ never import the recipes) and the fast
start (the engines package, the typed settings and the recipe language's loading and listing import no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

MODEL_LIBS = ("transformers", "diffusers", "peft", "datasets")
HEAVY = ("torch", "numpy", "deepspeed", *MODEL_LIBS)


def _imported(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it leaves what it found in ``out``, which comes back with the top-level
    modules and multiengine packages the process imported."""
    script = (f"import sys, json\nout = {{}}\n{code}\n"
              "out['modules'] = sorted({m.split('.')[0] for m in sys.modules} | {'.'.join(m.split('.')[:2]) for m in "
              "sys.modules if m.startswith('multiengine.')})\nprint(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_engines_package_imports_nothing_until_a_name_is_used():
    out = _imported("import multiengine.engines\nout['bare'] = sorted(sys.modules)\n"
                    "from multiengine.engines import EngineRegistry\nout['registry'] = EngineRegistry.__module__")
    assert not [m for m in out["bare"] if m.split(".")[0] in HEAVY]
    assert out["registry"] == "multiengine.engines.registry" and "torch" in out["modules"]


def test_every_public_engines_name_resolves_without_model_libraries_or_upper_layers():
    out = _imported("import multiengine.engines as E\n"
                    "out['all'], out['lazy'], out['dir'] = sorted(E.__all__), sorted(E._WHERE), dir(E)\n"
                    "out['bad'] = []\n"
                    "for name in E.__all__:\n"
                    "    try:\n"
                    "        getattr(E, name)\n"
                    "    except Exception as e:\n"
                    "        out['bad'].append(f'{name}: {type(e).__name__}: {e}')\n"
                    "try:\n"
                    "    from multiengine.engines import no_such_name\n"
                    "except ImportError:\n"
                    "    out['unknown_refused'] = True")
    assert out["bad"] == [] and out["all"] == out["lazy"] and set(out["all"]) <= set(out["dir"])
    assert out["unknown_refused"]
    assert not [m for m in out["modules"] if m in MODEL_LIBS or m in ("multiengine.recipes", "multiengine.pipelines")]


def test_the_settings_and_the_recipe_language_listing_import_no_torch():
    out = _imported("import multiengine.engines.settings, multiengine.engines.planner\n"
                    "from multiengine.recipes.language import cli, config, launcher, plans, roles\n"
                    "out['recipes'] = sorted(config.list_recipes())\n"
                    "import contextlib, io\n"
                    "with contextlib.redirect_stdout(io.StringIO()) as listing:\n"
                    "    out['ls'] = cli.main(['ls'])\n"
                    "out['listed'] = listing.getvalue()")
    assert out["ls"] == 0 and all(f"\n{r} " in out["listed"] for r in out["recipes"])
    assert not [m for m in out["modules"] if m in HEAVY]


def test_the_pipelines_never_import_the_recipes():
    out = _imported("import importlib, pkgutil\nimport multiengine.pipelines as P\nout['names'] = 0\n"
                    "for info in pkgutil.walk_packages(P.__path__, 'multiengine.pipelines.'):\n"
                    "    module = importlib.import_module(info.name)\n"
                    "    names = getattr(module, '__all__', [n for n in vars(module) if not n.startswith('_')])\n"
                    "    out['names'] += len([getattr(module, n) for n in names])")
    assert out["names"] > 100  # every module's public names resolved
    assert "multiengine.recipes" not in out["modules"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, read from the source: every ``import`` and ``from ... import`` of a
    multiengine or relative module, at module level and inside functions (a lazy import still knots two modules);
    ``from pkg import name`` where ``name`` is a submodule is an edge to that submodule. Imports under ``if
    TYPE_CHECKING:`` are left out: they name types for annotations and never run."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = {}
    for top in ("engines", "pipelines", "recipes"):
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(["multiengine", *(parts[:-1] if is_package else parts)])
            files[name] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, (path, is_package) in files.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in
                       ast.unparse(block.test) for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            targets = []
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_knot_and_only_a_knot():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_back():
    """engines/, pipelines/ and recipes/ import in one direction: no two modules reach each other through imports."""
    graph = _import_graph()
    engines = "multiengine.engines."
    assert len(graph) > 80
    # `from . import checkpoint` (a submodule), `from .roles import RoleSpec` and a lazy import in a method all count
    assert {engines + m for m in ("checkpoint", "export", "roles")} <= graph[engines + "registry"]
    assert engines + "optim" in graph[engines + "roles"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each a set of modules that import one another):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)

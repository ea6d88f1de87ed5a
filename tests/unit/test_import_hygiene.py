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

"""Throwaway recipe packages for the recipe-language tests: modules on the recipe contract (``RECIPE`` = a Recipe
subclass with a typed Config) and their shipped configs, in a temporary folder on sys.path."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def toy_package(root: Path, package: str, modules: Mapping[str, str],
                configs: Mapping[str, str] = ()) -> Iterator[dict[str, str]]:
    """``package`` with ``modules`` (name -> source) and ``configs`` ("recipe/name" -> YAML) under ``root``; yields
    what load_config and the CLI take (``package``, ``configs_dir``) and the source folder (``src``)."""
    pkg = root / "src" / package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, text in modules.items():
        (pkg / f"{name}.py").write_text(text)
    folder = root / "configs"
    folder.mkdir()
    for where, text in dict(configs).items():
        (folder / where).parent.mkdir(parents=True, exist_ok=True)
        (folder / f"{where}.yaml").write_text(text)
    sys.path.insert(0, str(root / "src"))
    try:
        yield {"package": package, "configs_dir": str(folder), "src": str(root / "src")}
    finally:
        sys.path.remove(str(root / "src"))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]

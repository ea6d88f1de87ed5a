"""Small shared builders of the unit tests: throwaway recipe packages for the recipe-language tests (modules on the
recipe contract and their shipped configs, in a temporary folder on sys.path) and a PPO registry on the torch
backend."""

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


def ppo_registry(model: str):
    """actor, ref, critic and reward of one tiny model folder on the torch backend, fp32, built."""
    from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, trainable_role
    from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model

    registry = EngineRegistry(backend="torch")
    place, opt = Placement(0, "fp32"), OptimSpec(lr=1e-2, total_steps=4)
    registry.add(trainable_role("actor", causal_lm(model), place, opt, micro_batch_size=2))
    registry.add(frozen_role("ref", causal_lm(model), place))
    registry.add(trainable_role("critic", scalar_model(model), place, opt, micro_batch_size=2))
    registry.add(frozen_role("reward", scalar_model(model), place))
    registry.build()
    return registry

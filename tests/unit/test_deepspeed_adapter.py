"""engines/deepspeed_adapter.py holds every DeepSpeed internal the runtime touches. Its capability check runs here
against the installed DeepSpeed (no mocks): a DeepSpeed that lacks one of them, or is older than the adapter's
MIN_DEEPSPEED, fails this test naming it; the registry refuses such a DeepSpeed at build time with the same list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from multiengine.engines import ConfigError, EngineRegistry, OptimSpec, Placement, trainable_role
from multiengine.engines import deepspeed_adapter as ds


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_the_installed_deepspeed_has_every_internal_the_adapter_uses():
    import deepspeed

    assert _version(deepspeed.__version__) >= _version(ds.MIN_DEEPSPEED), deepspeed.__version__
    assert ds.missing() == []
    # the engine's own attributes exist only on a built engine: a ZeRO-3 trainable role in this process
    registry = EngineRegistry(backend="deepspeed", seed=0)
    registry.add(trainable_role("actor", lambda: torch.nn.Linear(4, 4), Placement(stage=3, dtype="fp32"),
                                OptimSpec(lr=0.1)))
    registry.build()
    assert ds.missing(registry["actor"]) == []
    registry.close()


def test_what_is_absent_is_named_and_refused():
    # a plain object is an "engine" without any of the attributes the joint backward uses
    assert ds.missing(object()) == [f"DeepSpeedEngine().{a}" for a in ds._ENGINE_ATTRS]
    with pytest.raises(ConfigError, match=rf"_running_engine_backward_lock.*deepspeed>={ds.MIN_DEEPSPEED}"):
        ds.check(object())


def test_the_package_floor_is_the_adapters():
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'"deepspeed>=([0-9.]+)"', pyproject).group(1) == ds.MIN_DEEPSPEED

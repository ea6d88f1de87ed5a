"""add_state and load_checkpoint, in one process (torch backend): an object registered before load_checkpoint is
restored; registering one after it is refused naming the fix (it would start fresh without a word); a checkpoint
without a registered object is refused."""

from __future__ import annotations

import pytest
import torch
from multiengine.engines import (
    CheckpointError,
    ConfigError,
    EngineRegistry,
    OptimSpec,
    Placement,
    ShardedBatches,
    trainable_role,
)


def _registry() -> EngineRegistry:
    registry = EngineRegistry(backend="torch", seed=0)
    registry.add(trainable_role("student", lambda: torch.nn.Linear(4, 4), Placement(stage=0, dtype="fp32"),
                                OptimSpec(lr=0.1)))
    return registry.build()


def _batches() -> ShardedBatches:
    return ShardedBatches(list(range(10)), list, batch_size=3)


def test_state_is_registered_before_load_checkpoint_or_refused(tmp_path):
    registry = _registry()
    train = registry.add_state("train", _batches())
    for _ in range(2):
        next(train)
    registry.save_checkpoint(str(tmp_path), client_state={"step": 2})
    saved = train.state_dict()
    assert saved["position"] == 6

    before = _registry()
    restored = before.add_state("train", _batches())
    assert before.load_checkpoint(str(tmp_path))["step"] == 2
    assert restored.state_dict() == saved

    after = _registry()
    after.load_checkpoint(str(tmp_path))
    with pytest.raises(ConfigError, match=r"add_state\('late', \.\.\.\) after load_checkpoint.*register it before"):
        after.add_state("late", _batches())

    extra = _registry()
    extra.add_state("train", _batches())
    extra.add_state("kl", _batches())
    with pytest.raises(CheckpointError, match=r"no state for \['kl'\]"):
        extra.load_checkpoint(str(tmp_path))

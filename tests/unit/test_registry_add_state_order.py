"""What docs/registry-guide.md says about add_state and load_checkpoint, in one process (torch backend):
an object registered before load_checkpoint is restored; one registered after it keeps its fresh state;
a checkpoint without a registered object is refused."""

from __future__ import annotations

import pytest
import torch
from multiengine.engines import CheckpointError, EngineRegistry, OptimSpec, Placement, ShardedBatches, trainable_role


def _registry() -> EngineRegistry:
    registry = EngineRegistry(backend="torch", seed=0)
    registry.add(trainable_role("student", lambda: torch.nn.Linear(4, 4), Placement(stage=0, dtype="fp32"),
                                OptimSpec(lr=0.1)))
    return registry.build()


def _batches() -> ShardedBatches:
    return ShardedBatches(list(range(10)), list, batch_size=3)


def test_add_state_must_come_before_load_checkpoint(tmp_path):
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
    late = after.add_state("train", _batches())
    assert late.state_dict()["position"] == 0  # silently fresh: the reason for the order

    extra = _registry()
    extra.add_state("train", _batches())
    extra.add_state("kl", _batches())
    with pytest.raises(CheckpointError, match=r"no state for \['kl'\]"):
        extra.load_checkpoint(str(tmp_path))

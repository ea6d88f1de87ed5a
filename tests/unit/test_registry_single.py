"""The registry in one process (world size 1): both backends, errors, memory table."""

from __future__ import annotations

import pytest
import torch
from multiengine.engines import (
    ConfigError,
    EngineRegistry,
    RoleSpec,
    UnknownRoleError,
    eval_ds_config,
    train_ds_config,
)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _registry(backend):
    registry = EngineRegistry(backend=backend)
    registry.add(RoleSpec("actor", _mlp, train_ds_config(stage=0, dtype="fp32", micro_batch_size=2),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    registry.add(RoleSpec("ref", _mlp, eval_ds_config(stage=2, dtype="bf16")))
    return registry.build()


@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_same_roles_build_and_train_on_both_backends(backend):
    registry = _registry(backend)
    x = torch.randn(2, 8)
    before = [p.detach().clone() for p in registry["actor"].module.parameters()]
    loss = registry["actor"](x).pow(2).mean()
    registry["actor"].backward(loss)
    registry["actor"].step()
    after = list(registry["actor"].module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    ref = registry.role("ref")
    out = registry["ref"](x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    assert ref.stage == 0 and not ref.module.training
    rows = {r["role"]: r for r in registry.memory_report()}
    assert rows["actor"]["params_total"] == 8 * 16 + 16 + 16 + 1
    assert rows["ref"]["param_bytes"] == rows["ref"]["params_total"] * 2  # bf16
    if backend == "deepspeed":
        assert "stage 2 requested" in ref.note
    assert "actor" in str(registry.memory_report())


def test_unknown_and_duplicate_roles_are_clear_errors():
    registry = _registry("torch")
    with pytest.raises(UnknownRoleError, match="unknown role 'actr'.*Did you mean 'actor'"):
        registry["actr"]
    with pytest.raises(ConfigError, match="role 'actor' was already added"):
        registry.add(RoleSpec("actor", _mlp, eval_ds_config()))


def test_fp16_on_cpu_is_refused_with_the_fix():
    registry = EngineRegistry(backend="deepspeed")
    registry.add(RoleSpec("ref", _mlp, eval_ds_config(dtype="fp16")))
    with pytest.raises(ConfigError, match="fp16.*CPU accelerator has no fp16; use dtype='bf16'"):
        registry.build()


def test_model_factory_must_return_a_module():
    registry = EngineRegistry(backend="torch")
    registry.add(RoleSpec("ref", lambda: "not a model", eval_ds_config()))
    with pytest.raises(ConfigError, match="returned str, not a torch.nn.Module"):
        registry.build()

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


def test_torch_backend_honours_bf16_and_says_what_it_did():
    from multiengine.engines import OptimSpec, Placement, frozen_role, trainable_role

    registry = EngineRegistry(backend="torch")
    registry.add(trainable_role("actor", _mlp, Placement(stage=3, dtype="bf16"), OptimSpec(lr=0.1)))
    registry.add(frozen_role("ref", _mlp, Placement(stage=0, dtype="bf16")))
    registry.build()
    actor, ref = registry.role("actor"), registry.role("ref")
    # trainable: fp32 weights (the optimizer updates them) and a bf16 forward, as DeepSpeed computes it
    assert all(p.dtype == torch.float32 for p in actor.module.parameters())
    out = registry["actor"](torch.randn(2, 8))
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        expected = _mlp().to(torch.bfloat16)(torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).bfloat16())
        got = registry["actor"](torch.randn(2, 8, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(got, expected)  # same rounded weights as a bf16 copy
    # frozen: held in bf16
    assert all(p.dtype == torch.bfloat16 for p in ref.module.parameters())
    rows = {row["role"]: row for row in registry.memory_report()}
    assert rows["actor"]["dtype"] == "float32" and rows["actor"]["compute_dtype"] == "bfloat16"
    assert rows["actor"]["param_bytes"] == sum(p.numel() for p in actor.module.parameters()) * 4
    assert "autocast to bfloat16" in rows["actor"]["note"] and "stage 3 requested" in rows["actor"]["note"]
    assert rows["ref"]["dtype"] == "bfloat16" and rows["ref"]["note"] == ""
    loss = out.float().pow(2).mean()
    registry["actor"].backward(loss)
    registry["actor"].step()
    assert all(p.dtype == torch.float32 for p in actor.module.parameters())


def test_a_registry_built_after_another_was_closed_in_the_same_process_trains():
    """close() tears the process group down; DeepSpeed's cached groups must go with it, or the next registry's
    ZeRO-2 engine is built on a destroyed group ("Group ... is not registered")."""
    for _ in range(2):
        registry = EngineRegistry(backend="deepspeed")
        registry.add(RoleSpec("a", _mlp, train_ds_config(stage=2, dtype="fp32", micro_batch_size=2),
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
        registry.build()
        loss = registry["a"](torch.randn(2, 8)).sum()
        registry["a"].backward(loss)
        registry["a"].step()
        registry.close()
        assert not torch.distributed.is_initialized()

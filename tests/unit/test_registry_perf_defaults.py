"""The factories' performance defaults seen on a built ZeRO-3 role (one process, real DeepSpeed)."""

from __future__ import annotations

import subprocess

import torch
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def test_zero3_roles_leave_f_linear_alone_size_buckets_from_the_role_and_launch_no_subprocess(monkeypatch):
    linear_before = torch.nn.functional.linear
    registry = EngineRegistry(backend="deepspeed")
    registry.add(RoleSpec("actor", _mlp, train_ds_config(stage=3, dtype="fp32", micro_batch_size=2),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    registry.add(RoleSpec("ref", _mlp, eval_ds_config(stage=3, dtype="fp32")))
    registry.build()
    # memory_efficient_linear=false: DeepSpeed did not swap F.linear for the whole process
    assert torch.nn.functional.linear is linear_before
    n = 64 * 256 + 256 + 256 * 64 + 64
    zero = registry.role("actor").config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (n, n)  # capped at the role
    assert zero["stage3_param_persistence_threshold"] == 2560  # 10 x the widest layer
    assert registry.role("ref").config["zero_optimization"]["stage3_prefetch_bucket_size"] == n

    launched = []
    original = subprocess.Popen.__init__

    def record(self, args, *a, **kw):
        launched.append(args)
        original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    x = torch.randn(2, 64)
    for _ in range(2):
        loss = (registry["actor"](x) - registry["ref"](x)).pow(2).mean()
        registry["actor"].backward(loss)
        registry["actor"].step()
    # DeepSpeed's CPU accelerator would run `numactl --hardware` once per reduced gradient bucket
    # without LOCAL_SIZE (only DeepSpeed's own launcher exports it; the registry sets it).
    assert launched == []

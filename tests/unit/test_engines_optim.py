"""build_optimizer: names, hyper-parameters, DeepSpeed's Adam against torch's AdamW, clear errors."""

from __future__ import annotations

import pytest
import torch
from multiengine.engines import ConfigError, OptimSpec
from multiengine.engines.optim import OPTIMIZERS, build_optimizer, ds_adam_kind


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 5, generator=g)), torch.nn.Parameter(torch.randn(11, generator=g))]


def _run(optimizer, params, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_adamw_and_sgd_are_torch_optimizers_with_the_given_hyper_parameters():
    opt = build_optimizer("adamw", _params(), lr=3e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.9), 1e-6, 0.1)
    sgd = build_optimizer("sgd", _params(), lr=0.5, weight_decay=0.01)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["lr"] == 0.5
    assert set(OPTIMIZERS) == {"adamw", "ds_adam", "sgd"}


def test_ds_adam_on_the_cpu_is_deepspeeds_cpu_adam_and_steps_like_torch_adamw():
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert ds_adam_kind(offload=True) == "cpu_adam"
    assert ds_adam_kind(offload=False) == "cpu_adam"  # DeepSpeed's CPU accelerator here
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ds_params, torch_params = _params(), _params()
    ds = build_optimizer("ds_adam", ds_params, **kwargs)
    assert isinstance(ds, DeepSpeedCPUAdam) and ds.adam_w_mode
    ours, theirs = _run(ds, ds_params), _run(build_optimizer("adamw", torch_params, **kwargs), torch_params)
    start = _params()
    for a, b, s in zip(ours, theirs, start):
        assert (a - s).abs().max() > 1e-3  # the weights really moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # decoupled weight decay, bias correction


@pytest.mark.parametrize("kwargs, fragment", [
    ({"name": "adam"}, "optimizer name='adam' is not known; use one of \\['adamw', 'ds_adam', 'sgd'\\]"),
    ({"offload": True}, "offload_optimizer=True.*use optimizer 'ds_adam'"),
])
def test_bad_arguments_are_errors_naming_them(kwargs, fragment):
    args = {"name": "adamw", "lr": 1e-3} | kwargs
    name, lr = args.pop("name"), args.pop("lr")
    with pytest.raises(ValueError, match=fragment):
        build_optimizer(name, _params(), lr=lr, **args)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"lr": -1.0}, "lr=-1.0 must be > 0; fix: set lr to a value that is > 0"),
    ({"lr": 0.0}, "lr=0.0 must be > 0"),  # the bound of the recipe key roles.<name>.lr, checked by the same Range
    ({"betas": (0.9, 1.0)}, "betas=\\(0.9, 1.0\\) item 1 \\(1.0\\) must be in \\[0, 1\\)"),
    ({"eps": -1.0}, "eps=-1.0 must be > 0"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1 must be >= 0"),
    ({"max_grad_norm": True}, "max_grad_norm=True must be a number >= 0"),
])
def test_the_optimizer_settings_are_checked_where_they_are_set(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        OptimSpec(**kwargs)

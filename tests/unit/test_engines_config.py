"""Config factories, "auto" resolution and validation: plain dicts, asserted on directly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from multiengine.engines import (
    ConfigError,
    OptimSpec,
    RoleSpec,
    eval_ds_config,
    load_ds_config,
    model_hidden_size,
    train_ds_config,
)
from multiengine.engines.config import (
    DS_DEFAULT_BUCKETS,
    auto_bucket_sizes,
    find_auto,
    model_param_counts,
    resolve_batch_keys,
    resolve_bucket_sizes,
    validate_ds_config,
)
from multiengine.engines.dist import export_local_size


def test_train_config_is_a_plain_dict_with_the_requested_stage():
    cfg = train_ds_config(stage=3, dtype="bf16", micro_batch_size=4, grad_accum=2, offload_optimizer=True)
    assert type(cfg) is dict
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert cfg["zero_optimization"]["offload_param"] == {"device": "none"}
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 1.0
    json.dumps(cfg)  # serialisable as a DeepSpeed JSON


@pytest.mark.parametrize("off", [0, 0.0])
def test_clipping_off_and_gradient_averaging_are_written_not_left_to_deepspeed_defaults(off):
    cfg = train_ds_config(stage=2, dtype="fp16", gradient_clipping=off)
    assert cfg["gradient_clipping"] == 0.0 and type(cfg["gradient_clipping"]) is float
    assert cfg["prescale_gradients"] is False and cfg["gradient_predivide_factor"] == 1.0
    assert cfg["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                           "hysteresis": 2, "min_loss_scale": 1}


@pytest.mark.parametrize("bad", [None, -1.0, True, "1.0"])
def test_no_clipping_is_spelled_one_way(bad):
    with pytest.raises(ConfigError, match="0.0 = no clipping"):
        train_ds_config(gradient_clipping=bad)
    with pytest.raises(ConfigError, match="max_grad_norm=.*0.0 = no clipping"):
        OptimSpec(max_grad_norm=bad)


def test_scheduler_names_checked_without_transformers_are_transformers_names():
    from multiengine.engines.settings import SCHEDULERS
    from transformers import SchedulerType

    assert SCHEDULERS <= {s.value for s in SchedulerType}
    with pytest.raises(ConfigError, match="scheduler='cosin' must be a transformers scheduler name .*did you mean "
                                          "scheduler=cosine"):
        OptimSpec(scheduler="cosin")


@pytest.mark.parametrize("name", ["constant", "constant_with_warmup", "linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 7), (3, 10), (5, 5), (10, 4)])
def test_schedules_built_without_transformers_equal_transformers_step_for_step(name, warmup, total):
    from transformers import get_scheduler

    ours, theirs = (torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5) for _ in range(2))
    ours_s = OptimSpec(scheduler=name, warmup_steps=warmup, total_steps=total).scheduler_factory()(ours)
    theirs_s = get_scheduler(name, theirs, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(total + 3):
        assert ours_s.get_last_lr() == theirs_s.get_last_lr()  # bit for bit, past the end too
        ours.step(), theirs.step(), ours_s.step(), theirs_s.step()
    assert ours_s.state_dict() == theirs_s.state_dict()  # a checkpoint of either resumes the other


def test_eval_config_has_batch_keys_and_no_optimizer_sections():
    cfg = eval_ds_config(stage=3, dtype="fp32", offload_params=True)
    assert cfg["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert "offload_optimizer" not in cfg["zero_optimization"]
    assert "reduce_bucket_size" not in cfg["zero_optimization"]
    assert "optimizer" not in cfg and "gradient_clipping" not in cfg
    assert {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"} <= set(cfg)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"stage": 4}, "stage=4"),
    ({"dtype": "float16"}, "dtype='float16'"),
    ({"stage": 2, "offload_params": True}, "offload_params=True needs stage=3"),
    ({"stage": 0, "offload_optimizer": True}, "offload_optimizer=True needs"),
])
def test_factory_rejects_bad_values_naming_them(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        train_ds_config(**kwargs)


@pytest.mark.parametrize("micro, gas, tbs, dp, expected", [
    ("auto", "auto", "auto", 2, (2, 1, 1)),
    (4, 2, "auto", 2, (16, 4, 2)),
    ("auto", 2, 16, 2, (16, 4, 2)),
    (4, "auto", 16, 2, (16, 4, 2)),
    (3, 1, "auto", 4, (12, 3, 1)),
])
def test_batch_keys_resolve_per_role(micro, gas, tbs, dp, expected):
    cfg = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    resolve_batch_keys("actor", cfg, dp)
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    assert tuple(cfg[k] for k in keys) == expected


def test_batch_keys_that_cannot_be_met_are_errors_not_corrections():
    cfg = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}
    with pytest.raises(ConfigError, match="role 'actor': train_batch_size=10 is not divisible"):
        resolve_batch_keys("actor", cfg, 2)
    cfg = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    with pytest.raises(ConfigError, match="!= train_micro_batch_size_per_gpu=4"):
        resolve_batch_keys("actor", cfg, 2)
    with pytest.raises(ConfigError, match="must be a positive integer"):
        resolve_batch_keys("x", {"train_micro_batch_size_per_gpu": 0}, 1)


def test_bucket_sizes_are_deepspeed_defaults_capped_at_the_role_size():
    # the tiny OPT of the RLHF benchmark: all gradients in one reduce-scatter, one prefetch of everything
    cfg = train_ds_config(stage=3)
    resolve_bucket_sizes(cfg, 64, num_params=165_760, trainable_params=165_760)
    zero = cfg["zero_optimization"]
    assert zero["reduce_bucket_size"] == 165_760
    assert zero["stage3_prefetch_bucket_size"] == 165_760
    assert zero["stage3_param_persistence_threshold"] == 640  # 10 h: the 64 x 64 weights stay sharded
    # a 7B model: DeepSpeed's defaults, persistence 10 h as transformers has it
    assert auto_bucket_sizes(4096, 7_000_000_000, 7_000_000_000) == {
        "reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 40_960}
    # LoRA on it: one bucket holds every trainable gradient
    assert auto_bucket_sizes(4096, 7_000_000_000, 4_000_000)["reduce_bucket_size"] == 4_000_000
    # a model smaller than h^2 (widest layer 256, 33k parameters): never a bucket larger than the role
    assert auto_bucket_sizes(256, 33_088, 33_088)["reduce_bucket_size"] == 33_088
    # very wide: buckets h^2 / 0.9 h^2 when above DeepSpeed's defaults
    wide = auto_bucket_sizes(30_000, 10**11, 10**11)
    assert wide["reduce_bucket_size"] == 30_000**2 and wide["stage3_prefetch_bucket_size"] == int(0.9 * 30_000**2)
    # frozen role: no reduce key, the prefetch cap follows all parameters
    cfg = eval_ds_config(stage=3)
    resolve_bucket_sizes(cfg, 64, num_params=165_760)
    assert "reduce_bucket_size" not in cfg["zero_optimization"]
    assert cfg["zero_optimization"]["stage3_prefetch_bucket_size"] == 165_760
    # no width and no sizes: DeepSpeed's defaults
    cfg = train_ds_config(stage=3)
    resolve_bucket_sizes(cfg, None)
    assert {k: cfg["zero_optimization"][k] for k in DS_DEFAULT_BUCKETS} == DS_DEFAULT_BUCKETS
    assert find_auto(cfg) == ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]


def test_overlap_comm_is_on_only_where_the_accelerator_has_streams():
    cfg = train_ds_config(stage=3)
    assert cfg["zero_optimization"]["overlap_comm"] == "auto"
    gpu, cpu = train_ds_config(stage=2), train_ds_config(stage=2)
    resolve_bucket_sizes(gpu, 64, num_params=100, trainable_params=100, device_name="cuda")
    resolve_bucket_sizes(cpu, 64, num_params=100, trainable_params=100, device_name="cpu")
    assert gpu["zero_optimization"]["overlap_comm"] is True and cpu["zero_optimization"]["overlap_comm"] is False
    resolve_bucket_sizes(cfg, 64)  # detected: DeepSpeed's CPU accelerator on this machine
    assert cfg["zero_optimization"]["overlap_comm"] is False
    assert "overlap_comm" not in eval_ds_config(stage=3)["zero_optimization"]  # frozen roles reduce nothing


def test_explicit_bucket_sizes_are_kept():
    cfg = train_ds_config(stage=3)
    cfg["zero_optimization"].update(reduce_bucket_size=1234, overlap_comm=True)
    resolve_bucket_sizes(cfg, 64, num_params=165_760, trainable_params=165_760, device_name="cpu")
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1234 and cfg["zero_optimization"]["overlap_comm"] is True


def test_memory_efficient_linear_is_off_for_every_zero3_role():
    # true would make DeepSpeed replace F.linear for the whole process at the first ZeRO-3 build
    assert train_ds_config(stage=3)["zero_optimization"]["memory_efficient_linear"] is False
    assert eval_ds_config(stage=3)["zero_optimization"]["memory_efficient_linear"] is False
    assert "memory_efficient_linear" not in train_ds_config(stage=2)["zero_optimization"]
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(**train_ds_config(stage=3)["zero_optimization"] | {
        "stage3_param_persistence_threshold": 1, "stage3_prefetch_bucket_size": 1, "reduce_bucket_size": 1,
    }).memory_efficient_linear is False


def test_param_counts_see_whole_sizes_and_trainable_subset():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    assert model_param_counts(model) == (4 * 8 + 8 + 8 * 2 + 2, 8 * 2 + 2)


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, "2"),  # torchrun, accelerate
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "8"}, "4"),  # mpirun
    ({}, "1"),  # plain python
    ({"WORLD_SIZE": "4"}, None),  # unknown: leave DeepSpeed to find out
    ({"LOCAL_SIZE": "3", "LOCAL_WORLD_SIZE": "2"}, "3"),  # DeepSpeed's launcher already set it
])
def test_local_size_is_exported_from_the_launchers_variables(monkeypatch, env, expected):
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    export_local_size()
    assert os.environ.get("LOCAL_SIZE") == expected


def test_hidden_size_comes_from_config_or_widest_layer():
    class WithConfig(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"hidden_size": 96})()

    conv = torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3), torch.nn.Conv2d(32, 128, 3), torch.nn.Linear(128, 8))
    assert model_hidden_size(WithConfig()) == 96
    assert model_hidden_size(conv) == 128  # a UNet has no hidden_size; accelerate's "auto" fails there
    assert model_hidden_size(torch.nn.ReLU()) is None


def test_unknown_keys_are_rejected_with_a_suggestion():
    cfg = train_ds_config(stage=3)
    cfg["gradient_acumulation_steps"] = 2
    with pytest.raises(ConfigError, match="role 'actor': unknown DeepSpeed config key 'gradient_acumulation_steps'"
                                          ".*Did you mean 'gradient_accumulation_steps'"):
        validate_ds_config("actor", cfg)
    cfg = train_ds_config(stage=3)
    cfg["zero_optimization"]["stage3_prefetch_bucket"] = 10
    with pytest.raises(ConfigError, match="zero_optimization.stage3_prefetch_bucket'.*stage3_prefetch_bucket_size"):
        validate_ds_config("actor", cfg)
    bad = eval_ds_config()
    bad["fp16"] = {"enabled": True}
    with pytest.raises(ConfigError, match="both true"):
        validate_ds_config("ref", bad)


def test_a_full_deepspeed_json_is_accepted(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}))
    cfg = load_ds_config(str(path))
    validate_ds_config("actor", cfg)
    assert cfg["zero_optimization"]["stage"] == 2
    with pytest.raises(ConfigError, match="neither a dict nor an existing JSON file"):
        load_ds_config(str(tmp_path / "missing.json"))


def _model():
    return torch.nn.Linear(2, 2)


def test_role_spec_requires_optimizer_exactly_for_trainable_roles():
    assert RoleSpec("actor", _model, train_ds_config(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).trainable
    assert not RoleSpec("ref", _model, eval_ds_config()).trainable
    with pytest.raises(ConfigError, match="role 'actor': trainable=True but no optimizer"):
        RoleSpec("actor", _model, train_ds_config(), trainable=True)
    with pytest.raises(ConfigError, match="role 'ref': trainable=False but an optimizer was given"):
        RoleSpec("ref", _model, eval_ds_config(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), trainable=False)
    with pytest.raises(ConfigError, match="must be an identifier"):
        RoleSpec("my role", _model, eval_ds_config())
    with pytest.raises(ConfigError, match="lr_scheduler given for a frozen role"):
        RoleSpec("ref", _model, eval_ds_config(), lr_scheduler=lambda o: None)

"""Non-finite losses and gradients in one process: the registry's guard (no update is ever applied with a
NaN/inf loss or gradient norm, on either backend, at any stage) and the lifecycle's `nonfinite` policy
(stop: NonFiniteError with nothing exported and the last checkpoint kept; skip: counted up to max_skips).
The same on 2 ranks, through the CLI, is in tests/distributed/test_faults.py."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from multiengine.engines import (
    EngineRegistry,
    NonFiniteError,
    OptimSpec,
    Placement,
    latest_tag,
    mean_over_ranks,
    save_role,
    trainable_role,
)
from multiengine.engines.settings import setting
from multiengine.recipes.language.lifecycle import CheckpointSettings, NonfiniteSettings, Recipe, RunConfig


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _weights(registry, name):
    with registry.gathered(name):
        return torch.cat([p.detach().float().flatten().clone() for p in registry.role(name).module.parameters()])


def _exp_avg(registry, name):
    """The torch optimizer's first moments (plain optimizers only), to show the skipped step left them."""
    state = registry[name].optimizer.state
    return [state[p]["exp_avg"].clone() for p in registry.role(name).module.parameters() if p in state]


PLACEMENTS = [("torch", 0, "fp32"), ("deepspeed", 0, "fp32"), ("deepspeed", 2, "bf16"), ("deepspeed", 3, "fp32")]


@pytest.mark.parametrize(("backend", "stage", "dtype"), PLACEMENTS)
@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_a_non_finite_update_is_skipped_whole(backend, stage, dtype, fault):
    registry = EngineRegistry(backend=backend, seed=0)
    registry.add(trainable_role("actor", _mlp, Placement(stage=stage, dtype=dtype),
                                OptimSpec(name="adamw", lr=1e-2, scheduler="linear", total_steps=10),
                                micro_batch_size=2, grad_accum=2))
    registry.build()
    engine = registry["actor"]
    x_dtype = torch.bfloat16 if dtype == "bf16" and backend == "deepspeed" else torch.float32
    hooks = []

    def step(bad: bool) -> None:
        for micro in range(2):
            loss = engine(torch.randn(2, 8).to(x_dtype)).float().pow(2).mean()
            if bad and micro == 1:
                if fault == "nan_loss":
                    loss = loss * float("nan")
                else:  # a finite loss whose gradients overflow
                    param = next(iter(registry.role("actor").module.parameters()))
                    hooks.append(param.register_hook(lambda g: g * float("inf")))
            engine.backward(loss)
            for h in hooks:
                h.remove()
            hooks.clear()
            engine.step()

    step(False)
    assert registry.nonfinite_updates() == []
    weights, lr = _weights(registry, "actor"), engine.get_lr()[0]
    moments = _exp_avg(registry, "actor") if stage == 0 else None
    step(True)
    events = registry.nonfinite_updates()
    assert [e.role for e in events] == ["actor"] and events[0].step == 2
    assert events[0].grad_norm is not None and not math.isfinite(events[0].grad_norm)
    assert torch.equal(_weights(registry, "actor"), weights)  # no update, bit for bit
    assert engine.get_lr()[0] == lr  # the scheduler did not advance
    if moments is not None:
        assert all(torch.equal(a, b) for a, b in zip(_exp_avg(registry, "actor"), moments))
    assert registry.nonfinite_updates() == []  # handed over once
    step(False)  # and training goes on from there
    after = _weights(registry, "actor")
    assert torch.isfinite(after).all() and not torch.equal(after, weights)
    assert engine.get_lr()[0] < lr


def test_a_joint_backward_notes_the_loss_for_every_role():
    registry = EngineRegistry(backend="torch", seed=0)
    for name in ("a", "b"):
        registry.add(trainable_role(name, _mlp, Placement(stage=0, dtype="fp32"), OptimSpec(name="sgd", lr=0.1),
                                    micro_batch_size=2))
    registry.build()
    before = {n: _weights(registry, n) for n in ("a", "b")}
    x = torch.randn(2, 8)
    loss = (registry["a"](x) + registry["b"](x)).mean() * float("nan")
    registry.backward(loss, ["a", "b"])
    registry.step(["a", "b"])
    assert sorted(e.role for e in registry.nonfinite_updates()) == ["a", "b"]
    assert all(torch.equal(_weights(registry, n), before[n]) for n in ("a", "b"))


# --- the lifecycle's policy --------------------------------------------------------------------------
@dataclass(frozen=True)
class _ToyConfig(RunConfig):
    nan_at: list[int] = setting([], "the steps whose loss is NaN")


class _Toy(Recipe):
    name = "toy"
    Config = _ToyConfig

    def build(self) -> None:
        self.registry.add(trainable_role("actor", _mlp, Placement(stage=0, dtype="fp32"),
                                         OptimSpec(name="adamw", lr=1e-2), micro_batch_size=2))
        self.registry.build()
        self.exported = False

    def train_step(self) -> dict[str, float]:
        engine = self.registry["actor"]
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        if self.step + 1 in self.cfg.nan_at:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        return mean_over_ranks({"loss": loss.item()})

    def export(self):
        self.exported = True
        return {"actor": save_role(self.registry, "actor", self.path("export", "actor"))["model"]}


def _cfg(tmp_path, nonfinite=None, **values):
    return _ToyConfig(output_dir=str(tmp_path / "run"), max_steps=4, backend="torch", tensorboard=False, plot=False,
                      checkpoint=CheckpointSettings(every=1, keep_last=5),
                      nonfinite=NonfiniteSettings(**nonfinite or {}), **values)


def _lines(tmp_path):
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_common_defaults_stop_on_the_first_non_finite_step():
    assert RunConfig().nonfinite == NonfiniteSettings(policy="stop", max_skips=10)
    assert RunConfig().trust_remote_code is False


def test_policy_stop_keeps_the_last_checkpoint_and_exports_nothing(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        _Toy.main(_cfg(tmp_path, nan_at=[3]))
    msg = str(info.value)
    assert msg.startswith("step 3: non-finite values (loss=nan; role 'actor': non-finite loss and gradient norm")
    assert "nonfinite.policy=stop" in msg and "step_00000002, is kept as it was" in msg
    assert "resume_from=latest" in info.value.fix and "nonfinite.policy=skip" in info.value.fix
    assert latest_tag(str(tmp_path / "run" / "checkpoints")) == "step_00000002"
    assert not (tmp_path / "run" / "export").exists() and not (tmp_path / "run" / "summary.json").exists()
    lines = _lines(tmp_path)  # valid JSON: the NaN loss is null
    assert [x["step"] for x in lines] == [1, 2, 3] and lines[2]["train/loss"] is None
    assert lines[2]["train/nonfinite_skips"] == 1.0


def test_policy_skip_goes_on_then_stops_after_max_skips(tmp_path):
    result = _Toy.main(_cfg(tmp_path, nan_at=[2], nonfinite={"policy": "skip", "max_skips": 1}))
    assert result["export"]["actor"].endswith("export/actor")
    lines = _lines(tmp_path)
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert lines[0].get("train/nonfinite_skips") is None and lines[1]["train/loss"] is None
    assert [x["train/nonfinite_skips"] for x in lines[1:]] == [1.0, 1.0, 1.0]
    assert all(math.isfinite(x["train/loss"]) for x in (lines[0], *lines[2:]))

    with pytest.raises(NonFiniteError, match=r"step 3: .*more than nonfinite.max_skips=1 steps were skipped"):
        _Toy.main(_cfg(tmp_path / "again", nan_at=[2, 3], nonfinite={"policy": "skip", "max_skips": 1}))
    assert not (tmp_path / "again" / "run" / "export").exists()


def test_the_skip_count_survives_a_resume(tmp_path):
    with pytest.raises(NonFiniteError):
        _Toy.main(_cfg(tmp_path, nan_at=[2, 4], nonfinite={"policy": "skip", "max_skips": 1}))
    # resumed from step 3's checkpoint: one skip is already spent, so the next one stops the run again
    with pytest.raises(NonFiniteError, match="step 4: "):
        _Toy.main(_cfg(tmp_path, nan_at=[4], resume_from="latest", nonfinite={"policy": "skip", "max_skips": 1}))

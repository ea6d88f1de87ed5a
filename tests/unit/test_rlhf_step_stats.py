"""One reduction of a step's statistics (StepStats), and how many all-reduces an RLHF step makes (torch backend,
a world of one: every collective still runs through the process group, so the profiler counts them)."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, global_moments, trainable_role
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.rewards import reward_function
from multiengine.pipelines.rlhf.rollout import RolloutSpec, StepStats, rollout_metrics, step_timings
from toys import ppo_registry


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("step_stats_assets")
    paths = tiny.prepare_builtin(root, hidden=32, layers=1, n_sft=8, n_reward=8, n_ppo=16, n_eval=4)
    return {**paths, "tok": tiny.train_tokenizer(tiny.task_vocabulary(), paths["tokenizer"])}


def _collectives(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))


def test_step_stats_values():
    x = torch.tensor([1.0, 2.0, 4.0, 9.0])
    stats = StepStats()
    stats.moments("m", "s", x)
    stats.mean("half", x[:2])
    stats.add("ratio", [3.0, 4.0], lambda a, b: a / b)
    out = stats.reduce()
    assert out["m"] == pytest.approx(4.0) and out["s"] == pytest.approx(math.sqrt(9.5))  # population std
    assert out["half"] == pytest.approx(1.5) and out["ratio"] == 0.75
    assert StepStats().reduce() == {}


def _ppo(assets):
    from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer

    tok = assets["tok"]
    registry = ppo_registry(str(assets["model"]))
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id,
                       decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True), judge=tiny.judge,
                       critic="critic")
    with pytest.raises(ValueError, match="ema_decay=0.9 and the registry's roles"):
        PPOTrainer(registry, PPOSettings(rollout_batch_size=4), spec, 2, ema_decay=0.9)  # no ema role
    trainer = PPOTrainer(registry, PPOSettings(rollout_batch_size=4, epochs=1), spec, micro_batch_size=2)
    rows = load_rlhf_dataset(assets["data"], "ppo")
    return trainer, PromptCollator(tok, 16)([rows[i] for i in range(4)])


def test_ppo_step_reduces_all_its_metrics_at_once(assets):
    trainer, batch = _ppo(assets)
    trainer.step(batch, 0)
    metrics, counts = _collectives(lambda: trainer.step(batch, 1))
    # advantage whitening, every loss denominator (2 mini-batches x actor and critic), every metric: one
    # all-reduce each (13 when each metric, denominator and the token count had their own)
    assert counts == {"c10d::allreduce_": 3}
    for key in ("reward/mean", "reward/std", "kl", "reward/total_mean", "values/mean", "judge/mean",
                "response_length", "policy_loss", "value_loss", "entropy", "clip_frac", "gen/tokens_per_s",
                "time/step_s", "kl_coef"):
        assert math.isfinite(metrics[key]), key


def test_rollout_metrics_alone_or_with_the_step(assets):
    trainer, batch = _ppo(assets)
    exp = trainer.make_experience(batch, 0)
    alone, counts = _collectives(lambda: rollout_metrics(exp, tiny.judge))
    assert counts == {"c10d::allreduce_": 1}
    mask = exp.action_mask.float()
    assert alone["reward/mean"] == pytest.approx(global_moments(exp.score)[0])
    assert alone["reward/std"] == pytest.approx(global_moments(exp.score)[1])
    assert alone["response_length"] == pytest.approx(float(mask.sum(-1).mean()))
    stats = StepStats()
    assert rollout_metrics(exp, tiny.judge, stats) == {}
    timings = step_timings(exp, 0.5, 2.0, stats)
    assert "gen/tokens_per_s" not in timings and timings["time/train_s"] == 0.5
    joint = stats.reduce()
    assert {k: joint[k] for k in alone} == alone
    assert joint["gen/tokens_per_s"] == pytest.approx(float(mask.sum()) / exp.timings["generation_s"])


def test_grpo_step_reduces_all_its_metrics_at_once(assets):
    from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
    from multiengine.pipelines.rlhf.roles import causal_lm

    tok = assets["tok"]
    registry = EngineRegistry(backend="torch")
    model = str(assets["model"])
    registry.add(trainable_role("actor", causal_lm(model), Placement(0, "fp32"), OptimSpec(lr=1e-2, total_steps=4),
                                micro_batch_size=4))
    registry.add(frozen_role("ref", causal_lm(model), Placement(0, "fp32")))
    registry.build()
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id,
                       [reward_function("builtin:judge")], lambda ids: tok.batch_decode(ids, skip_special_tokens=True),
                       judge=tiny.judge)
    trainer = GRPOTrainer(registry, GRPOSettings(n_samples_per_prompt=4, rollout_batch_size=2), spec, 4)
    rows = load_rlhf_dataset(assets["data"], "ppo")
    batch = PromptCollator(tok, 16)([rows[i] for i in range(2)])
    trainer.step(batch, 0)
    metrics, counts = _collectives(lambda: trainer.step(batch, 1))
    assert counts == {"c10d::allreduce_": 2}  # the loss denominators (2 mini-batches), every metric
    for key in ("reward/mean", "reward/group_std", "reward/flat_groups", "kl", "judge/mean", "policy_loss",
                "kl_loss", "gen/tokens_per_s"):
        assert math.isfinite(metrics[key]), key

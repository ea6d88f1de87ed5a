"""The variant settings of GRPOSettings (DAPO/GSPO losses, overlong penalty, dynamic sampling, multi-turn
environments): refused when wrong (field checks, ``when``, the section's check, and the env rules across sections),
the defaults unchanged, and the trainer paths they switch on, in one process on the torch backend (a world of one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, trainable_role
from multiengine.engines.settings import FieldError, SettingsError
from multiengine.pipelines.rlhf import multiturn, tiny
from multiengine.pipelines.rlhf.data import PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
from multiengine.pipelines.rlhf.rewards import reward_function
from multiengine.pipelines.rlhf.roles import causal_lm
from multiengine.pipelines.rlhf.rollout import Experience, RolloutSpec, concat_experiences
from multiengine.recipes.language.config import RecipeConfigError, checked_config


@pytest.mark.parametrize("values, message", [
    ({"loss_aggregation": "dapo"}, "loss_aggregation='dapo' must be one of"),
    ({"clip_high": "wide"}, "clip_high='wide' must be a number"),
    ({"clip_low": 1.5}, r"clip_low=1.5 must be in \[0, 1\)"),
    ({"clip_high": -0.1}, "clip_high=-0.1 must be >= 0"),
    ({"importance_level": "row"}, "importance_level='row' must be one of token, sequence"),
    ({"max_resample_rounds": 2}, "max_resample_rounds=2 applies only when dynamic_sampling is set"),
    ({"dynamic_sampling": True, "max_resample_rounds": 0}, "max_resample_rounds=0 must be >= 1"),
    ({"overlong_penalty": 0.5}, "overlong_penalty=0.5 applies only when overlong_buffer is set"),
    ({"env": "builtin:chess"}, "env='builtin:chess' must be .*builtin:arithmetic or module:factory"),
    ({"env": "builtin:arithmetic", "overlong_buffer": 2}, "overlong_buffer=2 applies only while env is empty"),
    ({"env": "builtin:arithmetic", "no_eos_penalty": 1.0}, "no_eos_penalty=1.0 applies only while env is empty"),
    ({"env": "builtin:arithmetic", "max_turns": 0}, "max_turns=0 must be >= 1"),
    ({"max_total_tokens": 64}, "max_total_tokens=64 applies only when env is set"),
])
def test_bad_variant_settings_are_refused(values, message):
    with pytest.raises(FieldError, match=message):
        GRPOSettings(**values)


def test_env_settings_of_other_sections_are_refused():
    with pytest.raises(SettingsError, match="grpo.env' scores episodes with the environment's reward alone"):
        multiturn.check_env_settings("builtin:arithmetic", True, "gather")
    with pytest.raises(SettingsError, match="generation.mode' cannot run grpo.env.*fix: use generation.mode=gather"):
        multiturn.check_env_settings("builtin:arithmetic", False, "per_token")
    with pytest.raises(SettingsError, match="grpo.env' cannot be loaded.*cannot import"):
        multiturn.check_env_settings("no_such_module_here:make", False, "gather")
    multiturn.check_env_settings("builtin:arithmetic", False, "gather")


@pytest.mark.parametrize("config, overrides, message", [
    ("tiny", ["grpo.loss_agg=token_mean"], "'grpo.loss_agg' .* is now 'grpo.loss_aggregation'"),
    ("tiny", ["grpo.overlong_buffer=9"], "'grpo.overlong_buffer' exceeds generation.max_new_tokens=8"),
    ("tiny", ["grpo.env=builtin:arithmetic"], "'grpo.env' .* environment's reward alone.*reward.functions=\\[\\]"),
    ("tiny_multiturn", ["generation.mode=per_token"], "'generation.mode' cannot run grpo.env.*gather"),
    ("tiny_multiturn", ["grpo.overlong_buffer=2"], "'grpo.overlong_buffer' .* applies only while grpo.env is empty"),
    ("tiny", ["grpo.rollout_batch_size=3"], "'grpo.rollout_batch_size' .* = 24 rows per rank is not a multiple of "
                                            "roles.actor.micro_batch_size=32"),
    ("tiny", ["roles.actor.micro_batch_size=16", "roles.actor.grad_accum=3"],
     "'roles.actor.grad_accum' does not divide the 4 minibatches"),
])
def test_rules_across_sections_are_refused_by_the_recipe(config, overrides, message):
    with pytest.raises(RecipeConfigError, match=message):
        checked_config("rlhf_grpo", config, overrides)


def test_the_recipe_hands_its_grpo_section_on_whole():
    cfg = checked_config("rlhf_grpo", "tiny", ["grpo.loss_aggregation=token_mean", "grpo.clip_high=0.28",
                                               "grpo.dynamic_sampling=true", "grpo.max_resample_rounds=2"])
    assert isinstance(cfg.grpo, GRPOSettings) and (cfg.grpo.aggregation, cfg.grpo.objective) == ("token_mean", "dapo")
    assert cfg.grpo.max_resample_rounds == 2


def test_defaults_keep_the_plain_grpo_objective_and_the_variant_keys_change_it():
    s = GRPOSettings()
    assert (s.objective, s.aggregation, s.kl_loss_coef, s.resolved_kl_in_reward) == (
        "ppo", "seq_mean_token_mean", 0.04, False)
    s = GRPOSettings(loss_aggregation="token_mean", clip_high=0.28, dynamic_sampling=True, max_resample_rounds=2,
                     overlong_buffer=3, overlong_penalty=0.5)
    assert (s.aggregation, s.objective) == ("token_mean", "dapo")
    assert GRPOSettings(importance_level="sequence").objective == "gspo"


def _exp(C: int, T: int, rows: int, pad: int = 0) -> Experience:
    seq = torch.arange(rows * (C + T)).reshape(rows, C + T) + 1
    mask = torch.ones(rows, T, dtype=torch.bool)
    return Experience(sequences=seq, attention_mask=torch.ones_like(seq), context_length=C, action_mask=mask,
                      logprobs=-mask.float(), score=torch.arange(rows).float(), prompts=["p"] * rows,
                      responses=["r"] * rows, timings={"generation_s": 1.0})


def test_concat_experiences_pads_prompts_left_and_responses_right():
    a, b = _exp(2, 3, 2), _exp(4, 1, 2)
    out = concat_experiences([a, b], pad_token_id=0, group_size=2)
    assert out.context_length == 4 and out.sequences.shape == (4, 7) and out.group_size == 2
    assert torch.equal(out.sequences[0], torch.tensor([0, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(out.attention_mask[0], torch.tensor([0, 0, 1, 1, 1, 1, 1]))
    assert torch.equal(out.sequences[2], torch.cat([b.sequences[0], torch.zeros(2, dtype=torch.long)]))
    assert torch.equal(out.action_mask[2], torch.tensor([True, False, False]))
    assert out.logprobs[2].tolist() == [-1.0, 0.0, 0.0] and out.score.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert out.timings["generation_s"] == 2.0 and len(out.prompts) == 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_variant_assets")
    paths = tiny.prepare_builtin(root, hidden=32, layers=1, n_sft=8, n_reward=8, n_ppo=16, n_eval=4)
    return {**paths, "tok": tiny.train_tokenizer(tiny.task_vocabulary(), paths["tokenizer"])}


def _registry(model: str, micro: int = 4, accum: int = 1) -> EngineRegistry:
    registry = EngineRegistry(backend="torch")
    registry.add(trainable_role("actor", causal_lm(model), Placement(0, "fp32"), OptimSpec(lr=1e-2, total_steps=8),
                                micro_batch_size=micro, grad_accum=accum))
    registry.add(frozen_role("ref", causal_lm(model), Placement(0, "fp32")))
    return registry.build()


def test_dynamic_sampling_keeps_groups_with_a_spread_and_its_state_resumes(assets):
    tok = assets["tok"]
    registry = _registry(assets["model"])
    rows = load_rlhf_dataset(assets["data"], "ppo")
    collate = PromptCollator(tok, 16)
    stream = iter([collate([rows[i], rows[i + 1]]) for i in range(2, 16, 2)])
    # reward: 1 for the first sample of a group, 0 otherwise, except groups of the prompt set to all-equal below
    calls = []

    def reward(prompts, completions, **kw):
        calls.append(len(prompts))
        flat = len(calls) == 1  # the first round's groups are flat: all dropped
        return [0.0 if flat else float(i % 2 == 0) for i in range(len(prompts))]

    settings = GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=2, dynamic_sampling=True,
                            max_resample_rounds=3, clip_high=0.28, loss_aggregation="token_mean")
    decode = lambda ids: tok.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    spec = RolloutSpec(GenerationSettings(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id,
                       [reward_function(reward)], decode)
    trainer = GRPOTrainer(registry, settings, spec, 4, more_prompts=lambda: next(stream))
    metrics = trainer.step(collate([rows[0], rows[1]]), step=0)
    assert calls == [4, 4]  # a second round, with new prompts, filled the batch
    assert metrics["dynamic/rounds"] == 2 and metrics["dynamic/dropped_rate"] == 0.5
    assert metrics["reward/flat_groups"] == 0.0 and metrics["reward/mean"] == 0.5
    for key in ("clip_low_frac", "clip_high_frac"):
        assert 0.0 <= metrics[key] <= 1.0
    state = trainer.state_dict()["dynamic"]
    assert state["totals"] == {"steps": 1, "rounds": 2, "groups": 4, "dropped": 2, "filled": 0}
    again = GRPOTrainer(registry, settings, spec, 4)
    again.load_state_dict(trainer.state_dict())
    assert again.sampler.totals == trainer.sampler.totals


def test_overlong_penalty_is_added_to_the_score(assets):
    tok = assets["tok"]
    registry = _registry(assets["model"])
    rows = load_rlhf_dataset(assets["data"], "ppo")
    batch = PromptCollator(tok, 16)([rows[0], rows[1]])
    spec = RolloutSpec(GenerationSettings(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id,
                       [reward_function(lambda prompts, completions: [1.0] * len(prompts))],
                       lambda ids: tok.batch_decode(ids, skip_special_tokens=True))

    def make(**kw):
        return GRPOTrainer(registry, GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=2, **kw), spec, 4)

    plain = make().make_experience(batch, step=0)
    penalised = make(overlong_buffer=2, overlong_penalty=0.5).make_experience(batch, step=0)
    lengths = plain.action_mask.sum(-1).float()
    expected = 1.0 - 0.5 * ((lengths - 2.0) / 2.0).clamp(0.0, 1.0)
    assert torch.equal(penalised.sequences, plain.sequences)  # the same samples (same seed)
    assert torch.allclose(penalised.score, expected) and "overlong" in penalised.reward_parts


def test_multiturn_rollouts_on_the_registry_mask_environment_tokens(tmp_path):
    paths = multiturn.prepare_arithmetic(str(tmp_path), hidden=32, layers=1, n_sft=4, n_prompts=4, n_eval=2)
    from multiengine.pipelines.checks import resolve_tokenizer

    tok = resolve_tokenizer(paths["model"])
    registry = _registry(paths["model"])
    settings = GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=2, env="builtin:arithmetic", max_turns=3,
                            max_total_tokens=24)
    spec = RolloutSpec(GenerationSettings(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id)
    episodes = multiturn.MultiTurnRollouts(registry, settings, multiturn.TurnRenderer(tok), spec)
    with pytest.raises(ValueError, match="env='builtin:arithmetic' samples episodes"):
        GRPOTrainer(registry, settings, spec, 4)
    trainer = GRPOTrainer(registry, settings, spec, 4, rollout=episodes)
    batch = {"prompts": ["compute 3 + 4", "compute 2 * 9"]}
    exp = trainer.make_experience(batch, step=0)
    again = trainer.make_experience(batch, step=0)
    assert torch.equal(exp.sequences, again.sequences)  # reproducible from the seed
    # every action is a sampled model token; environment replies (<result> ...) are never actions
    result_id = tok.convert_tokens_to_ids("<result>")
    response = exp.sequences[:, exp.context_length:]
    assert not bool((exp.action_mask & (response == result_id)).any())
    assert exp.sequences.shape[0] == 4 and set(exp.extras) >= {"multiturn/success", "multiturn/turns"}
    assert exp.logprobs is None  # one epoch, one optimizer step: the update's own log-probs are the old ones
    episodes.spec = dataclasses.replace(episodes.spec, old_logprobs=True)  # as with more than one pass
    exp = trainer.make_experience(batch, step=0)
    assert torch.equal(exp.logprobs * ~exp.action_mask, torch.zeros_like(exp.logprobs))
    metrics = trainer.step(batch, step=1)
    assert 1.0 <= metrics["multiturn/turns"] <= 3.0 and "policy_loss" in metrics


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kw", [{}, {"algorithm": "dr_grpo"}, {"algorithm": "rloo", "kl_coef": 0.0},
                                {"algorithm": "reinforce_pp", "kl_coef": 0.0}, {"importance_level": "sequence"},
                                {"clip_high": 0.28, "loss_aggregation": "token_mean"}])
def test_one_pass_takes_the_old_log_probs_from_the_update_and_gives_the_same_step(assets, monkeypatch, kw, accum):
    """One epoch and one optimizer step over the rollout, no KL in the reward: the rollout runs no actor forward for
    the old log-probs (ratio 1 by construction) and the step's losses and the actor's gradients are those of the step
    with that forward (today's), on the same samples."""
    from multiengine.pipelines.rlhf import rollout

    tok, rows = assets["tok"], load_rlhf_dataset(assets["data"], "ppo")
    batch = PromptCollator(tok, 16)([rows[i] for i in range(4)])
    settings = GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=4, **kw)  # 8 rows
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id,
                       [reward_function(lambda prompts, completions: [len(c) / 9.0 for c in completions])],
                       lambda ids: tok.batch_decode(ids, skip_special_tokens=True))
    forwards, runs = [], {}
    counted = rollout.role_logprobs
    monkeypatch.setattr(rollout, "role_logprobs", lambda reg, role, *a: forwards.append(role) or counted(reg, role, *a))
    for today in (True, False):
        registry = _registry(assets["model"], micro=8 // accum, accum=accum)
        trainer = GRPOTrainer(registry, settings, spec, 8 // accum)
        assert not trainer.spec.old_logprobs  # decided from the settings and the accumulation
        if today:
            trainer.spec = dataclasses.replace(trainer.spec, old_logprobs=True)
        grads: dict[str, torch.Tensor] = {}
        for name, p in registry.role("actor").module.named_parameters():
            p.register_hook(lambda g, name=name, into=grads: into.__setitem__(name, into.get(name, 0) + g.detach()))
        forwards.clear()
        metrics = trainer.step(batch, step=0)
        runs[today] = (metrics, grads, list(forwards))
    (m0, g0, f0), (m1, g1, f1) = runs[True], runs[False]
    assert f0.count("actor") == 1 and f1.count("actor") == 0 and f0.count("ref") == f1.count("ref")
    assert m1["ratio_mean"] == 1.0 and m1["approx_kl"] == 0.0 and m1["clip_frac"] == 0.0
    assert m0["reward/group_std"] > 0 and m0["reward/mean"] == m1["reward/mean"]  # the same samples
    for key in ("policy_loss", "kl", "kl_loss", "entropy"):
        if key in m0:
            assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        assert torch.allclose(g1[name], g0[name], rtol=1e-5, atol=1e-7), name
    assert any(g.abs().max() > 0 for g in g0.values())


@pytest.mark.parametrize("kw, rows_per_micro", [({"epochs": 2}, 8), ({}, 4), ({"algorithm": "rloo"}, 8)])
def test_what_needs_the_old_log_probs_still_gets_the_rollouts_forward(assets, kw, rows_per_micro):
    """Two epochs, two optimizer steps per rollout, or the KL in the reward (rloo's default) need the rollout's own
    log-probs: the actor runs for them, as before."""
    tok, rows = assets["tok"], load_rlhf_dataset(assets["data"], "ppo")
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id,
                       [reward_function(lambda prompts, completions: [len(c) / 9.0 for c in completions])],
                       lambda ids: tok.batch_decode(ids, skip_special_tokens=True))
    registry = _registry(assets["model"], micro=rows_per_micro)
    trainer = GRPOTrainer(registry, GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=4, **kw), spec,
                          rows_per_micro)
    assert trainer.spec.old_logprobs
    exp = trainer.make_experience(PromptCollator(tok, 16)([rows[i] for i in range(4)]), step=0)
    assert exp.logprobs is not None and torch.isfinite(exp.logprobs).all()
    if "algorithm" not in kw:  # more than one pass: the update refuses to go without them
        exp.logprobs = None
        with pytest.raises(ValueError, match="no old log-probs"):
            trainer.train_on(exp, 0)

"""RLHF pipeline pieces in one process: configs, role loading, LoRA, streams, and a PPO step on the
torch backend (the 2-rank DeepSpeed runs are in tests/distributed/test_rlhf.py)."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.engines import LoraSpec, ShardedBatches, apply_lora, is_lora, shard_batches
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.generation import GenerationSettings, position_ids_from_mask
from multiengine.pipelines.rlhf.roles import load_causal_lm, load_scalar_model
from multiengine.pipelines.rlhf.runs import builtin_judge
from multiengine.recipes.language.config import list_recipes, load_config
from toys import ppo_registry


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf_assets")
    return tiny.prepare_builtin(root, hidden=32, layers=1, n_sft=64, n_reward=32, n_ppo=64, n_eval=16)


@pytest.mark.parametrize("recipe", ["rlhf_sft", "rlhf_reward", "rlhf_ppo", "rlhf_e2e"])
def test_every_shipped_config_loads(recipe):
    names = list_recipes()[recipe]
    assert "tiny" in names and len(names) >= 2  # the embedded default and a GPU example
    for name in names:
        cfg = load_config(recipe, name)
        assert cfg.output_dir and cfg.seed is not None


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 1]]


def test_generation_settings_are_checked():
    with pytest.raises(ValueError, match="mode"):
        GenerationSettings(mode="hybrid")
    with pytest.raises(ValueError, match="temperature"):
        GenerationSettings(temperature=0.0)


def test_builtin_judge_only_for_task_prompts():
    assert builtin_judge(["list 3 fruits :", "name 2 tools :"]) is tiny.judge
    assert builtin_judge(["list 3 fruits :", "Human: hello"]) is None
    assert builtin_judge(["list 3 fruits :"], enabled=False) is None


def test_batch_stream_resumes_at_the_same_batch(assets):
    rows = load_rlhf_dataset(assets["data"], "ppo")
    tok = tiny.train_tokenizer(tiny.task_vocabulary(), assets["tokenizer"])
    collate = PromptCollator(tok, 16)
    a = ShardedBatches(rows, collate, 24, world_size=2, rank=1, seed=3)
    for _ in range(2):  # 48 of 32 rows per rank: crosses into epoch 1
        next(a)
    state = a.state_dict()
    expected = next(a)
    b = ShardedBatches(rows, collate, 24, world_size=2, rank=1, seed=3)
    b.load_state_dict(state)
    got = next(b)
    assert state["epoch"] == 1 and got["prompts"] == expected["prompts"]
    assert torch.equal(got["input_ids"], expected["input_ids"])
    # fixed batches: equal shares, disjoint across ranks
    r0 = shard_batches(rows, collate, 5, world_size=2, rank=0, limit=15)
    r1 = shard_batches(rows, collate, 5, world_size=2, rank=1, limit=15)
    p0 = [p for b in r0 for p in b["prompts"]]
    p1 = [p for b in r1 for p in b["prompts"]]
    assert len(p0) == len(p1) == 7 and [len(b["prompts"]) for b in r0] == [5, 2]


def test_roles_load_without_dropout_and_lora_trains_only_adapters(assets, tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(assets["model"])
    cfg.dropout = cfg.attention_dropout = 0.3
    cfg.save_pretrained(tmp_path)
    import shutil

    for f in ("model.safetensors", "generation_config.json"):
        shutil.copy(assets["model"] / f, tmp_path / f)
    model = load_causal_lm(str(tmp_path))
    assert model.config.dropout == 0.0 and model.config.attention_dropout == 0.0
    assert not is_lora(model)

    spec = LoraSpec(rank=2, target_modules=("q_proj", "v_proj"))
    lora = apply_lora(load_causal_lm(str(assets["model"])), spec)
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and is_lora(lora)
    critic = apply_lora(load_scalar_model(str(assets["model"]), zero3=False), spec)
    trainable = [n for n, p in critic.named_parameters() if p.requires_grad]
    assert "value_head.weight" in trainable and all("lora_" in n or n == "value_head.weight" for n in trainable)
    ids = torch.tensor([[1, 5, 6, 2]])
    assert critic(ids, torch.ones_like(ids)).shape == (1, 4)


def test_ppo_step_on_the_torch_backend(assets):
    """One process, no DeepSpeed: experience, rewards on the last action, critic warm-up, an actor update."""
    from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer
    from multiengine.pipelines.rlhf.rollout import RolloutSpec

    tok = tiny.train_tokenizer(tiny.task_vocabulary(), assets["tokenizer"])
    registry = ppo_registry(str(assets["model"]))
    settings = PPOSettings(rollout_batch_size=4, epochs=1, critic_warmup_steps=1)
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id,
                       decode=lambda ids: tok.batch_decode(ids, skip_special_tokens=True), judge=tiny.judge,
                       critic="critic")
    trainer = PPOTrainer(registry, settings, spec, micro_batch_size=2)
    rows = load_rlhf_dataset(assets["data"], "ppo")
    batch = PromptCollator(tok, 16)([rows[i] for i in range(4)])
    before = [p.detach().clone() for p in registry["actor"].module.parameters()]

    exp = trainer.make_experience(batch, step=0)
    T = exp.action_mask.shape[1]
    assert exp.sequences.shape == (4, batch["input_ids"].shape[1] + T)
    # the score sits on the last action token, the rest of the reward is -beta * k1
    last = exp.action_mask.long().cumsum(-1).argmax(-1)
    kl_part = -trainer.kl_ctl.value * (exp.logprobs - exp.ref_logprobs)
    score_part = exp.rewards - kl_part * exp.action_mask
    assert torch.allclose(score_part[torch.arange(4), last], exp.score.clamp(-5, 5), atol=1e-5)
    # actor == ref at step 0: zero KL
    assert exp.logprobs.abs().sum() > 0 and torch.allclose(exp.logprobs, exp.ref_logprobs, atol=1e-5)

    warm = trainer.step(batch, step=0)
    assert "policy_loss" not in warm and math.isfinite(warm["value_loss"])
    assert all(torch.equal(a, b) for a, b in zip(before, registry["actor"].module.parameters()))
    metrics = trainer.step(batch, step=1)
    assert math.isfinite(metrics["policy_loss"]) and 0.0 <= metrics["judge/mean"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, registry["actor"].module.parameters()))
    for key in ("reward/mean", "reward/std", "kl", "entropy", "clip_frac", "approx_kl", "response_length",
                "gen/tokens_per_s", "time/generation_s", "time/experience_s", "time/train_s", "time/step_s"):
        assert key in metrics, key

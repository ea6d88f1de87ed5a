"""Rollouts, reward sources and the GRPO / DPO trainers in one process on the torch backend (the
2-rank DeepSpeed runs are in tests/distributed/test_rlhf_algos.py)."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, trainable_role
from multiengine.pipelines.rlhf import ppo, tiny
from multiengine.pipelines.rlhf.data import PairCollator, PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.dpo import DPOSettings, DPOTrainer
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
from multiengine.pipelines.rlhf.preference import PreferenceCollator, preference_response_mask
from multiengine.pipelines.rlhf.rewards import judge_reward, reward_function, reward_model
from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model
from multiengine.pipelines.rlhf.rollout import RolloutSpec, make_experience

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A random 8-token OPT: at temperature 1 it samples the pad id (0) about once in 8 tokens."""
    from transformers import OPTConfig, OPTForCausalLM

    path = tmp_path_factory.mktemp("vocab8")
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                             max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, pad_token_id=PAD,
                             bos_token_id=BOS, eos_token_id=EOS)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("rlhf_algo_assets")
    paths = tiny.prepare_builtin(root, hidden=32, layers=1, n_sft=16, n_reward=32, n_ppo=64, n_eval=16)
    from transformers import AutoTokenizer

    return {**paths, "tok": AutoTokenizer.from_pretrained(str(paths["tokenizer"]))}


def _ids_text(ids: torch.Tensor) -> list[str]:
    return [" ".join(map(str, row)) for row in ids.tolist()]


def test_pad_sampled_before_eos_is_an_action_and_rescoring_matches_an_unpadded_forward(small_vocab_model):
    registry = EngineRegistry(backend="torch")
    registry.add(trainable_role("actor", causal_lm(small_vocab_model), Placement(0, "fp32"), OptimSpec()))
    registry.add(frozen_role("ref", causal_lm(small_vocab_model), Placement(0, "fp32")))
    registry.build()
    # two prompts of different lengths, left padded with the pad id
    batch = {"input_ids": torch.tensor([[PAD, PAD, BOS, 3, 4], [BOS, 5, 6, 7, 3]]),
             "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), "prompts": ["a", "b"]}
    spec = RolloutSpec(GenerationSettings(max_new_tokens=6), EOS, PAD,
                       [reward_function(lambda p, r: [0.0] * len(p), name="zero")], _ids_text, seed=3)
    exp = make_experience(registry, batch, 0, spec, n_samples_per_prompt=8)
    response, mask = exp.response_ids, exp.action_mask
    # the mask is a prefix up to and including the first EOS
    lengths = mask.sum(-1)
    assert torch.equal(mask, torch.arange(mask.shape[1]).expand_as(mask) < lengths.unsqueeze(1))
    pad_inside = [(response[i, :lengths[i]] == PAD).any().item() for i in range(response.shape[0])]
    assert sum(pad_inside) >= 2, "the test needs rows that sampled the pad id before EOS"

    model = registry.role("actor").module
    worst_old = 0.0
    with torch.no_grad():
        for i in range(response.shape[0]):
            # per-row recomputation: the real prompt tokens and the actions only, no padding, no mask
            prompt = exp.sequences[i, :exp.context_length][exp.attention_mask[i, :exp.context_length].bool()]
            row = torch.cat([prompt, response[i, :lengths[i]]]).unsqueeze(0)
            logp = torch.log_softmax(model(input_ids=row).logits[0, len(prompt) - 1:-1].float(), -1)
            expected = logp.gather(-1, response[i, :lengths[i]].unsqueeze(-1)).squeeze(-1)
            assert torch.allclose(exp.logprobs[i, :lengths[i]], expected, atol=1e-5), i
            assert torch.allclose(exp.ref_logprobs[i, :lengths[i]], expected, atol=1e-5), i
            if pad_inside[i]:
                # what hiding the sampled pad from attention (the old mask) would have scored instead
                hidden = exp.attention_mask[i:i + 1].clone()
                hidden[0, exp.context_length:] &= (response[i] != PAD).to(hidden.dtype)
                from multiengine.pipelines.rlhf.scoring import policy_logits

                old = ppo.response_logprobs(policy_logits(registry["actor"], exp.sequences[i:i + 1], hidden),
                                            exp.sequences[i:i + 1], exp.context_length)[0, :lengths[i]]
                visible = hidden[0, exp.context_length:exp.context_length + lengths[i]].bool()
                worst_old = max(worst_old, (old - expected)[visible].abs().max().item())
    assert worst_old > 1e-3  # the check above can tell the two maskings apart


def _grpo_registry(assets, with_reward_model: bool) -> EngineRegistry:
    registry = EngineRegistry(backend="torch")
    model = str(assets["model"])
    registry.add(trainable_role("actor", causal_lm(model), Placement(0, "fp32"), OptimSpec(lr=1e-2, total_steps=4),
                                micro_batch_size=4))
    registry.add(frozen_role("ref", causal_lm(model), Placement(0, "fp32")))
    if with_reward_model:
        registry.add(frozen_role("reward", scalar_model(model), Placement(0, "fp32")))
    return registry.build()


def _prompt_batch(assets, n: int = 2):
    rows = load_rlhf_dataset(assets["data"], "ppo")
    return PromptCollator(assets["tok"], 16)([rows[i] for i in range(n)])


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_grpo_family_step_on_the_torch_backend(assets, algorithm):
    tok = assets["tok"]
    registry = _grpo_registry(assets, with_reward_model=algorithm == "grpo")
    sources = [reward_function("builtin:judge")]
    if algorithm == "grpo":
        sources.append(reward_model("reward", weight=0.5))
    settings = GRPOSettings(algorithm=algorithm, n_samples_per_prompt=4, rollout_batch_size=2)
    decode = lambda ids: tok.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    spec = RolloutSpec(GenerationSettings(max_new_tokens=5), tok.eos_token_id, tok.pad_token_id, sources, decode,
                       judge=tiny.judge)
    with pytest.raises(ValueError, match="multiple of the actor's micro batch 3"):
        GRPOTrainer(registry, settings, spec, micro_batch_size=3)
    trainer = GRPOTrainer(registry, settings, spec, micro_batch_size=4)
    batch = _prompt_batch(assets)
    exp = trainer.make_experience(batch, step=0)
    assert exp.sequences.shape[0] == 8 and exp.group_size == 4 and exp.values is None
    assert exp.prompts[:4] == [batch["prompts"][0]] * 4  # a group is consecutive rows
    judged = torch.tensor(judge_reward(exp.prompts, exp.responses))
    if algorithm == "grpo":
        # weighted sum of the judge and 0.5 x the reward model's score
        assert torch.allclose(exp.score, judged + 0.5 * exp.reward_parts["reward"], atol=1e-6)
    else:
        assert torch.allclose(exp.score, judged)
    assert torch.equal(exp.advantages * ~exp.action_mask, torch.zeros_like(exp.advantages))
    before = [p.detach().clone() for p in registry["actor"].module.parameters()]
    metrics = trainer.step(batch, step=0)
    assert math.isfinite(metrics["policy_loss"]) and 0.0 <= metrics["judge/mean"] <= 1.0
    assert ("kl_loss" in metrics) == (algorithm in ("grpo", "dr_grpo"))
    assert any(not torch.equal(a, b) for a, b in zip(before, registry["actor"].module.parameters()))
    assert trainer.state_dict()["algorithm"] == algorithm


def test_grpo_settings_are_checked():
    with pytest.raises(ValueError, match="algorithm"):
        GRPOSettings(algorithm="ppo")
    with pytest.raises(ValueError, match="zero advantages"):
        GRPOSettings(algorithm="grpo", n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="applies only when kl_coef is set"):
        GRPOSettings(kl_coef=0.0, kl_in_reward=True)
    with pytest.raises(ValueError, match="applies only when env is set"):
        GRPOSettings(max_turns=5)
    assert GRPOSettings(algorithm="reinforce_pp", n_samples_per_prompt=1).resolved_kl_in_reward
    assert GRPOSettings(algorithm="dr_grpo").aggregation == "seq_mean_token_sum_norm"
    assert GRPOSettings(algorithm="dr_grpo", loss_aggregation="token_mean").aggregation == "token_mean"
    assert GRPOSettings(algorithm="rloo", kl_in_reward=False).kl_loss_coef == 0.04


def test_grpo_reward_normalisation_state_resumes(assets):
    tok = assets["tok"]
    registry = _grpo_registry(assets, with_reward_model=False)
    settings = GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=2)
    decode = lambda ids: tok.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    spec = RolloutSpec(GenerationSettings(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id,
                       [reward_function(judge_reward)], decode)
    make = lambda: GRPOTrainer(registry, settings, spec, 4, normalize_rewards=True)  # noqa: E731
    trainer = make()
    trainer.make_experience(_prompt_batch(assets), step=0)
    state = trainer.state_dict()
    assert state["normalizer"]["count"] == 4
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.normalizer.state_dict() == trainer.normalizer.state_dict()
    with pytest.raises(ValueError, match="algorithm"):
        resumed.load_state_dict({**state, "algorithm": "rloo"})


def test_dpo_step_precomputed_ref_equals_on_the_fly(assets):
    tok = assets["tok"]
    rows = load_rlhf_dataset(assets["data"], "reward")
    rows = [rows[i] for i in range(8)]
    collate = PreferenceCollator(PairCollator(tok, 16, 8))
    batch = collate(rows[:4])
    assert batch["prompt_lengths"].tolist() == [len(tok(r["prompt"])["input_ids"]) for r in rows[:4]]

    def build():
        registry = EngineRegistry(backend="torch")
        model = str(assets["model"])
        registry.add(trainable_role("actor", causal_lm(model), Placement(0, "fp32"), OptimSpec(lr=1e-2),
                                    micro_batch_size=2, grad_accum=2))
        registry.add(frozen_role("ref", causal_lm(model), Placement(0, "fp32")))
        return registry.build()

    on_the_fly = DPOTrainer(build(), DPOSettings(beta=0.1))
    first = on_the_fly.step(batch)
    # actor == ref at the start: zero implicit rewards, loss log 2
    assert first["loss"] == pytest.approx(math.log(2.0), abs=1e-5) and first["margin"] == pytest.approx(0, abs=1e-6)
    second = on_the_fly.step(batch)
    assert second["loss"] < first["loss"] and second["accuracy"] > 0.5

    pre = DPOTrainer(build(), DPOSettings(beta=0.1, precompute_ref=True))
    cached = pre.precompute_reference(rows, collate, batch_size=3)
    assert len(cached) == 8 and all("ref_chosen_logp" in r for r in cached)
    pre_batch = collate(cached[:4])
    assert "ref_chosen_logps" in pre_batch
    steps = [pre.step(pre_batch), pre.step(pre_batch)]
    for a, b in zip((first, second), steps):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    held_out = pre.evaluate([collate(cached[4:])])
    assert held_out["pairs"] == 4 and set(held_out) >= {"accuracy", "margin", "chosen_reward", "rejected_reward"}
    with pytest.raises(ValueError, match="precompute"):
        pre.step(batch)  # precompute_ref=True and a batch without ref log-probs
    assert pre.state_dict()["steps"] == 2

    # RPO: + sft_coef x the chosen answers' per-token NLL; at the start (policy == ref) the DPO part is ln 2
    rpo = DPOTrainer(build(), DPOSettings(beta=0.1, sft_coef=0.5))
    loss, stats = rpo.loss({k: v.to(rpo.registry.device) if torch.is_tensor(v) else v for k, v in batch.items()})
    n_chosen = preference_response_mask(batch)[:4].sum(-1)
    expected_nll = -stats["logps/chosen"] / n_chosen
    assert torch.allclose(stats["nll"], expected_nll, atol=1e-6)
    assert float(loss) == pytest.approx(math.log(2.0) + 0.5 * float(expected_nll.mean()), abs=1e-5)

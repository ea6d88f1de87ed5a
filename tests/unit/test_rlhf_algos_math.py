"""Critic-free estimators, loss normalisations, KL placement, DPO / IPO and reward plumbing against
hand-derived numbers (pipelines/rlhf/advantages.py, losses.py, preference.py, rewards.py)."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.pipelines.rlhf import advantages as adv
from multiengine.pipelines.rlhf import losses, ppo, rewards
from multiengine.pipelines.rlhf.grpo import GRPOSettings
from multiengine.pipelines.rlhf.preference import preference_response_mask


def close(a: torch.Tensor, b, atol: float = 1e-6) -> None:
    b = torch.as_tensor(b, dtype=a.dtype)
    assert torch.allclose(a, b, atol=atol), f"{a} != {b}"


# --------------------------------------------------------------------------------------------------
# sequence-level estimators
# --------------------------------------------------------------------------------------------------


def test_grpo_group_zscore_hand_values():
    # group 1: (1, 0, 0, 1): mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +/- 0.5 / 0.57735 = 0.866025
    # group 2: equal rewards: no spread, advantage 0 (not NaN)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    close(adv.grpo_advantages(scores, 4), [0.866025, -0.866025, -0.866025, 0.866025, 0, 0, 0, 0], atol=1e-5)
    # Dr. GRPO: mean removed, no std division
    close(adv.grpo_advantages(scores, 4, scale_by_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_one_sample_per_group_gives_zero():
    scores = torch.tensor([3.0, -1.0])
    close(adv.grpo_advantages(scores, 1), [0.0, 0.0])
    close(adv.grpo_advantages(scores, 1, scale_by_std=False), [0.0, 0.0])
    with pytest.raises(ValueError, match="groups"):
        adv.grpo_advantages(torch.zeros(5), 2)


def test_rloo_leave_one_out_hand_values():
    # (1, 0, 0, 1): a 1 is compared with the mean of (0, 0, 1) = 1/3 -> 2/3; a 0 with (1, 0, 1) -> -2/3
    close(adv.rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # n = 2: each sample against the other
    close(adv.rloo_advantages(torch.tensor([3.0, 1.0, 5.0, 5.0]), 2), [2.0, -2.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=">= 2"):
        adv.rloo_advantages(torch.tensor([1.0, 2.0]), 1)


FLAT = (0.7, 0.1, 1e6, -3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_equal_rewards_gets_exactly_zero(dtype):
    """Each flat group among groups with a spread: every group-relative estimator gives it exactly 0, whatever the
    value and dtype (the mean of eight rounded copies of 0.7 is not 0.7, and dividing that noise by a std of
    1e-8 + eps once gave each answer +0.06); the other groups keep their advantages."""
    n = 8
    spread = torch.arange(n, dtype=torch.float32) / n
    for value in FLAT:
        scores = torch.cat([spread, torch.full((n,), value), spread * 3 - 1]).to(dtype)
        flat = slice(n, 2 * n)
        for name, a in (("grpo", adv.grpo_advantages(scores, n)),
                        ("grpo eps 0", adv.grpo_advantages(scores, n, eps=0.0)),
                        ("dr_grpo", adv.grpo_advantages(scores, n, scale_by_std=False)),
                        ("rloo", adv.rloo_advantages(scores, n))):
            assert a.dtype == torch.float32 and torch.isfinite(a).all(), (name, value)
            assert torch.equal(a[flat], torch.zeros(n)), (name, value, dtype, a[flat].tolist())
            assert (a[:n] != 0).any() and (a[2 * n:] != 0).any(), (name, value)
            g = scores.float().view(3, n)[0]  # a group with a spread: the formula, unchanged
            want = {"rloo": g - (g.sum() - g) / (n - 1), "dr_grpo": g - g.mean()}.get(name, None)
            if want is None:
                want = (g - g.mean()) / (g.std() + (0.0 if name == "grpo eps 0" else 1e-6))
            close(a[:n], want)


def test_returns_to_go_with_padding():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma 0.5: G2 = 1, G1 = 0 + 0.5, G0 = 0 + 0.25; the padded reward 7 is ignored
    close(adv.returns_to_go(rewards, mask, gamma=0.5), [[0.25, 0.5, 1.0, 0.0]])
    close(adv.returns_to_go(rewards, mask), [[1.0, 1.0, 1.0, 0.0]])


# --------------------------------------------------------------------------------------------------
# per-token advantages and KL placement
# --------------------------------------------------------------------------------------------------

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # answers of 2 and 1 tokens, padded to 3
LOGP = torch.full((2, 3), -1.0)
REF = torch.tensor([[-1.5, -1.0, -9.0], [-2.0, -9.0, -9.0]])  # k1 = logp - ref = (0.5, 0, .) and (1, ., .)


def advantages(algorithm, score, ref, n, **settings):
    """critic_free_advantages of LOGP / MASK, KL and reward clipping off unless given."""
    settings = {"kl_coef": 0.0, "clip_reward": 0.0, **settings}
    return adv.critic_free_advantages(score, LOGP, ref, MASK, GRPOSettings(algorithm=algorithm,
                                                                           n_samples_per_prompt=n, **settings))


def test_grpo_per_token_advantages_kl_as_loss_term():
    # one group of 2: scores (1, 0) -> mean 0.5, sample std sqrt(0.5) -> +/- 0.707107 on every action token;
    # with the KL as a loss term the rewards hold only the sequence advantage, on the last action
    a, r = advantages("grpo", torch.tensor([1.0, 0.0]), REF, 2, kl_coef=0.1,
                                      kl_in_reward=False)
    s = 0.5 / math.sqrt(0.5)
    close(a, [[s, s, 0.0], [-s, 0.0, 0.0]], atol=1e-5)
    close(r, [[0.0, s, 0.0], [-s, 0.0, 0.0]], atol=1e-5)


def test_rloo_per_token_advantages_kl_in_reward():
    # RLOO n=2: sequence advantages (1 - 0, 0 - 1) = (1, -1) on the last action; -0.1 * k1 on every action:
    #   row 0 rewards (-0.05, 1 + 0, .) -> returns (0.95, 1); row 1 rewards (-0.1 - 1) -> (-1.1)
    a, r = advantages("rloo", torch.tensor([1.0, 0.0]), REF, 2, kl_coef=0.1,
                                      kl_in_reward=True)
    close(r, [[-0.05, 1.0, 0.0], [-1.1, 0.0, 0.0]], atol=1e-6)
    close(a, [[0.95, 1.0, 0.0], [-1.1, 0.0, 0.0]], atol=1e-6)
    # the same with a clamp of 0.2 on the k1 estimate: row 1's k1 of 1 becomes 0.2
    a, _ = advantages("rloo", torch.tensor([1.0, 0.0]), REF, 2, kl_coef=0.1,
                                      kl_in_reward=True, kl_clamp=0.2)
    close(a[1, 0], -1.02, atol=1e-6)


def test_dr_grpo_and_reward_clipping():
    # scores (2, 0) clipped to (1, 0) first: mean 0.5, Dr. GRPO subtracts it only
    a, _ = advantages("dr_grpo", torch.tensor([2.0, 0.0]), None, 2, clip_reward=1.0)
    close(a, [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]])


def test_reinforce_pp_global_whitening():
    # no baseline at the sequence level: returns (1, 1) and (0); whitened over the 3 action tokens:
    # mean 2/3, population var 2/9 -> (1 - 2/3) / 0.471405 = 0.707107, (0 - 2/3) / 0.471405 = -1.414214
    a, _ = advantages("reinforce_pp", torch.tensor([1.0, 0.0]), None, 1)
    close(a, [[0.707107, 0.707107, 0.0], [-1.414214, 0.0, 0.0]], atol=1e-5)


def test_critic_free_checks():
    with pytest.raises(ValueError, match="algorithm"):
        advantages("ppo", torch.zeros(2), REF, 2)
    with pytest.raises(ValueError, match="ref"):
        advantages("rloo", torch.zeros(2), None, 2, kl_coef=0.1, kl_in_reward=True)


def test_k3_loss_term_values_and_gradient():
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    ref = torch.full((1, 2), math.log(0.25))
    mask = torch.ones(1, 2)
    loss, mean_kl = losses.kl_loss(logp, ref, mask)
    # k3 = e^(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1 = 0.193147 per token
    close(loss.detach(), 0.193147, atol=1e-5)
    close(mean_kl, 0.193147, atol=1e-5)
    loss.backward()
    # d k3 / d logp = 1 - e^(ref - logp) = 0.5, over 2 tokens
    close(logp.grad, [[0.25, 0.25]], atol=1e-6)
    clamped, _ = losses.kl_loss(logp.detach(), ref, mask, clamp=0.1)
    close(clamped, 0.1, atol=1e-6)
    k1 = losses.kl_estimate(logp.detach(), ref, "k1")
    close(k1, [[math.log(2.0)] * 2], atol=1e-6)


def test_compute_rewards_without_ref_has_no_kl():
    rewards = ppo.compute_rewards(torch.tensor([2.0]), torch.tensor([[-1.0, -1.0]]), None, torch.ones(1, 2), 0.1)
    close(rewards, [[0.0, 2.0]])


# --------------------------------------------------------------------------------------------------
# loss normalisation
# --------------------------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 60.0]])
PT_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_aggregate_loss_modes_hand_values():
    close(losses.aggregate_loss(PER_TOKEN, PT_MASK, "token_mean"), 7.0 / 3.0)  # (1 + 2 + 4) / 3 tokens
    close(losses.aggregate_loss(PER_TOKEN, PT_MASK, "seq_mean_token_mean"), 2.75)  # (1.5 + 4) / 2 rows
    # Dr. GRPO: (3 + 4) / horizon 4 / 2 rows
    close(losses.aggregate_loss(PER_TOKEN, PT_MASK, "seq_mean_token_sum_norm", horizon=4), 0.875)
    with pytest.raises(ValueError, match="loss_agg"):
        losses.aggregate_loss(PER_TOKEN, PT_MASK, "sum")


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_aggregate_loss_split_over_ranks_adds_up(mode):
    # each half ("rank") divides by the global unit count; the halves sum to the whole batch's loss
    whole = losses.aggregate_loss(PER_TOKEN, PT_MASK, mode, horizon=4)
    den = losses.loss_units(PT_MASK, mode)
    halves = [losses.aggregate_loss(PER_TOKEN[i:i + 1], PT_MASK[i:i + 1], mode, den, horizon=4) for i in (0, 1)]
    close(halves[0] + halves[1], whole.item())


def test_ppo_policy_loss_normalisations_at_ratio_one():
    logp = torch.zeros(2, 2, requires_grad=True)
    a = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])

    def loss(mode, horizon=None):
        x = losses.PolicyLossInputs(logp, logp.detach(), a, mask, mode, horizon=horizon)
        return losses.policy_loss("ppo", x, GRPOSettings())[0]

    # ratio 1: per-token loss -A: (-1, -3) and (-5)
    close(loss("token_mean").detach(), -3.0)  # -9 / 3
    close(loss("seq_mean_token_mean").detach(), -3.5)  # (-2 - 5) / 2
    dr = loss("seq_mean_token_sum_norm", horizon=2)
    close(dr.detach(), -2.25)  # (-4 - 5) / 2 / 2
    dr.backward()
    close(logp.grad, [[-0.25, -0.75], [-1.25, 0.0]])  # -A / (horizon * rows): the plain policy gradient


# --------------------------------------------------------------------------------------------------
# DPO / IPO
# --------------------------------------------------------------------------------------------------


def test_dpo_sigmoid_and_label_smoothing_hand_values():
    pc, pr = torch.tensor([-1.0]), torch.tensor([-2.0])
    rc, rr = torch.tensor([-1.5]), torch.tensor([-1.5])
    # h = (-1 + 1.5) - (-2 + 1.5) = 1; beta 0.5: -log sigma(0.5) = log(1 + e^-0.5) = 0.474077
    loss, chosen, rejected = losses.dpo_loss(pc, pr, rc, rr, beta=0.5)
    close(loss, [0.474077], atol=1e-6)
    close(chosen, [0.25])
    close(rejected, [-0.25])
    # label smoothing 0.1: 0.9 * 0.474077 + 0.1 * log(1 + e^0.5) = 0.426669 + 0.097408
    loss, _, _ = losses.dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    close(loss, [0.524077], atol=1e-6)


def test_ipo_hand_values_and_gradient():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr, rc, rr = torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])
    # h = 1: beta 0.25 -> (1 - 2)^2 = 1; beta 0.5 -> (1 - 1)^2 = 0
    loss, _, _ = losses.dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="ipo")
    close(loss.detach(), [1.0])
    loss.sum().backward()
    close(pc.grad, [-2.0])  # 2 (h - 1 / (2 beta))
    close(losses.dpo_loss(pc.detach(), pr, rc, rr, beta=0.5, loss_type="ipo")[0], [0.0])
    with pytest.raises(ValueError, match="label_smoothing"):
        losses.dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss"):
        losses.dpo_loss(pc, pr, rc, rr, loss_type="hinge")


def test_chosen_nll_is_the_per_token_nll_and_its_gradient():
    pc = torch.tensor([-3.0, -2.0], requires_grad=True)
    # -(-3) / 3 tokens = 1; -(-2) / 4 tokens = 0.5; an empty response counts as one token (no division by 0)
    close(losses.chosen_nll(pc, torch.tensor([3, 4])).detach(), [1.0, 0.5])
    losses.chosen_nll(pc, torch.tensor([3, 4])).sum().backward()
    close(pc.grad, [-1 / 3, -0.25])
    close(losses.chosen_nll(torch.tensor([-2.0]), torch.tensor([0])), [2.0])


def test_dpo_settings_reject_a_negative_sft_coef():
    from multiengine.pipelines.rlhf.dpo import DPOSettings

    with pytest.raises(ValueError, match="sft_coef"):
        DPOSettings(sft_coef=-1.0)


def test_sequence_logprob_sums_response_tokens_only():
    logits = torch.log(torch.tensor([0.2, 0.3, 0.5])).expand(2, 4, 3)
    ids = torch.tensor([[0, 1, 2, 1], [0, 2, 2, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])  # row 1: a 2-token response then padding
    close(losses.sequence_logprob(logits, ids, mask), [math.log(0.5) + math.log(0.3), 2 * math.log(0.5)],
          atol=1e-6)
    with pytest.raises(ValueError, match="position 0"):
        losses.sequence_logprob(logits, ids, torch.ones_like(ids))


def test_preference_response_mask_with_and_without_prompt_lengths():
    # prompt (1, 5); chosen (6, 7, EOS=2); rejected (6, 8, 9, EOS); right padded with 0
    ids = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 5, 6, 8, 9, 2]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    exact = preference_response_mask({"input_ids": ids, "attention_mask": attn, "prompt_lengths": torch.tensor([2])})
    assert exact.long().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # without prompt lengths the shared start (1, 5, 6) is left out of both rows
    shared = preference_response_mask({"input_ids": ids, "attention_mask": attn})
    assert shared.long().tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_dpo_margin_is_the_same_with_either_response_mask():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=16, word_embed_proj_dim=16,
                                     dropout=0.0)).eval()
    ids = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 5, 6, 8, 9, 2]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    margins = []
    for batch in ({"input_ids": ids, "attention_mask": attn, "prompt_lengths": torch.tensor([2])},
                  {"input_ids": ids, "attention_mask": attn}):
        lp = losses.sequence_logprob(logits, ids, preference_response_mask(batch))
        margins.append((lp[0] - lp[1]).item())
    assert margins[0] == pytest.approx(margins[1], abs=1e-5)


# --------------------------------------------------------------------------------------------------
# reward functions and normalisation
# --------------------------------------------------------------------------------------------------


def test_reward_function_specs(tmp_path):
    assert rewards.load_reward_function("builtin:judge") is rewards.judge_reward
    fn = rewards.load_reward_function("multiengine.pipelines.rlhf.rewards:judge_reward")
    assert fn(["list 2 fruits :", "list 2 fruits :"], ["apple pear", "car"]) == [1.0, 0.0]
    path = tmp_path / "my_reward.py"
    path.write_text("def length(prompts, responses):\n    return [len(r.split()) for r in responses]\nX = 3\n")
    src = rewards.reward_function(f"{path}:length", weight=0.5)
    assert src.name == "length" and src.weight == 0.5 and src.fn([""], ["a b c"]) == [3]
    for spec, match in [("judge", "expected"), ("nope.module:fn", "cannot import"),
                        (f"{tmp_path}/missing.py:fn", "does not exist"), (f"{path}:other", "has no 'other'"),
                        (f"{path}:X", "not a function"), ("builtin:oracle", "no built-in")]:
        with pytest.raises(ValueError, match=match):
            rewards.load_reward_function(spec)
    with pytest.raises(ValueError, match="exactly one"):
        rewards.RewardSource("x")
    sources = [rewards.reward_model("reward", 0.5), rewards.reward_function("builtin:judge", 2.0),
               rewards.reward_function(f"{path}:length", 0.1)]
    assert [(s.name, s.weight, s.role) for s in sources] == [("reward", 0.5, "reward"), ("judge", 2.0, None),
                                                             ("length", 0.1, None)]
    assert rewards.reward_function("builtin:judge").weight == 1.0


def test_running_moments_merge_and_resume():
    m = rewards.RunningMoments()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([4.0, 5.0]))
    # the stream 1..5: mean 3, population variance 2
    assert m.mean == pytest.approx(3.0) and m.var == pytest.approx(2.0)
    close(m.normalize(torch.tensor([3.0, 3.0 + math.sqrt(2.0)])), [0.0, 1.0], atol=1e-6)
    resumed = rewards.RunningMoments()
    resumed.load_state_dict(m.state_dict())
    m.update(torch.tensor([10.0]))
    resumed.update(torch.tensor([10.0]))
    assert resumed.state_dict() == m.state_dict()


# --------------------------------------------------------------------------------------------------
# against the references' code, re-implemented here (TRL GRPOTrainer / RLOOTrainer / DPOTrainer, OpenRLHF's
# experience maker), on the same random inputs
# --------------------------------------------------------------------------------------------------


def _random_rollout(seed: int, rows: int = 12, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    score = torch.randn(rows, generator=g)
    logp, ref = -torch.rand(rows, T, generator=g) * 3, -torch.rand(rows, T, generator=g) * 3
    mask = torch.arange(T)[None] < torch.randint(1, T + 1, (rows,), generator=g)[:, None]
    return score, logp * mask, ref * mask, mask


def openrlhf_compute_reward(r, kl_coef, kl, action_mask):
    """OpenRLHF compute_reward: the score on the last action (eos_indices from the flipped mask), -kl_coef * k1."""
    eos_indices = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos_indices, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + -kl_coef * kl


def openrlhf_gae(values, rewards, action_mask, gamma, lambd):
    """OpenRLHF get_advantages_and_returns."""
    lastgaelam, reversed_ = 0, []
    values, rewards = action_mask * values, action_mask * rewards
    for t in reversed(range(rewards.size(1))):
        nextvalues = values[:, t + 1] if t < rewards.size(1) - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    return advantages, advantages + values


def openrlhf_whiten(x, mask):
    """OpenRLHF's advantage normalisation over the batch: (x - mean) * rsqrt(clamp(var, 1e-8))."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = ((x - mean).pow(2) * mask).sum() / n
    return (x - mean) * var.clamp(min=1e-8).rsqrt()


def test_ppo_rewards_and_gae_are_openrlhfs():
    for seed in range(3):
        score, logp, ref, mask = _random_rollout(seed)
        values = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed)) * mask
        m = mask.float()
        ours = ppo.compute_rewards(score, logp, ref, mask, 0.1)
        theirs = openrlhf_compute_reward(score, 0.1, ppo.kl_k1(logp, ref) * m, mask)
        close(ours, theirs * m)
        a, ret = ppo.gae(ours, values, mask, 1.0, 0.95)
        a_ref, ret_ref = openrlhf_gae(values, theirs, m, 1.0, 0.95)
        close(a, a_ref * m)
        close(ret, ret_ref * m)
        close(ppo.masked_whiten(a, mask), openrlhf_whiten(a_ref, m) * m)


@pytest.mark.parametrize("seed", range(3))
def test_critic_free_advantages_are_the_references(seed):
    """GRPO and Dr. GRPO as TRL computes them (std + 1e-4, or no scaling) and OpenRLHF's group_norm (std + 1e-9), RLOO
    as TRL's RLOOTrainer (a [k, batch] layout) and OpenRLHF compute it, REINFORCE++ as OpenRLHF's `reinforce`: k1 in
    the reward, returns, then the batch's whitening. Groups of 4 with a spread (a flat group is exactly 0 here; TRL and
    OpenRLHF divide the rounding of its mean by their epsilon)."""
    n = 4
    score, logp, ref, mask = _random_rollout(seed)
    g = score.view(-1, n)
    for eps in (1e-4, 1e-9):  # TRL, OpenRLHF
        close(adv.grpo_advantages(score, n, eps=eps), ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps))
              .reshape(-1))
    close(adv.grpo_advantages(score, n, scale_by_std=False), (g - g.mean(1, keepdim=True)).reshape(-1))
    k_major = score.view(-1, n).T  # TRL RLOOTrainer: rlhf_reward.reshape(rloo_k, -1)
    trl = (k_major - (k_major.sum(0) - k_major) / (n - 1)).T.reshape(-1)
    close(adv.rloo_advantages(score, n), trl)
    close(adv.rloo_advantages(score, n), (g - (g.sum(-1, keepdim=True) - g) / (n - 1)).reshape(-1))
    a, _ = adv.critic_free_advantages(score, logp, ref, mask, GRPOSettings(algorithm="reinforce_pp", kl_coef=0.05,
                                                                          clip_reward=0.0, n_samples_per_prompt=n))
    m = mask.float()
    reward = openrlhf_compute_reward(score, 0.05, ppo.kl_k1(logp, ref) * m, mask) * m
    returns = torch.flip(torch.cumsum(torch.flip(reward, [1]), 1), [1]) * m  # get_cumulative_returns, gamma 1
    close(a, openrlhf_whiten(returns, m) * m)


def test_dpo_sft_coef_and_trls_rpo_alpha_nll():
    """TRL's rpo_alpha adds the chosen answers' NLL as one token mean over the batch; sft_coef adds each pair's token
    mean, then the mean over pairs: the same when the chosen answers are equally long, not otherwise."""
    g = torch.Generator().manual_seed(0)
    token_logps = -torch.rand(3, 5, generator=g)
    for lengths in ([5, 5, 5], [2, 5, 3]):
        mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
        trl = -(token_logps * mask).sum() / mask.sum()  # CrossEntropyLoss(ignore_index=-100) over the chosen tokens
        ours = losses.chosen_nll((token_logps * mask).sum(-1), mask.sum(-1)).mean()
        assert (abs(float(ours - trl)) < 1e-6) == (len(set(lengths)) == 1)

"""PPO math against hand-derived numbers (pipelines/rlhf/ppo.py, and the ``ppo`` entry of losses.POLICY_LOSSES)."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.engines.settings import FieldError
from multiengine.pipelines.rlhf import ppo
from multiengine.pipelines.rlhf.losses import PolicyLossInputs, policy_loss
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings


def ppo_loss(logp, old, adv, mask, clip_eps=0.2, dual_clip=0.0, global_token_count=None):
    """The ``ppo`` policy loss, token mean (over ``global_token_count`` when given)."""
    return policy_loss("ppo", PolicyLossInputs(logp, old, adv, mask, denominator=global_token_count),
                       PPOSettings(clip_eps=clip_eps, dual_clip=dual_clip))


def close(a: torch.Tensor, b, atol: float = 1e-6) -> None:
    b = torch.as_tensor(b, dtype=a.dtype)
    assert torch.allclose(a, b, atol=atol), f"{a} != {b}"


# --------------------------------------------------------------------------------------------------
# log-probs
# --------------------------------------------------------------------------------------------------


def test_logprobs_temperature_hand_values():
    # logits = log p with p = (0.2, 0.3, 0.5): at T=1 the log-prob of token 2 is log 0.5.
    logits = torch.log(torch.tensor([[[0.2, 0.3, 0.5]]]))
    labels = torch.tensor([[2]])
    close(ppo.logprobs_from_logits(logits, labels), [[math.log(0.5)]])
    # T=2 gives probs proportional to sqrt(p): sqrt(.5) / (sqrt(.2) + sqrt(.3) + sqrt(.5))
    #   = 0.70711 / (0.44721 + 0.54772 + 0.70711) = 0.70711 / 1.70204 = 0.41545
    close(ppo.logprobs_from_logits(logits, labels, temperature=2.0), [[math.log(0.41545)]], atol=1e-4)
    with pytest.raises(ValueError):
        ppo.logprobs_from_logits(logits, labels, temperature=0.0)


def test_response_logprobs_uses_shifted_logits():
    # Row b, position i of the logits puts all its mass on token 10*b + i + 1 (the "next" token).
    B, L, V, ctx = 2, 6, 32, 3
    logits = torch.full((B, L, V), -1e4)
    for b in range(B):
        for i in range(L):
            logits[b, i, 10 * b + i + 1] = 0.0
    input_ids = torch.tensor([[10 * b + i for i in range(L)] for b in range(B)])
    out = ppo.response_logprobs(logits, input_ids, ctx, temperature=1.0)
    assert out.shape == (B, L - ctx)
    # correct alignment: every response token is the predicted one -> log-prob 0
    close(out, torch.zeros(B, L - ctx), atol=1e-5)
    # the unshifted alignment would be wildly wrong
    wrong = ppo.logprobs_from_logits(logits[:, ctx:], input_ids[:, ctx:])
    assert (wrong < -1000).all()
    with pytest.raises(ValueError):
        ppo.response_logprobs(logits, input_ids, 0)


def test_response_values_alignment():
    values = torch.arange(6.0).reshape(1, 6)
    close(ppo.response_values(values, 2), [[1.0, 2.0, 3.0, 4.0]])


# --------------------------------------------------------------------------------------------------
# masks
# --------------------------------------------------------------------------------------------------

EOS, PAD = 2, 0


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([5, 6, 2, 0, 0], [1, 1, 1, 0, 0]),  # EOS in the middle, padding after
        ([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]),  # no EOS: truncated answer, all actions
        ([2, 0, 0, 0, 0], [1, 0, 0, 0, 0]),  # EOS first
        ([5, 2, 7, 2, 8], [1, 1, 0, 0, 0]),  # tokens after the first EOS are not actions
        # a pad id before the first EOS was sampled: an ordinary action, the mask stays a prefix
        ([5, 0, 6, 2, 0], [1, 1, 1, 1, 0]),
        ([5, 6, 0, 0, 0], [1, 1, 1, 1, 1]),  # no EOS: every token was sampled, pad ids included
    ],
)
def test_action_mask_cases(ids, expected):
    mask = ppo.action_mask(torch.tensor([ids]), EOS)
    assert mask.dtype == torch.bool
    assert mask.long().tolist() == [expected]


def test_action_mask_pad_equals_eos():
    # decoder-only models often pad with EOS: the first EOS is an action, the rest padding
    mask = ppo.action_mask(torch.tensor([[5, 2, 2, 2], [5, 6, 7, 2]]), eos_token_id=2)
    assert mask.long().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_truncate_after_eos_and_no_eos_penalty():
    ids = torch.tensor([[5, 2, 7, 8], [5, 6, 7, 8]])
    assert ppo.truncate_after_eos(ids, EOS, PAD).tolist() == [[5, 2, 0, 0], [5, 6, 7, 8]]
    score = torch.tensor([1.0, 1.0])
    close(ppo.apply_no_eos_penalty(score, ids, EOS, 0.5), [1.0, 0.5])


# --------------------------------------------------------------------------------------------------
# rewards and KL
# --------------------------------------------------------------------------------------------------


def test_compute_rewards_hand_values():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    score = torch.tensor([10.0, -2.0])
    # row 0: k1 = (0.5, -1, 0) -> -0.1 * k1 = (-0.05, 0.1, 0); score 10 clipped to 5 on index 1
    # row 1: k1 = 0; score -2 (inside the clip) on the last index 2
    rewards = ppo.compute_rewards(score, logp, ref, mask, kl_coef=0.1, clip_reward=5.0)
    close(rewards, [[-0.05, 5.1, 0.0], [0.0, 0.0, -2.0]])
    # no clipping
    rewards = ppo.compute_rewards(score, logp, ref, mask, kl_coef=0.1, clip_reward=0.0)
    close(rewards[0], [-0.05, 10.1, 0.0])


def test_compute_rewards_empty_row_gets_nothing():
    rewards = ppo.compute_rewards(
        torch.tensor([3.0]), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3), kl_coef=0.1
    )
    close(rewards, [[0.0, 0.0, 0.0]])


def test_kl_estimators():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    close(ppo.kl_k1(logp, ref), [math.log(2.0)])
    # k3: r = ref - logp = -ln 2; e^r - r - 1 = 0.5 + 0.693147 - 1 = 0.193147
    close(ppo.kl_k3(logp, ref), [0.193147], atol=1e-5)
    close(ppo.kl_k3(logp, logp), [0.0])


def test_adaptive_kl_controller_numbers():
    ctl = ppo.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=256)  # error 1.0 clipped to 0.2 -> x (1 + 0.2*256/1e4) = 1.00512
    assert ctl.value == pytest.approx(0.100512)
    ctl.update(current_kl=3.0, n_steps=256)  # error -0.5 clipped to -0.2 -> x 0.99488
    assert ctl.value == pytest.approx(0.100512 * 0.99488)
    ctl.update(current_kl=6.6, n_steps=100)  # error 0.1 (inside the clip) -> x 1.001
    assert ctl.value == pytest.approx(0.100512 * 0.99488 * 1.001)
    restored = ppo.AdaptiveKLController(0.5, 1.0, 1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.target == 6.0

    fixed = ppo.FixedKLController(0.05)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.05


# --------------------------------------------------------------------------------------------------
# GAE and statistics
# --------------------------------------------------------------------------------------------------


def test_gae_hand_values_gamma1_lambda_half():
    # 3 action tokens + 1 padding token whose reward/value must be ignored.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma = 1, lambda = 0.5, V after the last action = 0:
    #   t=2: delta = 1 + 0 - 0.3 = 0.7;           A2 = 0.7
    #   t=1: delta = 0 + 0.3 - 0.4 = -0.1;        A1 = -0.1 + 0.5 * 0.7  = 0.25
    #   t=0: delta = 0 + 0.4 - 0.5 = -0.1;        A0 = -0.1 + 0.5 * 0.25 = 0.025
    # returns = A + V = (0.525, 0.65, 1.0)
    adv, ret = ppo.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    close(adv, [[0.025, 0.25, 0.7, 0.0]])
    close(ret, [[0.525, 0.65, 1.0, 0.0]])


def test_gae_discount():
    # gamma = 0.5, lambda = 1: A_t = sum_k 0.5^k r_{t+k} - V_t (Monte Carlo)
    rewards = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.0, 0.0]])
    adv, ret = ppo.gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=1.0)
    close(adv, [[1.5, 1.0]])
    close(ret, [[1.5, 1.0]])


def test_masked_mean_var():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    close(ppo.masked_mean(x, mask), 2.0)
    close(ppo.masked_var(x, mask), 2.0 / 3.0)  # ((-1)^2 + 0 + 1^2) / 3
    close(ppo.masked_var(x, mask, unbiased=True), 1.0)  # / (3 - 1)
    close(ppo.masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [1, 0]]), dim=1), [2.0, 5.0])
    close(ppo.masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty mask: 0, not NaN


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    s = 1.0 / math.sqrt(2.0 / 3.0 + 1e-8)  # mean 2, population var 2/3
    close(ppo.masked_whiten(x, mask), [[-s, 0.0, s, 0.0]], atol=1e-5)
    close(ppo.masked_whiten(x, mask, shift_mean=False), [[2.0 - s, 2.0, 2.0 + s, 0.0]], atol=1e-5)


def _fake_two_rank_all_reduce(monkeypatch, other_rank_tensor_fn):
    """Pretend torch.distributed is up with one other rank contributing other_rank_tensor_fn(t)."""
    monkeypatch.setattr(ppo, "_dist_active", lambda: True)

    def all_reduce(tensor, op=None, group=None):
        tensor.add_(other_rank_tensor_fn(tensor))

    monkeypatch.setattr(ppo.dist, "all_reduce", all_reduce)


def test_masked_whiten_uses_global_batch_statistics(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(4, 5)
    mask = torch.ones(4, 5)
    mask[0, 3:] = 0
    mask[3, 1:] = 0
    full = ppo.masked_whiten(x, mask)
    # rank 0 holds rows 0-1; "rank 1" holds rows 2-3 and contributes its sum, sum of squares, count
    xo, mo = x[2:].double() * mask[2:].double(), mask[2:].double()
    other = torch.stack([xo.sum(), (xo * xo).sum(), mo.sum()])
    _fake_two_rank_all_reduce(monkeypatch, lambda t: other)
    close(ppo.masked_whiten(x[:2], mask[:2]), full[:2], atol=1e-5)


def test_global_token_count(monkeypatch):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(ppo.global_token_count(mask), 3.0)
    _fake_two_rank_all_reduce(monkeypatch, lambda t: torch.tensor(4.0))
    close(ppo.global_token_count(mask), 7.0)


# --------------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------------


def test_policy_loss_clip_positive_and_negative_advantages():
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5]])
    old = torch.zeros(1, 4)
    logp = torch.log(ratio).requires_grad_(True)
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
    # eps = 0.2, per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   A=+2, r=1.5: max(-3.0, -2.4) = -2.4  (clipped: no incentive beyond 1+eps)
    #   A=+2, r=0.5: max(-1.0, -1.6) = -1.0  (unclipped: the pessimistic branch)
    #   A=-2, r=1.5: max( 3.0,  2.4) =  3.0  (unclipped)
    #   A=-2, r=0.5: max( 1.0,  1.6) =  1.6  (clipped)
    # mean = (-2.4 - 1.0 + 3.0 + 1.6) / 4 = 0.3; clip fraction 2/4
    loss, stats = ppo_loss(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    close(loss.detach(), 0.3, atol=1e-5)
    close(stats["clip_frac"], 0.5)
    close(stats["clip_frac_high"], 0.25)  # A > 0, r > 1.2
    close(stats["clip_frac_low"], 0.25)  # A < 0, r < 0.8
    # approx_kl = 0.5 * mean(log r ^ 2) = 0.5 * (2 ln(1.5)^2 + 2 ln(0.5)^2) / 4
    close(stats["approx_kl"], 0.25 * (math.log(1.5) ** 2 + math.log(0.5) ** 2), atol=1e-5)
    loss.backward()
    # clipped tokens get no gradient; unclipped: d(-A r)/d logp / 4 = -A r / 4
    close(logp.grad, [[0.0, -2.0 * 0.5 / 4, 2.0 * 1.5 / 4, 0.0]], atol=1e-5)


def test_policy_loss_mask_excludes_tokens():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 3.0, 1000.0]])
    loss, _ = ppo_loss(logp, logp, adv, torch.tensor([[1, 1, 0]]))
    close(loss, -2.0)  # ratio 1: mean(-A) over the first two tokens


def test_policy_loss_ratio_clamped():
    # a log-ratio of 100 would overflow exp(); it is clamped to 20
    loss, stats = ppo_loss(torch.tensor([[100.0]]), torch.zeros(1, 1), torch.tensor([[-1.0]]),
                                  torch.ones(1, 1))
    assert torch.isfinite(loss)
    close(stats["ratio_max"], math.exp(20.0), atol=1.0)


def test_policy_loss_dual_clip():
    ratio = torch.tensor([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    logp, old, mask = torch.log(ratio), torch.zeros(1, 3), torch.ones(1, 3)
    # standard: A=-1 r=5 -> max(5, 1.2) = 5; A=-1 r=2 -> 2; A=+1 r=5 -> max(-5, -1.2) = -1.2
    loss, _ = ppo_loss(logp, old, adv, mask)
    close(loss, (5.0 + 2.0 - 1.2) / 3, atol=1e-5)
    # dual clip c=3 caps negative-advantage tokens at -c*A = 3: (3 + 2 - 1.2) / 3
    loss, stats = ppo_loss(logp, old, adv, mask, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2) / 3, atol=1e-5)
    close(stats["dual_clip_frac"], 1.0 / 3.0)
    with pytest.raises(FieldError, match="dual_clip"):
        ppo_loss(logp, old, adv, mask, dual_clip=1.0)


def _random_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    logp = torch.randn(B, T, generator=g) * 0.3
    old = torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, T, generator=g)
    lengths = torch.tensor([5, 1, 2, 5, 4, 3])  # unequal token counts per half
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return logp, old, adv, mask


def test_policy_loss_invariant_to_splitting_with_global_token_count():
    logp, old, adv, mask = _random_batch()
    n = ppo.global_token_count(mask)
    full_mean, _ = ppo_loss(logp, old, adv, mask)
    full, _ = ppo_loss(logp, old, adv, mask, global_token_count=n)
    halves = [ppo_loss(logp[s], old[s], adv[s], mask[s], global_token_count=n)[0]
              for s in (slice(0, 3), slice(3, 6))]
    close(full, full_mean.item(), atol=1e-6)  # on one rank, sum / N == token mean
    close(halves[0] + halves[1], full.item(), atol=1e-6)
    # averaging per-half token means (what DP averaging does) is not: the halves hold 8 and 12 tokens
    naive = [ppo_loss(logp[s], old[s], adv[s], mask[s])[0] for s in (slice(0, 3), slice(3, 6))]
    assert abs((naive[0] + naive[1]) / 2 - full) > 1e-3


def test_policy_loss_split_gradients_match():
    logp, old, adv, mask = _random_batch(1)
    n = mask.sum()
    a = logp.clone().requires_grad_(True)
    ppo_loss(a, old, adv, mask, global_token_count=n)[0].backward()
    b = logp.clone().requires_grad_(True)
    for s in (slice(0, 3), slice(3, 6)):
        ppo_loss(b[s], old[s], adv[s], mask[s], global_token_count=n)[0].backward()
    close(a.grad, b.grad, atol=1e-7)


def test_value_loss_hand_values():
    values = torch.tensor([[1.0, 0.6, 5.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: unclipped (1-2)^2 = 1; V clipped to 0.5+0.2 = 0.7 -> (0.7-2)^2 = 1.69; 0.5*max = 0.845
    # token 1: V = 0.6 within 0.5 +/- 0.2 -> 0.5 * 0.36 = 0.18; token 2 masked
    loss, stats = ppo.value_loss(values, old, returns, mask, clip_eps=0.2)
    close(loss.detach(), (0.845 + 0.18) / 2, atol=1e-6)
    close(stats["clip_frac"], 0.5)
    loss.backward()
    close(values.grad, [[0.0, 0.6 / 2, 0.0]], atol=1e-6)  # clipped branch has no gradient
    loss, _ = ppo.value_loss(values, old, returns, mask, clip_eps=0.0)  # 0: unclipped
    close(loss.detach(), (0.5 + 0.18) / 2, atol=1e-6)
    loss_sum, _ = ppo.value_loss(values, old, returns, mask, global_token_count=4)
    close(loss_sum.detach(), (0.845 + 0.18) / 4, atol=1e-6)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]]])
    close(ppo.entropy_from_logits(logits), [[math.log(4.0), 0.0]], atol=1e-5)
    # p = (0.2, 0.3, 0.5): H = -(0.2 ln .2 + 0.3 ln .3 + 0.5 ln .5) = 1.029653
    close(ppo.entropy_from_logits(torch.log(torch.tensor([[[0.2, 0.3, 0.5]]]))), [[1.029653]], atol=1e-5)

"""GRPO-family policy losses (the ``dapo`` and ``gspo`` entries of losses.POLICY_LOSSES, losses.aggregate_loss),
DAPO's overlong penalty (advantages.py) and dynamic sampling (pipelines/rlhf/dynamic_sampling.py) against
hand-derived values and against the public reference formulas (TRL's GRPO loss, verl's policy losses),
re-implemented here in a few lines each."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.engines.settings import FieldError
from multiengine.pipelines.rlhf import advantages as adv
from multiengine.pipelines.rlhf import losses
from multiengine.pipelines.rlhf.dynamic_sampling import (
    DynamicSampler,
    collect_groups,
    filter_groups,
    group_row_indices,
    round_seed,
)
from multiengine.pipelines.rlhf.grpo import GRPOSettings
from multiengine.pipelines.rlhf.rollout import sampling_seed

ATOL = 1e-6


def clipped(name, logp, old, a, mask, clip_low=0.2, clip_high=0.28, dual_clip=0.0, mode="token_mean", horizon=None):
    """The policy loss ``name`` with GRPO settings (clip_low / clip_high / dual_clip) and ``mode`` aggregation."""
    settings = GRPOSettings(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    return losses.policy_loss(name, losses.PolicyLossInputs(logp, old, a, mask, mode, horizon=horizon), settings)


def close(a, b, atol: float = ATOL) -> None:
    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    assert torch.allclose(a, b, atol=atol, rtol=0), f"{a} != {b}"


# --------------------------------------------------------------------------------------------------
# reference formulas, re-implemented from the public code (TRL GRPOTrainer._compute_loss; verl core_algos)
# --------------------------------------------------------------------------------------------------


def trl_grpo_loss(logp, old, a, mask, eps_low, eps_high, level, loss_type, max_len):
    """TRL: coef_1 = exp(log importance weight), coef_2 = clamp(coef_1, 1-eps_low, 1+eps_high),
    per-token -min(coef_1 A, coef_2 A), reduced by loss_type; clip ratios low/high as TRL logs them."""
    log_ratio = logp - old
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    c1 = torch.exp(liw)
    c2 = torch.clamp(c1, 1 - eps_low, 1 + eps_high)
    ptl = -torch.min(c1 * a.unsqueeze(1), c2 * a.unsqueeze(1))
    if loss_type == "grpo":
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type in ("bnpo", "dapo"):
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    else:  # dr_grpo
        loss = (ptl * mask).sum() / (ptl.size(0) * max_len)

    def mbm(x):
        return x.mean() if x.shape[1] == 1 else (x * mask).sum() / mask.sum().clamp(min=1.0)

    low = mbm(((c1 < 1 - eps_low) & (a.unsqueeze(1) < 0)).float())
    high = mbm(((c1 > 1 + eps_high) & (a.unsqueeze(1) > 0)).float())
    return loss, low, high


def verl_agg_loss(loss_mat, mask, mode, scale=None):
    """verl agg_loss (the version without global-batch arguments)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * mask).sum(-1) / mask.sum(-1)).mean()
    return (loss_mat * mask).sum(-1).sum() / (mask.shape[-1] if scale is None else scale)  # seq-mean-token-sum-norm


def verl_vanilla(old, logp, a, clip_low, clip_high, clip_c):
    """verl compute_policy_loss's per-token losses: asymmetric clip, then dual clip (clip_ratio_c) on A < 0."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    l1 = -a * ratio
    l2 = -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    c1 = torch.maximum(l1, l2)
    c2 = torch.min(-a * clip_c, c1)
    return torch.where(a < 0, c2, c1)


def verl_gspo(old, logp, a, mask, clip_low, clip_high):
    """verl compute_policy_loss_gspo: s_i,t = sg[s_i] * pi / sg[pi], seq-mean-token-mean."""
    seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(logp - logp.detach() + seq.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    loss = torch.maximum(-a * s, -a * torch.clamp(s, 1 - clip_low, 1 + clip_high))
    return verl_agg_loss(loss, mask, "seq-mean-token-mean")


def random_batch(seed: int, masked_row: bool, B: int = 9, T: int = 7, G: int = 3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    # token noise plus a per-row shift, so that both token and sequence ratios leave the clip range
    logp = (old + 0.3 * torch.randn(B, T, generator=g) + 0.5 * torch.randn(B, 1, generator=g)).requires_grad_(True)
    scores = torch.randint(0, 3, (B,), generator=g).float()
    scores[G:2 * G] = 1.0  # an all-equal group: advantage 0
    a = adv.grpo_advantages(scores, G)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if masked_row:
        lengths[1] = 0
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return logp, old, a, mask


# --------------------------------------------------------------------------------------------------
# hand-derived values
# --------------------------------------------------------------------------------------------------


def hand_batch():
    # ratios: row 0 (A=+1): 1.5, 0.9; row 1 (A=-1): 0.5, 1.1
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]])).requires_grad_(True)
    return logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2)


def test_asymmetric_clip_hand_values():
    logp, old, a, mask = hand_batch()
    # clip 0.2 / 0.28: row 0 t0 clipped high at 1.28 -> -1.28; row 1 t0 clipped low at 0.8 -> 0.8
    loss, stats = clipped("dapo", logp, old, a, mask)
    close(loss, (-1.28 - 0.9 + 0.8 + 1.1) / 4)
    close(stats["clip_frac_low"], 0.25)
    close(stats["clip_frac_high"], 0.25)
    close(stats["clip_frac"], 0.5)
    # the gradient stops exactly on the clipped tokens: d/dlogp = -A r / 4 elsewhere
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, -0.9 / 4], [0.0, 1.1 / 4]])
    # clip-higher 0.6: row 0 t0 is no longer clipped (-1.5)
    loss, stats = clipped("dapo", logp, old, a, mask, clip_high=0.6)
    close(loss, (-1.5 - 0.9 + 0.8 + 1.1) / 4)
    close(stats["clip_frac_high"], 0.0)
    # the ppo entry clips both sides at 1 +/- clip_eps (0.2): -1.2 for row 0 t0
    loss, stats = clipped("ppo", logp, old, a, mask)
    close(loss, (-1.2 - 0.9 + 0.8 + 1.1) / 4)
    close(stats["clip_frac"], 0.5)


def test_sequence_level_hand_values():
    logp, old, a, mask = hand_batch()
    s0, s1 = math.sqrt(1.5 * 0.9), math.sqrt(0.5 * 1.1)  # exp of the mean log-ratio
    close(losses.sequence_log_ratio(logp, old, mask), [math.log(s0), math.log(s1)])
    # per token (-s0, -s0) and (0.8, 0.8): row 1's s1 = 0.7416 < 0.8 with A < 0 is clipped
    loss, stats = clipped("gspo", logp, old, a, mask)
    close(loss, (-2 * s0 + 1.6) / 4)
    close(stats["clip_frac_low"], 0.5)  # one row of two
    close(stats["clip_frac_high"], 0.0)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-s0 / 4, -s0 / 4], [0.0, 0.0]])  # sg[s_i] * d logp: s_i per token, no 1/|o| inside


def test_symmetric_dapo_equals_ppo():
    logp, old, a, mask = random_batch(0, masked_row=True)
    a2 = a[:, None].expand_as(mask)
    for mode in losses.LOSS_AGG_MODES:
        ours, stats = clipped("dapo", logp, old, a2, mask, 0.2, None, 3.0, mode, horizon=9)
        ref, ref_stats = clipped("ppo", logp, old, a2, mask, None, None, 3.0, mode, horizon=9)
        close(ours, ref)
        for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl"):
            close(stats[key], ref_stats[key])


def test_overlong_penalty_hand_and_reference():
    lengths = torch.tensor([0, 3, 6, 7, 8, 10, 12])
    # max 10, buffer 4: no penalty up to 6, -1/4 per token after, -1 at 10 and beyond
    close(adv.overlong_penalty(lengths, 10, 4, 1.0), [0, 0, 0, -0.25, -0.5, -1.0, -1.0])
    close(adv.overlong_penalty(lengths, 10, 4, 0.5), [0, 0, 0, -0.125, -0.25, -0.5, -0.5])
    # verl's DAPO reward manager: min(-(L - (max - buffer)) / buffer * factor, 0), for L <= max
    for L in range(0, 11):
        verl = min(-(L - (10 - 4)) / 4 * 0.7, 0)
        close(adv.overlong_penalty(torch.tensor([L]), 10, 4, 0.7), [verl])
    with pytest.raises(ValueError, match="overlong_buffer"):
        adv.overlong_penalty(lengths, 10, 11)
    with pytest.raises(ValueError, match="overlong_penalty"):
        adv.overlong_penalty(lengths, 10, 4, -1.0)


def test_bad_clip_values_name_the_key():
    for bad in ({"clip_low": 1.0}, {"clip_high": -0.1}, {"importance_level": "group"}, {"dual_clip": 1.0}):
        with pytest.raises(FieldError, match=next(iter(bad))):
            GRPOSettings(**bad)
    # clip_low null is clip_eps, the lower bound 1 - clip_eps of the dapo / gspo clips
    with pytest.raises(FieldError, match="clip_eps"):
        GRPOSettings(clip_eps=1.0, clip_high=0.28)
    with pytest.raises(FieldError, match="clip_eps"):
        GRPOSettings(clip_eps=1.5, importance_level="sequence")
    assert GRPOSettings(clip_eps=1.5, clip_low=0.2, importance_level="sequence").objective == "gspo"
    assert [GRPOSettings(**kw).objective for kw in ({}, {"clip_low": 0.2}, {"clip_high": 0.28})] == [
        "ppo", "dapo", "dapo"]


# --------------------------------------------------------------------------------------------------
# against the reference formulas on random inputs
# --------------------------------------------------------------------------------------------------

_TRL_TYPE = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", list(_TRL_TYPE))
@pytest.mark.parametrize("masked_row", [False, True])
def test_matches_trl_grpo_loss(level, mode, masked_row):
    reached = torch.zeros(2)
    for seed in range(3):
        logp, old, a, mask = random_batch(seed, masked_row)
        name = "gspo" if level == "sequence" else "dapo"
        ours, stats = clipped(name, logp, old, a[:, None].expand_as(mask), mask, mode=mode, horizon=9)
        ref, low, high = trl_grpo_loss(logp, old, a, mask, 0.2, 0.28, level, _TRL_TYPE[mode], 9)
        assert torch.isfinite(ours)
        close(ours, ref)
        g_ours, g_ref = torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0]
        assert torch.isfinite(g_ours).all()
        close(g_ours, g_ref)
        if not masked_row:  # TRL's sequence-level fractions count every row; ours the rows with tokens
            close(stats["clip_frac_low"], low)
            close(stats["clip_frac_high"], high)
        if level == "token":
            close(stats["clip_frac_low"], low)
            close(stats["clip_frac_high"], high)
        reached += torch.stack([stats["clip_frac_low"], stats["clip_frac_high"]])
    assert (reached > 0).all()  # the inputs reach both clip bounds


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_matches_verl_policy_loss_and_agg_loss(mode):
    ours_mode = mode.replace("-", "_")
    for seed in range(3):
        logp, old, a, mask = random_batch(seed, masked_row=False)  # verl's seq-mean divides 0 / 0 on an empty row
        a2 = a[:, None].expand_as(mask)
        ours, _ = clipped("dapo", logp, old, a2, mask, dual_clip=3.0, mode=ours_mode, horizon=9)
        ref = verl_agg_loss(verl_vanilla(old, logp, a2, 0.2, 0.28, 3.0), mask, mode, scale=9)
        if mode == "seq-mean-token-sum-norm":  # verl sums over rows; Dr. GRPO (and TRL) take the mean of rows
            ref = ref / mask.shape[0]
        close(ours, ref)
        close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0])


def verl_compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                     clip_ratio=0.2, clip_ratio_c=3.0):
    """verl core_algos.compute_policy_loss_vanilla with its defaults (clip_ratio 0.2 both sides, clip_ratio_c 3.0,
    always on) and agg_loss: (pg_loss, pg_clipfrac, pg_clipfrac_lower)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).float() * response_mask).sum() / response_mask.sum()
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    pg_clipfrac_lower = (lower * response_mask).sum() / response_mask.sum()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode, scale=9), pg_clipfrac, pg_clipfrac_lower


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_ppo_entry_with_dual_clip_3_is_verls_vanilla_policy_loss(mode):
    """verl's vanilla loss always caps negative-advantage tokens at clip_ratio_c = 3; GRPO's and PPO's default
    (dual_clip 0) has no cap, and dual_clip=3.0 reproduces verl's: token-level advantages, same random inputs."""
    from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings

    reached = 0.0
    for seed in range(4):
        logp, old, _, mask = random_batch(seed, masked_row=False)
        a = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 10))
        ref, clipfrac, lower = verl_compute_policy_loss_vanilla(old, logp, a, mask, mode)
        if mode == "seq-mean-token-sum-norm":  # verl sums over rows; Dr. GRPO (and TRL) take the mean of rows
            ref = ref / mask.shape[0]
        g_ref = torch.autograd.grad(ref, logp)[0]
        inputs = losses.PolicyLossInputs(logp, old, a, mask, mode.replace("-", "_"), horizon=9)
        for settings in (GRPOSettings(dual_clip=3.0), PPOSettings(dual_clip=3.0)):
            ours, stats = losses.policy_loss("ppo", inputs, settings)
            close(ours, ref)
            close(torch.autograd.grad(ours, logp)[0], g_ref)
            close(stats["clip_frac"], clipfrac)
            close(stats["dual_clip_frac"], lower)
        plain, _ = losses.policy_loss("ppo", inputs, GRPOSettings())  # the default: no cap
        reached += float(lower)
        assert float(lower) == 0 or abs(float(plain) - float(ref)) > 1e-4
    assert reached > 0  # the inputs reach the cap


def test_gspo_token_matches_verl_gspo_and_trl_sequence():
    for seed in range(4):
        for masked_row in (False, True):
            logp, old, a, mask = random_batch(seed, masked_row)
            a2 = a[:, None].expand_as(mask)
            ours, _ = clipped("gspo", logp, old, a2, mask, mode="seq_mean_token_mean")
            g_ours = torch.autograd.grad(ours, logp)[0]
            ref = verl_gspo(old, logp, a2, mask, 0.2, 0.28)
            if not masked_row:  # verl's seq-mean-token-mean is 0 / 0 on an empty row
                close(ours, ref)
                close(g_ours, torch.autograd.grad(ref, logp)[0])
            trl, _, _ = trl_grpo_loss(logp, old, a, mask, 0.2, 0.28, "sequence", "grpo", 9)
            close(ours, trl)
            close(g_ours, torch.autograd.grad(trl, logp)[0])
            assert torch.isfinite(g_ours).all()


def test_aggregation_modes_match_references_on_fully_masked_rows():
    g = torch.Generator().manual_seed(5)
    per_token = torch.randn(5, 6, generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([6, 0, 3, 1, 0])[:, None]).float()
    close(losses.aggregate_loss(per_token, mask, "token_mean"), (per_token * mask).sum() / mask.sum())
    # TRL "grpo": an empty row adds 0 and still counts as a row
    close(losses.aggregate_loss(per_token, mask, "seq_mean_token_mean"),
          ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean())
    close(losses.aggregate_loss(per_token, mask, "seq_mean_token_sum_norm", horizon=8),
          (per_token * mask).sum() / (5 * 8))
    empty = torch.zeros_like(mask)
    for mode in losses.LOSS_AGG_MODES:
        out = losses.aggregate_loss(per_token, empty, mode)
        assert torch.isfinite(out) and float(out) == 0.0


# --------------------------------------------------------------------------------------------------
# dynamic sampling
# --------------------------------------------------------------------------------------------------


def test_filter_groups_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.6]])
    f = filter_groups(rewards)
    assert f.keep.tolist() == [True, False, False, True]
    assert (f.kept, f.dropped, f.total) == (2, 2, 4)
    assert f.dropped_rate == 0.5
    assert filter_groups(torch.tensor([[3.0], [3.0]])).keep.tolist() == [True, True]  # groups of one are kept
    with pytest.raises(ValueError, match="non-finite"):
        filter_groups(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="n_groups"):
        filter_groups(torch.zeros(4))


def test_filter_groups_matches_reference_on_random_integer_rewards():
    # verl's DAPO filter keeps a group when the std of its metric is > 0 (exact for integer rewards)
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (200, 4), generator=g).float()
    f = filter_groups(rewards)
    assert f.keep.tolist() == (rewards.std(-1) > 0).tolist()
    assert f.kept + f.dropped == 200 and 0 < f.dropped < 200


def test_group_row_indices_and_round_seed():
    assert group_row_indices(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]
    assert round_seed(7, 11, 0, 1) == sampling_seed(7, 11, 1)
    assert len({round_seed(7, 11, r, 1) for r in range(5)}) == 5


def test_sampler_accumulates_until_target_and_counts():
    s = DynamicSampler(target_groups=3, max_rounds=3)
    s.add(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0], [0.0, 0.0]]), "r0")
    assert s.needs_more and s.n_kept == 2
    s.add(torch.tensor([[1.0, 1.0], [2.0, 2.0], [0.0, 1.0], [1.0, 0.0]]), "r1")
    assert not s.needs_more
    selection, m = s.take()
    assert [(p, i.tolist()) for p, i in selection] == [("r0", [0, 2]), ("r1", [2])]
    assert m == {"dynamic/rounds": 2.0, "dynamic/groups_seen": 8.0, "dynamic/groups_dropped": 4.0,
                 "dynamic/dropped_rate": 0.5, "dynamic/filled": 0.0, "dynamic/surplus": 1.0}
    assert s.totals == {"steps": 1, "rounds": 2, "groups": 8, "dropped": 4, "filled": 0}


def test_sampler_cap_fill_and_error():
    flat = torch.ones(3, 2)
    s = DynamicSampler(target_groups=2, max_rounds=2, on_cap="fill")
    s.add(torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 2.0]]), "a")
    s.add(flat, "b")
    assert not s.needs_more  # cap reached
    selection, m = s.take()
    assert [(p, i.tolist()) for p, i in selection] == [("a", [0]), ("a", [1])]  # completed with the first flat group
    assert m["dynamic/filled"] == 1.0 and m["dynamic/dropped_rate"] == 5 / 6
    s = DynamicSampler(target_groups=2, max_rounds=1, on_cap="error")
    s.add(flat, None)
    with pytest.raises(ValueError, match="max_resample_rounds=1"):
        s.take()
    with pytest.raises(ValueError, match="on_cap"):
        DynamicSampler(2, on_cap="pad")


def _round_rewards(seed: int, step: int, round_: int, rank: int, n_groups: int = 4, G: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(round_seed(seed, step, round_, rank))
    return torch.randint(0, 2, (n_groups, G), generator=g).float()


def _run_steps(sampler: DynamicSampler, steps: range, seed: int = 3) -> list:
    out = []
    for step in steps:
        selection, metrics = collect_groups(lambda r, step=step: (_round_rewards(seed, step, r, 0), (step, r)),
                                            sampler)
        out.append(([(p, i.tolist()) for p, i in selection], metrics))
    return out


def test_sampler_resume_is_bit_equal():
    straight = DynamicSampler(target_groups=4, max_rounds=3)
    full = _run_steps(straight, range(6))
    first = DynamicSampler(target_groups=4, max_rounds=3)
    head = _run_steps(first, range(3))
    state = first.state_dict()
    resumed = DynamicSampler(target_groups=4, max_rounds=3)
    resumed.load_state_dict(state)
    tail = _run_steps(resumed, range(3, 6))
    assert head + tail == full
    assert resumed.state_dict() == straight.state_dict()
    assert any(m["dynamic/groups_dropped"] > 0 for _, m in full)  # the test exercises dropping
    with pytest.raises(ValueError, match="rollout_batch_size"):
        DynamicSampler(target_groups=2).load_state_dict(state)


def test_collect_groups_keeps_ranks_in_step():
    # this rank is full after round 0, another rank is not: it samples on (surplus) until sync says stop
    calls = []

    def sample(r):
        calls.append(r)
        return torch.tensor([[0.0, 1.0], [0.0, 1.0]]), r

    s = DynamicSampler(target_groups=2, max_rounds=4)
    others_need = iter([True, True, False])
    selection, m = collect_groups(sample, s, sync=lambda here: here or next(others_need))
    assert calls == [0, 1, 2]
    assert [(p, i.tolist()) for p, i in selection] == [(0, [0, 1])]
    assert m["dynamic/surplus"] == 4.0 and m["dynamic/rounds"] == 3.0

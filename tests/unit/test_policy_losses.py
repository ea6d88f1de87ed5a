"""The policy-loss registry (pipelines/rlhf/losses.py): one entry point, every entry against the formulas it
replaced, bit for bit on random inputs, and the diffusion entry against hand-derived values.

The references below are the bodies of the three public functions the registry replaced (``ppo.policy_loss``,
``losses.policy_gradient_loss`` and ``policy_variants.clipped_policy_loss``), kept here verbatim (condensed) so that
the trainers' losses and statistics are known to be unchanged for the same inputs."""

from __future__ import annotations

import pytest
import torch
from multiengine.pipelines.diffusion import rl as diffusion_rl
from multiengine.pipelines.rlhf import ppo
from multiengine.pipelines.rlhf.grpo import GRPOSettings
from multiengine.pipelines.rlhf.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    PolicyLossInputs,
    aggregate_loss,
    policy_loss,
    register_policy_loss,
)
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings


# --- the replaced functions, as they were ---------------------------------------------------------------------------
def _old_clipped_max(ratio, advantages, clip_low, clip_high, dual_clip, mask):
    surr1 = -advantages * ratio
    surr2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.max(surr1, surr2)
    stats = {}
    if dual_clip is not None:
        capped = torch.min(per_token, -dual_clip * advantages)
        dual_active = (advantages < 0) & (capped < per_token)
        per_token = torch.where(advantages < 0, capped, per_token)
        stats["dual_clip_frac"] = ppo.masked_mean(dual_active.float(), mask).detach()
    return per_token, (surr2 > surr1).detach(), stats


def _old_ratio_stats(log_ratio, ratio, mask):
    valid = torch.where(mask.bool(), ratio, torch.zeros_like(ratio))
    return {"approx_kl": 0.5 * ppo.masked_mean(log_ratio**2, mask), "ratio_mean": ppo.masked_mean(ratio, mask),
            "ratio_max": valid.max() if valid.numel() else torch.zeros(())}


def _old_clipped_surrogate(logprobs, old_logprobs, advantages, action_mask, clip_eps=0.2, dual_clip=None):
    log_ratio = (logprobs.float() - old_logprobs.float()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages.float().detach()
    mask = action_mask.to(torch.float32)
    per_token, clipped, stats = _old_clipped_max(ratio, advantages, clip_eps, clip_eps, dual_clip, mask)
    with torch.no_grad():
        stats["clip_frac"] = ppo.masked_mean(clipped.float(), mask)
        stats.update(_old_ratio_stats(log_ratio.detach(), ratio.detach(), mask))
    return per_token, stats


def old_policy_gradient_loss(logprobs, old_logprobs, advantages, action_mask, clip_eps=0.2, dual_clip=None,
                             loss_agg="token_mean", denominator=None, horizon=None):
    per_token, stats = _old_clipped_surrogate(logprobs, old_logprobs, advantages, action_mask, clip_eps, dual_clip)
    return aggregate_loss(per_token, action_mask.to(torch.float32), loss_agg, denominator, horizon), stats


def _old_log_importance_weights(logprobs, old_logprobs, mask, level):
    logprobs = logprobs.float()
    if level == "token":
        log_w = logprobs - old_logprobs.float()
    else:
        m = mask.to(torch.float32)
        seq = ((logprobs.detach() - old_logprobs.float()) * m).sum(-1) / m.sum(-1).clamp_min(1.0)
        log_w = logprobs - logprobs.detach() + seq.unsqueeze(-1)
    return log_w.clamp(-20.0, 20.0)


def old_asymmetric(logprobs, old_logprobs, advantages, action_mask, clip_low=0.2, clip_high=None,
                   importance_level="token", dual_clip=None):
    clip_high = clip_low if clip_high is None else clip_high
    mask = action_mask.to(torch.float32)
    ratio = torch.exp(_old_log_importance_weights(logprobs, old_logprobs, mask, importance_level))
    advantages = advantages.float().detach()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(ratio)
    per_token, _, stats = _old_clipped_max(ratio, advantages, clip_low, clip_high, dual_clip, mask)
    with torch.no_grad():
        r = ratio.detach()
        low = ((r < 1.0 - clip_low) & (advantages < 0)).float()
        high = ((r > 1.0 + clip_high) & (advantages > 0)).float()
        if importance_level == "sequence":
            rows = (mask.sum(-1) > 0).float()
            first = mask.argmax(-1, keepdim=True)

            def frac(x):
                return ppo.masked_mean(x.gather(1, first).squeeze(-1), rows)
        else:

            def frac(x):
                return ppo.masked_mean(x, mask)
        stats["clip_frac_low"] = frac(low)
        stats["clip_frac_high"] = frac(high)
        stats["clip_frac"] = stats["clip_frac_low"] + stats["clip_frac_high"]
        stats.update(_old_ratio_stats(logprobs.detach().float() - old_logprobs.float(), r, mask))
    return per_token, stats


def old_clipped_policy_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=0.2, clip_high=None,
                            importance_level="token", dual_clip=None, loss_agg="token_mean", denominator=None,
                            horizon=None):
    per_token, stats = old_asymmetric(logprobs, old_logprobs, advantages, action_mask, clip_low, clip_high,
                                      importance_level, dual_clip)
    return aggregate_loss(per_token, action_mask.to(torch.float32), loss_agg, denominator, horizon), stats


def old_update_plain(logp, old, adv, mask, clip_eps, dual_clip, loss_agg, den, horizon):
    """The old update's symmetric path: policy_gradient_loss plus the per-side shares of the asymmetric surrogate."""
    loss, stats = old_policy_gradient_loss(logp, old, adv, mask, clip_eps, dual_clip, loss_agg, den, horizon)
    zero = torch.zeros(())
    sides = {"clip_frac_low": zero, "clip_frac_high": zero}
    if clip_eps < 1.0:
        with torch.no_grad():
            sides = old_asymmetric(logp.detach(), old, adv, mask, clip_eps, clip_eps)[1]
    return loss, {**stats, "clip_frac_low": sides["clip_frac_low"], "clip_frac_high": sides["clip_frac_high"]}


# --- random inputs --------------------------------------------------------------------------------------------------
def batch(seed: int, B: int = 6, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g) + 0.3 * torch.randn(B, 1, generator=g)
    logp[0, 0] = old[0, 0] + 25.0  # beyond the +/-20 clamp of the log-ratio
    adv = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    return logp, old, adv, (torch.arange(T)[None] < lengths[:, None]).float()


def same(ours, ref):
    loss, stats = ours
    ref_loss, ref_stats = ref
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    for key, value in ref_stats.items():
        assert torch.equal(stats[key], value), (key, stats[key], value)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dual_clip", [0.0, 3.0])
@pytest.mark.parametrize("denominator", [None, 7.5])
@pytest.mark.parametrize("clip_eps", [0.2, 1.5])
def test_ppo_entry_is_the_old_symmetric_loss_bit_for_bit(mode, dual_clip, denominator, clip_eps):
    for seed in range(3):
        logp, old, adv, mask = batch(seed)
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        settings = GRPOSettings(clip_eps=clip_eps, dual_clip=dual_clip)
        ours = policy_loss("ppo", PolicyLossInputs(a, old, adv, mask, mode, denominator, 9), settings)
        ref = old_update_plain(b, old, adv, mask, clip_eps, dual_clip or None, mode, denominator, 9)
        same(ours, ref)
        assert torch.equal(torch.autograd.grad(ours[0], a)[0], torch.autograd.grad(ref[0], b)[0])
        if mode == "token_mean" and not dual_clip:  # ppo.policy_loss, from PPOSettings alike
            ppo_settings = PPOSettings(clip_eps=clip_eps)
            ours = policy_loss("ppo", PolicyLossInputs(a, old, adv, mask, denominator=denominator), ppo_settings)
            same(ours, old_policy_gradient_loss(b, old, adv, mask, clip_eps, None, mode, denominator))


@pytest.mark.parametrize("name, level", [("dapo", "token"), ("gspo", "sequence")])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("bounds", [(0.2, 0.28), (None, 0.28), (0.1, None)])
@pytest.mark.parametrize("per_row", [False, True])
def test_dapo_and_gspo_entries_are_the_old_clipped_policy_loss_bit_for_bit(name, level, mode, bounds, per_row):
    clip_low, clip_high = bounds
    for seed in range(3):
        logp, old, adv, mask = batch(seed)
        if per_row:
            adv = adv[:, 0]
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        settings = GRPOSettings(clip_eps=0.15, clip_low=clip_low, clip_high=clip_high, dual_clip=3.0,
                                importance_level=level)
        assert settings.objective == name
        ours = policy_loss(name, PolicyLossInputs(a, old, adv, mask, mode, 11.0, 9), settings)
        low = 0.15 if clip_low is None else clip_low
        ref = old_clipped_policy_loss(b, old, adv, mask, low, clip_high, level, 3.0, mode, 11.0, 9)
        same(ours, ref)
        assert torch.equal(torch.autograd.grad(ours[0], a)[0], torch.autograd.grad(ref[0], b)[0])


def test_diffusion_entry_hand_values_and_the_function_it_registers():
    # ratios (1.5, 0.5), advantages (+1, -1), clip 0.2: max(-1.5, -1.2) = -1.2 and max(0.5, 0.8) = 0.8 -> mean -0.2
    lp, old = torch.log(torch.tensor([1.5, 0.5])).requires_grad_(True), torch.zeros(2)
    settings = type("DiffusionSettings", (), {"clip_range": 0.2, "adv_clip_max": 0.0})()
    x = PolicyLossInputs(lp, old, torch.tensor([1.0, -1.0]), torch.ones(2))
    loss, stats = policy_loss("diffusion_grpo", x, settings)
    assert loss.item() == pytest.approx(-0.2)
    assert stats["clipfrac"].item() == 1.0
    assert torch.autograd.grad(loss, lp)[0].abs().sum() == 0  # both clipped: no gradient
    # advantages clamped to adv_clip_max, as the function the entry calls
    settings.adv_clip_max = 0.5
    g = torch.Generator().manual_seed(0)
    lp, old, adv = 0.01 * torch.randn(4, 3, generator=g), torch.zeros(4, 3), 3 * torch.randn(4, generator=g)
    same(policy_loss("diffusion_grpo", PolicyLossInputs(lp, old, adv, torch.ones(4, 3)), settings),
         diffusion_rl.clipped_policy_loss(lp, old, adv, 0.2, 0.5))


def test_the_registry_names_its_entries_and_refuses_unknown_or_twice_registered_ones():
    assert {"ppo", "dapo", "gspo", "diffusion_grpo"} <= set(POLICY_LOSSES)
    x = PolicyLossInputs(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="policy loss 'vanilla'; use one of .*'dapo'"):
        policy_loss("vanilla", x, GRPOSettings())
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("ppo")(lambda inputs, settings: (torch.zeros(()), {}))

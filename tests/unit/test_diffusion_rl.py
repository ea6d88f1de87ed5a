"""Diffusion RL math (pipelines/diffusion/rl.py): hand-derived values, the public reference formulas (DDPO's
DDIM step, Flow-GRPO's SDE step, advantages and loss, diffusers' Diffusion-DPO loss) re-implemented here on the same
random draws, diffusers' schedulers in the deterministic limit, and the sampling loop on tiny models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from multiengine.pipelines.diffusion.flow import flow_target
from multiengine.pipelines.diffusion.math import training_target
from multiengine.pipelines.diffusion.rl import (
    DDIMSampler,
    FlowSDESampler,
    clipped_policy_loss,
    ddim_step_with_logprob,
    ddim_timesteps,
    diffusion_dpo_loss,
    diffusion_dpo_loss_from_losses,
    diffusion_grpo_loss,
    flow_inference_sigmas,
    group_advantages,
    kl_to_reference,
    paired,
    rescore,
    sample_with_logprobs,
    sde_step_with_logprob,
    train_step_indices,
)

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def sd_alphas_cumprod() -> torch.Tensor:
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float32) ** 2  # SD's scaled_linear
    return torch.cumprod(1.0 - betas, dim=0)


# --- reference formulas, re-implemented in a few lines -----------------------------------------------
def ref_ddpo_step(out, t, x, ac, n_train, n_inf, eta, prev=None, gen=None):
    """DDPO's DDIM step with log-prob (epsilon prediction): prev index clamped into the table."""
    prev_t = (t - n_train // n_inf).clamp(0, n_train - 1)
    a_t, a_p = ac.gather(0, t).view(-1, 1, 1, 1), ac.gather(0, prev_t).view(-1, 1, 1, 1)
    x0 = (x - (1 - a_t) ** 0.5 * out) / a_t**0.5
    std = eta * ((1 - a_p) / (1 - a_t) * (1 - a_t / a_p)) ** 0.5
    mean = a_p**0.5 * x0 + (1 - a_p - std**2) ** 0.5 * out
    if prev is None:
        prev = mean + std * torch.randn(out.shape, generator=gen)
    lp = -((prev - mean) ** 2) / (2 * std**2) - torch.log(std) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    return prev, lp.mean(dim=(1, 2, 3))


def ref_flow_grpo_step(out, idx, x, sigmas, noise_level, prev=None, gen=None):
    """Flow-GRPO's SDE step with log-prob; returns (prev, log_prob, mean, std_dev_t [B,1,1,1])."""
    s, sp = sigmas[idx].view(-1, 1, 1, 1), sigmas[idx + 1].view(-1, 1, 1, 1)
    dt = sp - s
    std = torch.sqrt(s / (1 - torch.where(s == 1, sigmas[1].item(), s))) * noise_level
    mean = x * (1 + std**2 / (2 * s) * dt) + out * (1 + std**2 * (1 - s) / (2 * s)) * dt
    if prev is None:
        prev = mean + std * torch.sqrt(-1 * dt) * torch.randn(out.shape, generator=gen)
    lp = (-((prev - mean) ** 2) / (2 * (std * torch.sqrt(-1 * dt)) ** 2) - torch.log(std * torch.sqrt(-1 * dt))
          - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev, lp.mean(dim=(1, 2, 3)), mean, std


def ref_flow_grpo_advantages(prompts, rewards):
    """Flow-GRPO's per-prompt stat tracker (numpy std, + 1e-4), one batch."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    adv = np.zeros_like(rewards)
    for p in np.unique(prompts):
        r = rewards[prompts == p]
        adv[prompts == p] = (r - r.mean()) / (r.std() + 1e-4)
    return adv


def ref_flow_grpo_loss(lp, old_lp, adv, clip_range, adv_clip_max, beta, mean, ref_mean, std):
    adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(lp - old_lp)
    policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)))
    kl = torch.mean(((mean - ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std**2))
    return policy + beta * kl


def ref_diffusers_dpo(model_pred, ref_pred, target, beta_dpo):
    model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
    mw, ml = model_losses.chunk(2)
    ref_loss = F.mse_loss(ref_pred.float(), target.float(), reduction="none")
    rw, rl = ref_loss.mean(dim=list(range(1, len(ref_loss.shape)))).chunk(2)
    inside = -0.5 * beta_dpo * ((mw - ml) - (rw - rl))
    return -1 * F.logsigmoid(inside).mean(), (inside > 0).sum().float() / inside.size(0)


# --- DDIM step ----------------------------------------------------------------------------------
def _ddim(alphas_cumprod, eta, **options):
    """A sampler for ddim_step_with_logprob (its step count does not enter a single step)."""
    return DDIMSampler(torch.zeros(1, dtype=torch.long), alphas_cumprod, eta=eta, **options)


def test_ddim_step_hand_values():
    ac = torch.tensor([0.9, 0.5])
    x, out = torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 0.5)
    # timestep 1 -> prev -1: a_prev is alphas_cumprod[0] = 0.9 (DDPO's clamp)
    var = (0.1 / 0.5) * (1 - 0.5 / 0.9)
    std = math.sqrt(var)
    x0 = (1 - math.sqrt(0.5) * 0.5) / math.sqrt(0.5)
    mean = math.sqrt(0.9) * x0 + math.sqrt(1 - 0.9 - var) * 0.5
    step = ddim_step_with_logprob(out, x, 1, -1, _ddim(ac, 1.0), prev_sample=torch.full((1, 1, 1, 1), mean + 2 * std))
    assert step.prev_sample_mean.item() == pytest.approx(mean, abs=1e-6)
    assert step.std_dev_t.item() == pytest.approx(std, abs=1e-6)
    # two standard deviations away: -z^2/2 - log std - log sqrt(2 pi)
    assert step.log_prob.item() == pytest.approx(-2.0 - math.log(std) - LOG_SQRT_2PI, abs=1e-5)
    half = ddim_step_with_logprob(out, x, 1, -1, _ddim(ac, 0.5), noise=torch.zeros(1, 1, 1, 1))
    assert half.std_dev_t.item() == pytest.approx(0.5 * std, abs=1e-6)
    assert half.log_prob.item() == pytest.approx(-math.log(0.5 * std) - LOG_SQRT_2PI, abs=1e-5)
    assert torch.equal(half.prev_sample, half.prev_sample_mean)
    det = ddim_step_with_logprob(out, x, 1, -1, _ddim(ac, 0.0))
    assert det.log_prob is None and det.prev_sample_mean.item() == pytest.approx(
        math.sqrt(0.9) * x0 + math.sqrt(0.1) * 0.5, abs=1e-6)


def test_ddim_step_equals_ddpo_on_the_same_draws():
    ac = sd_alphas_cumprod()
    g = torch.Generator().manual_seed(0)
    x, out = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    t = torch.tensor([981, 501, 21, 1])  # the last one steps past 0 (prev index clamped)
    ours = ddim_step_with_logprob(out, x, t, t - 20, _ddim(ac, 1.0), generator=torch.Generator().manual_seed(7))
    prev, lp = ref_ddpo_step(out, t, x, ac, 1000, 50, 1.0, gen=torch.Generator().manual_seed(7))
    torch.testing.assert_close(ours.prev_sample, prev, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.log_prob, lp, rtol=1e-6, atol=1e-6)
    other = torch.randn(4, 4, 8, 8, generator=g)  # scoring a given prev sample
    torch.testing.assert_close(ddim_step_with_logprob(out, x, t, t - 20, _ddim(ac, 1.0), prev_sample=other).log_prob,
                               ref_ddpo_step(out, t, x, ac, 1000, 50, 1.0, prev=other)[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("set_alpha_to_one", [False, True])
def test_ddim_step_is_diffusers_ddim(prediction_type, set_alpha_to_one):
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                          set_alpha_to_one=set_alpha_to_one, steps_offset=1, prediction_type=prediction_type)
    sched.set_timesteps(10)
    assert torch.equal(ddim_timesteps(10, 1000, steps_offset=1), sched.timesteps)
    final = 1.0 if set_alpha_to_one else None  # None: alphas_cumprod[0], SD's set_alpha_to_one=False
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    for eta in (0.0, 1.0):
        for t in sched.timesteps:
            out, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
            theirs = sched.step(out, int(t), x, eta=eta, variance_noise=noise if eta else None).prev_sample
            ddim = _ddim(sched.alphas_cumprod, eta, final_alpha_cumprod=final, prediction_type=prediction_type)
            ours = ddim_step_with_logprob(out, x, t, t - 100, ddim, noise=noise if eta else None)
            if eta and set_alpha_to_one and t == sched.timesteps[-1]:
                continue  # zero variance at the last step: diffusers draws 0 * noise, there is no density
            torch.testing.assert_close(ours.prev_sample, theirs, rtol=1e-5, atol=1e-5)
            assert (ours.log_prob is None) == (eta == 0)
            x = theirs


def test_step_arguments_are_checked():
    ac = sd_alphas_cumprod()
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="prediction_type"):
        _ddim(ac, 1.0, prediction_type="flow")
    with pytest.raises(ValueError, match="not both"):
        ddim_step_with_logprob(x, x, 10, 0, _ddim(ac, 1.0), prev_sample=x, generator=torch.Generator())
    with pytest.raises(ValueError, match="no density"):
        ddim_step_with_logprob(x, x, 10, 0, _ddim(ac, 0.0), prev_sample=x)
    with pytest.raises(ValueError, match="step_index"):
        sde_step_with_logprob(x, x, torch.tensor([1.0, 0.5, 0.0]), 2, 0.7)
    with pytest.raises(ValueError, match="shape"):
        sde_step_with_logprob(x, torch.zeros(2, 5), torch.tensor([1.0, 0.0]), 0, 0.7)


# --- flow SDE step ------------------------------------------------------------------------------
def test_sde_step_hand_values():
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    x, v = torch.full((1, 1), 2.0), torch.full((1, 1), -1.0)
    # step 1: sigma 0.5 -> 0, dt = -0.5, std_dev_t = 0.5 * sqrt(0.5 / 0.5) = 0.5
    s1 = sde_step_with_logprob(v, x, sigmas, 1, 0.5, noise=torch.zeros(1, 1))
    assert s1.prev_sample_mean.item() == pytest.approx(0.875 * 2.0 - 0.5625 * -1.0, abs=1e-6)
    assert s1.std_dev_t.item() == pytest.approx(0.5, abs=1e-7)
    assert s1.noise_std.item() == pytest.approx(0.5 * math.sqrt(0.5), abs=1e-7)
    assert s1.log_prob.item() == pytest.approx(-math.log(0.5 * math.sqrt(0.5)) - LOG_SQRT_2PI, abs=1e-6)
    # step 0 at sigma = 1: the denominator uses sigmas[1], std_dev_t = 0.5 * sqrt(1 / 0.5)
    s0 = sde_step_with_logprob(v, x, sigmas, 0, 0.5, noise=torch.ones(1, 1))
    std0 = 0.5 * math.sqrt(2.0)
    assert s0.std_dev_t.item() == pytest.approx(std0, abs=1e-6)
    mean0 = 2.0 * (1 + std0**2 / 2 * -0.5) + -1.0 * -0.5
    assert s0.prev_sample_mean.item() == pytest.approx(mean0, abs=1e-6)
    assert s0.prev_sample.item() == pytest.approx(mean0 + std0 * math.sqrt(0.5), abs=1e-6)
    assert s0.log_prob.item() == pytest.approx(-0.5 - math.log(std0 * math.sqrt(0.5)) - LOG_SQRT_2PI, abs=1e-6)
    ode = sde_step_with_logprob(v, x, sigmas, 1, 0.0)
    assert ode.log_prob is None and ode.prev_sample.item() == pytest.approx(2.0 + 0.5, abs=1e-7)  # x + v dt


def test_sde_step_equals_flow_grpo_on_the_same_draws():
    sigmas = flow_inference_sigmas(10, shift=3.0)
    g = torch.Generator().manual_seed(2)
    x, v = torch.randn(4, 16, 4, 4, generator=g), torch.randn(4, 16, 4, 4, generator=g)
    idx = torch.tensor([0, 3, 8, 9])  # the first (sigma = 1) and the last (sigma_prev = 0) steps included
    ours = sde_step_with_logprob(v, x, sigmas, idx, 0.7, generator=torch.Generator().manual_seed(5))
    prev, lp, mean, std = ref_flow_grpo_step(v, idx, x, sigmas, 0.7, gen=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours.prev_sample, prev, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.prev_sample_mean, mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.log_prob, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.std_dev_t, std.view(-1), rtol=1e-6, atol=1e-7)
    other = torch.randn(4, 16, 4, 4, generator=g)
    torch.testing.assert_close(sde_step_with_logprob(v, x, sigmas, idx, 0.7, prev_sample=other).log_prob,
                               ref_flow_grpo_step(v, idx, x, sigmas, 0.7, prev=other)[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"shift": 3.0}, {"mu": 0.8}])
def test_flow_sigmas_and_ode_limit_are_diffusers_flow_match_euler(kwargs):
    from diffusers import FlowMatchEulerDiscreteScheduler

    dynamic = "mu" in kwargs
    sched = FlowMatchEulerDiscreteScheduler(shift=kwargs.get("shift", 1.0), use_dynamic_shifting=dynamic)
    if dynamic:  # as FluxPipeline (and Flow-GRPO's FLUX sampler) calls it
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=kwargs["mu"])
    else:  # as StableDiffusion3Pipeline calls it
        sched.set_timesteps(8)
    sigmas = flow_inference_sigmas(8, **kwargs)
    torch.testing.assert_close(sigmas, sched.sigmas, rtol=0, atol=0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 4, 4, generator=g)
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, 16, 4, 4, generator=g)
        theirs = sched.step(v, t, x).prev_sample
        ours = sde_step_with_logprob(v, x, sigmas, i, 0.0).prev_sample
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        x = theirs


# --- advantages, policy loss, KL ------------------------------------------------------------------
def test_group_advantages_hand_values_and_flat_groups():
    r = torch.tensor([1.0, 2.0, 3.0, 0.3, 0.3, 0.3])
    s = math.sqrt(2 / 3)  # population std of 1, 2, 3
    adv = group_advantages(r, 3)
    torch.testing.assert_close(adv[:3], torch.tensor([-1 / (s + 1e-4), 0.0, 1 / (s + 1e-4)]))
    assert torch.equal(adv[3:], torch.zeros(3))  # exactly 0, though the float mean of 0.3s is not exactly 0.3
    assert torch.equal(group_advantages(r, 3, eps=0.0)[3:], torch.zeros(3))  # no NaN without eps
    torch.testing.assert_close(group_advantages(r, 3, std="none"), torch.tensor([-1.0, 0, 1, 0, 0, 0]))
    g = r.std(unbiased=False)
    torch.testing.assert_close(group_advantages(r, 3, std="global")[:3], torch.tensor([-1.0, 0.0, 1.0]) / (g + 1e-4))
    assert group_advantages(r, 3, clip=1.0).abs().max() == 1.0
    assert torch.equal(group_advantages(torch.tensor([4.0, 5.0]), 1), torch.zeros(2))
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 4)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_group_advantages_equal_the_references():
    from multiengine.pipelines.rlhf.advantages import grpo_advantages

    r = torch.rand(24, generator=torch.Generator().manual_seed(4))
    prompts = [f"p{i // 4}" for i in range(24)]
    ref = torch.from_numpy(ref_flow_grpo_advantages(prompts, r.tolist())).float()
    torch.testing.assert_close(group_advantages(r, 4), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(group_advantages(r, 4, unbiased=True, eps=1e-6), grpo_advantages(r, 4),
                               rtol=1e-6, atol=1e-6)


def test_clipped_policy_loss_hand_values():
    old = torch.zeros(2)
    lp = torch.full((2,), math.log(1.5), requires_grad=True)
    loss, stats = clipped_policy_loss(lp, old, torch.tensor([1.0, -1.0]), clip_range=0.2)
    # A = 1: max(-1.5, -1.2) = -1.2 (clipped, no gradient); A = -1: max(1.5, 1.2) = 1.5 (unclipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.5 * 1.5]))
    assert stats["clipfrac"].item() == 1.0
    assert stats["approx_kl"].item() == pytest.approx(0.5 * math.log(1.5) ** 2, abs=1e-6)
    # ratio 1 (re-scored with the sampling policy): the loss is -mean(A)
    same, s = clipped_policy_loss(old, old, torch.tensor([2.0, 1.0]), 1e-4)
    assert same.item() == pytest.approx(-1.5) and s["clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="clip_range"):
        clipped_policy_loss(old, old, old, 0.0)


def test_grpo_loss_with_kl_equals_flow_grpo():
    g = torch.Generator().manual_seed(6)
    b = 6
    lp, old = torch.randn(b, generator=g) * 0.01, torch.randn(b, generator=g) * 0.01
    adv = torch.randn(b, generator=g) * 3
    mean, ref_mean = torch.randn(b, 16, 4, 4, generator=g), torch.randn(b, 16, 4, 4, generator=g)
    std = torch.rand(b, generator=g) + 0.1
    ours, stats = diffusion_grpo_loss(lp, old, adv, 0.005, adv_clip_max=5.0, kl_coef=0.04, prev_sample_mean=mean,
                                      ref_prev_sample_mean=ref_mean, std=std)
    ref = ref_flow_grpo_loss(lp, old, adv, 0.005, 5.0, 0.04, mean, ref_mean, std.view(-1, 1, 1, 1))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert stats["kl"] > 0 and "policy_loss" in stats
    # hand: mean differs by 0.1 everywhere, std 0.5 -> 0.01 / (2 * 0.25)
    kl = kl_to_reference(torch.full((2, 3), 0.1), torch.zeros(2, 3), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(kl, torch.tensor([0.02, 0.02]))
    with pytest.raises(ValueError, match="roles.ref"):
        diffusion_grpo_loss(lp, old, adv, 0.005, kl_coef=0.1)
    no_kl, _ = diffusion_grpo_loss(lp, old, adv, 0.005, adv_clip_max=5.0)
    torch.testing.assert_close(no_kl, clipped_policy_loss(lp, old, adv, 0.005, 5.0)[0])


def test_train_step_indices():
    idx = train_step_indices(3, 10, 0.5, generator=torch.Generator().manual_seed(0))
    assert idx.shape == (3, 5)
    assert all(len(set(row.tolist())) == 5 and row.max() < 10 for row in idx)
    assert not torch.equal(idx[0], idx[1])  # each row its own subset
    assert torch.equal(train_step_indices(2, 10, 0.3, shuffle=False), torch.tensor([[0, 1, 2], [0, 1, 2]]))


# --- Diffusion-DPO --------------------------------------------------------------------------------
def test_dpo_loss_hand_values():
    loss, stats = diffusion_dpo_loss_from_losses(torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([1.5]),
                                                 torch.tensor([1.5]), beta=2.0)
    # inside = -beta/2 * ((1 - 2) - 0) = 1
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)
    assert stats.implicit_acc.item() == 1.0 and stats.margin.item() == pytest.approx(1.0)
    assert stats.model_mse.item() == pytest.approx(1.5) and stats.ref_mse.item() == pytest.approx(1.5)
    # the policy equal to the reference: log 2, accuracy 0
    same, s = diffusion_dpo_loss_from_losses(*(torch.ones(3),) * 4, beta=5000.0)
    assert same.item() == pytest.approx(math.log(2.0)) and s.implicit_acc.item() == 0.0
    with pytest.raises(ValueError, match="dpo.beta"):
        diffusion_dpo_loss_from_losses(*(torch.ones(3),) * 4, beta=0.0)


@pytest.mark.parametrize("target_kind", ["epsilon", "v_prediction", "flow"])
def test_dpo_loss_equals_diffusers_research_script(target_kind):
    g = torch.Generator().manual_seed(8)
    x0 = torch.randn(6, 4, 8, 8, generator=g)  # 3 chosen, then 3 rejected
    noise = paired(torch.randn(6, 4, 8, 8, generator=g))
    assert torch.equal(noise[:3], noise[3:])
    if target_kind == "flow":
        target = flow_target(x0, noise)
    else:
        t = paired(torch.randint(0, 1000, (6,), generator=g))
        target = training_target(target_kind, x0, noise, t, sd_alphas_cumprod())
    model_pred = (target + 0.3 * torch.randn(6, 4, 8, 8, generator=g)).requires_grad_(True)
    ref_pred = (target + 0.3 * torch.randn(6, 4, 8, 8, generator=g)).requires_grad_(True)
    loss, stats = diffusion_dpo_loss(model_pred, ref_pred, target, beta=2500.0)
    ref_loss, ref_acc = ref_diffusers_dpo(model_pred, ref_pred.detach(), target, 2500.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert stats.implicit_acc.item() == ref_acc.item()
    loss.backward()
    assert model_pred.grad.abs().sum() > 0 and ref_pred.grad is None  # the reference is a constant
    with pytest.raises(ValueError, match="chosen then rejected"):
        diffusion_dpo_loss(model_pred[:5], ref_pred[:5], target[:5], 1.0)


# --- the sampling loop on tiny denoisers --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), layers_per_block=1,
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8).eval()
    hidden = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    return unet, lambda x, t: unet(x, t, encoder_hidden_states=hidden).sample


@pytest.fixture(scope="module")
def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                               attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
                               caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=16).eval()
    g = torch.Generator().manual_seed(1)
    hidden, pooled = torch.randn(2, 6, 64, generator=g), torch.randn(2, 64, generator=g)
    return tr, lambda x, t: tr(hidden_states=x, timestep=t, encoder_hidden_states=hidden,
                               pooled_projections=pooled).sample


def _samplers():
    return {"ddim": (DDIMSampler(ddim_timesteps(4, 1000, 1), sd_alphas_cumprod(), eta=1.0), (2, 4, 8, 8)),
            "flow": (FlowSDESampler(flow_inference_sigmas(4, shift=3.0), noise_level=0.7), (2, 16, 8, 8))}


@pytest.mark.parametrize("kind", ["ddim", "flow"])
def test_sampling_is_reproducible_and_rescoring_gives_ratio_one(kind, tiny_unet, tiny_sd3):
    sampler, shape = _samplers()[kind]
    model, fn = tiny_unet if kind == "ddim" else tiny_sd3
    x_T = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    traj = sample_with_logprobs(fn, x_T, sampler, torch.Generator().manual_seed(11))
    n = sampler.num_steps
    assert traj.latents.shape == (2, n + 1, *shape[1:]) and traj.log_probs.shape == (2, n)
    assert traj.timesteps.shape == (2, n) and torch.equal(traj.latents[:, 0], x_T)
    assert torch.isfinite(traj.log_probs).all()
    again = sample_with_logprobs(fn, x_T, sampler, torch.Generator().manual_seed(11))
    assert torch.equal(again.latents, traj.latents) and torch.equal(again.log_probs, traj.log_probs)
    other = sample_with_logprobs(fn, x_T, sampler, torch.Generator().manual_seed(12))
    assert not torch.allclose(other.final, traj.final)
    for j in range(n):  # same denoiser: the stored log-probs exactly, ratio 1
        step = rescore(fn, sampler, traj, j)
        assert torch.equal(step.log_prob, traj.log_probs[:, j])
        assert torch.equal(torch.exp(step.log_prob - traj.log_probs[:, j]), torch.ones(2))
    per_row = torch.tensor([n - 1, 0])  # each row its own step (DDPO's shuffled steps)
    step = rescore(fn, sampler, traj, per_row)
    assert torch.equal(step.log_prob, traj.log_probs[torch.arange(2), per_row])
    # an updated denoiser scores the same transitions differently, and its gradient reaches the weights
    bumped = lambda x, t: fn(x, t) + 0.05  # noqa: E731
    assert not torch.allclose(rescore(bumped, sampler, traj, 1).log_prob, traj.log_probs[:, 1])
    model.zero_grad()
    rescore(fn, sampler, traj, 1).log_prob.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()


def test_deterministic_sampler_has_no_logprobs(tiny_unet):
    _, fn = tiny_unet
    sampler = DDIMSampler(ddim_timesteps(3, 1000, 1), sd_alphas_cumprod(), eta=0.0)
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    a = sample_with_logprobs(fn, x_T, sampler)
    assert a.log_probs is None and torch.equal(a.final, sample_with_logprobs(fn, x_T, sampler).final)

"""Flow-matching math: diffusers' own functions on random inputs, and hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.pipelines.diffusion.flow import (
    SCHEMES,
    dynamic_shift_mu,
    flow_loss_weighting,
    flow_match_schedule,
    flow_noisy_input,
    flow_target,
    flux_guidance,
    flux_image_ids,
    flux_text_ids,
    pack_latents,
    precondition_outputs,
    sample_flow_timesteps,
    schedule_lookup,
    sd3_prompt_embeds,
    timestep_density,
    unpack_latents,
)
from multiengine.pipelines.diffusion.math import diffusion_loss


# --- densities and weights -------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("params", [(0.0, 1.0, 1.29), (0.5, 0.7, 0.5)])
def test_density_draws_what_diffusers_draws(scheme, params):
    from diffusers.training_utils import compute_density_for_timestep_sampling

    mean, std, scale = params
    ours = timestep_density(scheme, 512, mean, std, scale, generator=torch.Generator().manual_seed(3))
    theirs = compute_density_for_timestep_sampling(scheme, 512, logit_mean=mean, logit_std=std, mode_scale=scale,
                                                   generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert ours.min() >= 0 and ours.max() <= 1


def test_density_shapes_the_draws():
    g = torch.Generator().manual_seed(0)
    uniform = timestep_density("uniform", 20000, generator=g)
    logit = timestep_density("logit_normal", 20000, generator=g)
    mode = timestep_density("mode", 20000, mode_scale=1.29, generator=g)
    middle = lambda u: ((u > 0.25) & (u < 0.75)).float().mean().item()  # noqa: E731
    assert abs(middle(uniform) - 0.5) < 0.02
    assert middle(logit) > 0.6 and middle(mode) > 0.55  # both favour the middle of the schedule
    # sigmoid(N(0, 1)) is symmetric around 1/2; the median of a logit-normal is sigmoid(mean).
    assert abs(logit.median().item() - 0.5) < 0.01
    shifted = timestep_density("logit_normal", 20000, logit_mean=1.0, generator=g)
    assert abs(shifted.median().item() - 1 / (1 + math.exp(-1.0))) < 0.01


def test_density_hand_values():
    # mode at u: 1 - u - s (cos^2(pi u / 2) - 1 + u); at u = 1/2 the bracket is 0 -> 1/2 for any s.
    g = torch.Generator().manual_seed(5)
    u = torch.rand(8, generator=torch.Generator().manual_seed(5))
    expected = 1 - u - 2.0 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    torch.testing.assert_close(timestep_density("mode", 8, mode_scale=2.0, generator=g), expected)
    assert timestep_density("mode", 1, mode_scale=0.0, generator=torch.Generator().manual_seed(5)).item() == (
        pytest.approx(1 - u[0].item()))
    with pytest.raises(ValueError, match="weighting_scheme='logit'.*logit_normal"):
        timestep_density("logit", 4)
    with pytest.raises(ValueError, match="logit_std"):
        timestep_density("logit_normal", 4, logit_std=0.0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_loss_weighting_matches_diffusers(scheme):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    sigmas = torch.rand(64, generator=torch.Generator().manual_seed(1)).clamp_min(1e-3)
    for shaped in (sigmas, sigmas.reshape(-1, 1, 1, 1)):
        torch.testing.assert_close(flow_loss_weighting(scheme, shaped),
                                   compute_loss_weighting_for_sd3(scheme, shaped).float())


def test_loss_weighting_hand_values():
    s = torch.tensor([0.5, 0.25, 1.0])
    torch.testing.assert_close(flow_loss_weighting("sigma_sqrt", s), torch.tensor([4.0, 16.0, 1.0]))
    # cosmap: 2 / (pi (1 - 2s + 2s^2)): s=1/2 -> 4/pi ; s=1/4 -> 2/(pi * 5/8) = 16/(5 pi) ; s=1 -> 2/pi
    torch.testing.assert_close(flow_loss_weighting("cosmap", s),
                               torch.tensor([4 / math.pi, 16 / (5 * math.pi), 2 / math.pi]))
    for scheme in ("logit_normal", "mode", "none", "uniform"):
        assert torch.equal(flow_loss_weighting(scheme, s), torch.ones(3))


# --- the schedule ----------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [{}, {"shift": 3.0}, {"shift": 3.0, "use_dynamic_shifting": True},
                                    {"num_train_timesteps": 100, "shift": 1.7}])
def test_schedule_equals_scheduler_table(config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(**config)
    timesteps, sigmas = flow_match_schedule(config.get("num_train_timesteps", 1000), config.get("shift", 1.0),
                                            config.get("use_dynamic_shifting", False))
    torch.testing.assert_close(timesteps, sched.timesteps, rtol=0, atol=0)
    torch.testing.assert_close(sigmas, sched.sigmas, rtol=0, atol=0)


def test_schedule_hand_values():
    t, s = flow_match_schedule(4)
    torch.testing.assert_close(s, torch.tensor([1.0, 0.75, 0.5, 0.25]))
    torch.testing.assert_close(t, torch.tensor([4.0, 3.0, 2.0, 1.0]))
    _, shifted = flow_match_schedule(4, shift=3.0)
    # 3s / (1 + 2s): 1 -> 1, 3/4 -> 9/10, 1/2 -> 3/4, 1/4 -> 1/2
    torch.testing.assert_close(shifted, torch.tensor([1.0, 0.9, 0.75, 0.5]))
    with pytest.raises(ValueError, match="shift"):
        flow_match_schedule(10, shift=0.0)


def test_sampled_timesteps_as_the_scripts_index_them():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    timesteps, sigmas = flow_match_schedule(1000, 3.0)
    u = torch.rand(256, generator=torch.Generator().manual_seed(0))
    idx, t, s = sample_flow_timesteps(u, timesteps, sigmas)
    # diffusers' train_dreambooth_sd3.py: indices = (u * N).long(); timesteps = table[indices]; get_sigmas(t)
    script_t = sched.timesteps[(u * 1000).long()]
    script_s = sched.sigmas[[(sched.timesteps == x).nonzero().item() for x in script_t]]
    assert torch.equal(t, script_t) and torch.equal(s, script_s) and torch.equal(idx, (u * 1000).long())
    torch.testing.assert_close(schedule_lookup(t, timesteps, sigmas), script_s, rtol=0, atol=0)
    # u = 1 (the mode density at u = 0) stays on the table's last entry instead of indexing past it
    idx, t, s = sample_flow_timesteps(torch.tensor([0.0, 1.0]), timesteps, sigmas)
    assert idx.tolist() == [0, 999] and s[0] == 1.0 and s[1] == sigmas[-1]
    with pytest.raises(ValueError, match="not entries"):
        schedule_lookup(torch.tensor([0.5]), timesteps, sigmas)


def test_dynamic_shift_mu_matches_flux():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for n in (64, 256, 1024, 4096):
        assert dynamic_shift_mu(n) == pytest.approx(calculate_shift(n))
        assert dynamic_shift_mu(n, 128, 2048, 0.2, 1.0) == pytest.approx(calculate_shift(n, 128, 2048, 0.2, 1.0))
    assert dynamic_shift_mu(256) == pytest.approx(0.5) and dynamic_shift_mu(4096) == pytest.approx(1.15)


# --- noise, target, loss ------------------------------------------------------------------------------
def test_noisy_input_and_target_hand_values():
    x0, noise = torch.full((3, 2, 2, 2), 2.0), torch.ones(3, 2, 2, 2)
    s = torch.tensor([0.0, 0.25, 1.0])
    noisy = flow_noisy_input(x0, noise, s)
    # (1 - s) * 2 + s * 1 = 2 - s
    torch.testing.assert_close(noisy[:, 0, 0, 0], torch.tensor([2.0, 1.75, 1.0]))
    assert torch.equal(flow_target(x0, noise), -torch.ones_like(x0))
    # Moving along the target from the noisy point reaches the data at sigma = 0 and the noise at 1.
    torch.testing.assert_close(noisy - s.reshape(-1, 1, 1, 1) * flow_target(x0, noise), x0)
    with pytest.raises(ValueError, match="sigmas must have shape"):
        flow_noisy_input(x0, noise, torch.ones(2))


def test_noisy_input_matches_scheduler_scale_noise():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    g = torch.Generator().manual_seed(2)
    x0, noise = torch.randn(4, 16, 8, 8, generator=g), torch.randn(4, 16, 8, 8, generator=g)
    timesteps, sigmas = flow_match_schedule(1000, 3.0)
    idx = torch.tensor([0, 10, 500, 999])
    for i in idx.tolist():  # scale_noise takes one timestep for the whole batch
        ours = flow_noisy_input(x0, noise, sigmas[[i] * 4])
        theirs = sched.scale_noise(x0, timesteps[i : i + 1], noise)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_preconditioning_turns_velocity_into_x0():
    g = torch.Generator().manual_seed(4)
    x0, noise = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    s = torch.tensor([0.2, 0.5, 0.9])
    noisy = flow_noisy_input(x0, noise, s)
    torch.testing.assert_close(precondition_outputs(flow_target(x0, noise), noisy, s), x0, rtol=1e-5, atol=1e-6)
    # the preconditioned loss is the velocity loss weighted by sigma^2
    pred = torch.randn(3, 4, 4, 4, generator=g)
    pre = diffusion_loss(precondition_outputs(pred, noisy, s), x0)
    plain = diffusion_loss(pred, flow_target(x0, noise), s**2)
    assert pre.item() == pytest.approx(plain.item(), rel=1e-5)


def test_loss_is_the_scripts_formula():
    g = torch.Generator().manual_seed(6)
    pred, target = torch.randn(5, 16, 4, 4, generator=g), torch.randn(5, 16, 4, 4, generator=g)
    sigmas = torch.rand(5, generator=g)
    w = flow_loss_weighting("sigma_sqrt", sigmas)
    # train_dreambooth_sd3.py: mean((w * (pred - target)^2).reshape(B, -1), 1).mean(), w shaped [B, 1, 1, 1]
    script = torch.mean((w.reshape(-1, 1, 1, 1) * (pred - target) ** 2).reshape(5, -1), 1).mean()
    assert diffusion_loss(pred, target, w).item() == pytest.approx(script.item(), rel=1e-6)


# --- FLUX tokens ------------------------------------------------------------------------------------
def test_pack_unpack_match_flux_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 6, 10, generator=torch.Generator().manual_seed(0))
    packed = pack_latents(x)
    assert packed.shape == (2, 15, 64)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 6, 10))
    assert torch.equal(unpack_latents(packed, 6, 10), x)
    # the pipeline unpacks from pixel sizes: latent size x vae factor (8)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 48, 80, 8), x)
    # token k of row-major patch (r, c) holds x[:, :, 2r:2r+2, 2c:2c+2], channel-major
    assert torch.equal(packed[1, 1 * 5 + 3], x[1, :, 2:4, 6:8].reshape(-1))
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.zeros(1, 4, 3, 4))
    with pytest.raises(ValueError, match="does not fit"):
        unpack_latents(packed, 6, 8)


def test_image_and_text_ids_match_flux_pipeline():
    from diffusers import FluxPipeline

    ids = flux_image_ids(6, 10)
    assert torch.equal(ids, FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32))
    assert ids.shape == (15, 3) and ids[7].tolist() == [0.0, 1.0, 2.0]  # token 7 = row 1, column 2
    assert torch.equal(flux_text_ids(12), torch.zeros(12, 3))
    g = flux_guidance(3.5, 4)
    assert g.dtype == torch.float32 and g.tolist() == [3.5] * 4


# --- SD3 conditioning -------------------------------------------------------------------------------
def test_sd3_prompt_embeds_as_the_pipeline_builds_them():
    g = torch.Generator().manual_seed(7)
    l_hidden, g_hidden = torch.randn(2, 77, 8, generator=g), torch.randn(2, 77, 12, generator=g)
    l_pool, g_pool = torch.randn(2, 8, generator=g), torch.randn(2, 12, generator=g)
    t5 = torch.randn(2, 10, 32, generator=g)
    embeds, pooled = sd3_prompt_embeds([l_hidden, g_hidden], [l_pool, g_pool], t5)
    assert embeds.shape == (2, 87, 32) and pooled.shape == (2, 20)
    assert torch.equal(embeds[:, :77, :8], l_hidden) and torch.equal(embeds[:, :77, 8:20], g_hidden)
    assert torch.equal(embeds[:, :77, 20:], torch.zeros(2, 77, 12)) and torch.equal(embeds[:, 77:], t5)
    assert torch.equal(pooled, torch.cat([l_pool, g_pool], -1))
    with pytest.raises(ValueError, match="joint_attention_dim"):
        sd3_prompt_embeds([l_hidden, g_hidden], [l_pool, g_pool], t5[..., :16])

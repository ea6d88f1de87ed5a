"""Diffusion math: hand-derived numbers and agreement with diffusers' schedulers."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.pipelines.diffusion.math import (
    add_noise,
    compute_snr,
    diffusion_loss,
    min_snr_weights,
    offset_noise,
    perturb_noise,
    training_target,
    velocity,
)

# sqrt(0.64)=0.8, sqrt(0.36)=0.6: every coefficient below is exact by hand. t=2 is pure noise, t=3 clean.
AC = torch.tensor([0.64, 0.36, 0.0, 1.0])
T = torch.tensor([0, 1, 2, 3])


def _per_sample(values: list[float], shape=(4, 2, 3, 3)) -> torch.Tensor:
    return torch.tensor(values).reshape(-1, 1, 1, 1).expand(shape)


def _const(v: float, shape=(4, 2, 3, 3)) -> torch.Tensor:
    return torch.full(shape, v)


def test_add_noise_hand_numbers():
    # x0=2, noise=1: 0.8*2+0.6*1=2.2 ; 0.6*2+0.8*1=2.0 ; 0*2+1*1=1 ; 1*2+0*1=2
    out = add_noise(_const(2.0), _const(1.0), T, AC)
    torch.testing.assert_close(out, _per_sample([2.2, 2.0, 1.0, 2.0]), atol=1e-6, rtol=0)


def test_velocity_hand_numbers():
    # v = sqrt(a)*noise - sqrt(1-a)*x0 with x0=2, noise=1: 0.8-1.2 ; 0.6-1.6 ; 0-2 ; 1-0
    out = velocity(_const(2.0), _const(1.0), T, AC)
    torch.testing.assert_close(out, _per_sample([-0.4, -1.0, -2.0, 1.0]), atol=1e-6, rtol=0)


def test_v_and_xt_reconstruct_x0_and_noise():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 3, 5, 5, generator=g), torch.randn(4, 3, 5, 5, generator=g)
    ac = torch.tensor([0.9, 0.5, 0.1, 0.3])
    xt, v = add_noise(x0, noise, T, ac), velocity(x0, noise, T, ac)
    a = ac[T].reshape(-1, 1, 1, 1)
    # x0 = sqrt(a) x_t - sqrt(1-a) v ; eps = sqrt(1-a) x_t + sqrt(a) v
    torch.testing.assert_close(a.sqrt() * xt - (1 - a).sqrt() * v, x0, atol=1e-5, rtol=0)
    torch.testing.assert_close((1 - a).sqrt() * xt + a.sqrt() * v, noise, atol=1e-5, rtol=0)


@pytest.mark.parametrize("beta_schedule", ["scaled_linear", "linear", "squaredcos_cap_v2"])
def test_matches_diffusers_ddpm(beta_schedule):
    from diffusers import DDPMScheduler

    sched = DDPMScheduler(
        num_train_timesteps=1000, beta_schedule=beta_schedule, beta_start=0.00085, beta_end=0.012
    )
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g)
    t = torch.tensor([0, 1, 250, 500, 998, 999])
    ac = sched.alphas_cumprod
    torch.testing.assert_close(
        add_noise(x0, noise, t, ac), sched.add_noise(x0, noise, t), atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        velocity(x0, noise, t, ac), sched.get_velocity(x0, noise, t), atol=1e-6, rtol=1e-5
    )

    from diffusers.training_utils import compute_snr as diffusers_snr

    torch.testing.assert_close(compute_snr(t, ac), diffusers_snr(sched, t), rtol=1e-5, atol=0)


def test_five_dim_and_low_precision():
    x0 = torch.full((4, 2, 3, 2, 2), 2.0)
    out = add_noise(x0, torch.ones_like(x0), T, AC)
    torch.testing.assert_close(out[:, 0, 0, 0, 0], torch.tensor([2.2, 2.0, 1.0, 2.0]), atol=1e-6, rtol=0)
    bf = add_noise(x0.bfloat16(), torch.ones_like(x0).bfloat16(), T, AC)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(
        bf.float()[:, 0, 0, 0, 0], torch.tensor([2.2, 2.0, 1.0, 2.0]), atol=2e-2, rtol=0
    )


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="timesteps"):
        add_noise(_const(1.0), _const(1.0), torch.tensor([0, 1]), AC)
    with pytest.raises(ValueError, match="noise shape"):
        velocity(_const(1.0), torch.ones(4, 2, 3, 4), T, AC)


def test_training_target():
    x0, noise = _const(2.0), _const(1.0)
    assert torch.equal(training_target("epsilon", x0, noise, T, AC), noise)
    assert torch.equal(training_target("sample", x0, noise, T, AC), x0)
    torch.testing.assert_close(
        training_target("v_prediction", x0, noise, T, AC),
        _per_sample([-0.4, -1.0, -2.0, 1.0]),
        atol=1e-6,
        rtol=0,
    )
    with pytest.raises(ValueError, match=r"'flow'.*'epsilon', 'v_prediction', 'sample'"):
        training_target("flow", x0, noise, T, AC)


def test_compute_snr_hand_numbers():
    snr = compute_snr(T, AC)
    assert snr.dtype == torch.float32
    torch.testing.assert_close(snr[:3], torch.tensor([16 / 9, 9 / 16, 0.0]), rtol=1e-6, atol=1e-7)
    assert math.isinf(snr[3].item())


def test_min_snr_weights_hand_numbers():
    snr = torch.tensor([16 / 9, 9 / 16, 0.0])
    # gamma=1: min(snr, 1) = [1, 9/16, 0]
    torch.testing.assert_close(min_snr_weights(snr, 1.0, "epsilon"), torch.tensor([9 / 16, 1.0, 1.0]))
    torch.testing.assert_close(min_snr_weights(snr, 1.0, "v_prediction"), torch.tensor([9 / 25, 9 / 25, 0.0]))
    torch.testing.assert_close(min_snr_weights(snr, 1.0, "sample"), torch.tensor([1.0, 9 / 16, 0.0]))
    # gamma larger than every snr -> epsilon weights are all 1 (plain MSE)
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "epsilon"), torch.ones(3))
    with pytest.raises(ValueError, match="'x0'"):
        min_snr_weights(snr, 5.0, "x0")
    with pytest.raises(ValueError, match="gamma"):
        min_snr_weights(snr, 0.0, "epsilon")


def test_min_snr_matches_diffusers_script_formula():
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr as diffusers_snr

    sched = DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012
    )
    t = torch.tensor([0, 10, 100, 400, 999])
    snr = diffusers_snr(sched, t)
    # Verbatim from diffusers' examples/text_to_image/train_text_to_image.py
    base = torch.stack([snr, 5.0 * torch.ones_like(t)], dim=1).min(dim=1)[0]
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "epsilon"), base / snr)
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "v_prediction"), base / (snr + 1))


def test_offset_noise():
    noise = torch.randn(3, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    out = offset_noise(noise, 0.1, generator=torch.Generator().manual_seed(7))
    shift = out - noise
    # constant over H, W; equal to 0.1 * randn(B, C, 1, 1) from the same generator state
    expected = 0.1 * torch.randn(3, 4, 1, 1, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(shift, expected.expand_as(shift), atol=1e-6, rtol=0)
    assert shift[:, :, 0, 0].unique().numel() == 12
    assert offset_noise(noise, 0.0) is noise


def test_perturb_noise():
    noise = torch.zeros(8, 4, 32, 32)
    out = perturb_noise(noise, 0.1, generator=torch.Generator().manual_seed(3))
    expected = 0.1 * torch.randn(8, 4, 32, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, expected)
    assert abs(out.std().item() - 0.1) < 0.005
    assert perturb_noise(noise, 0.0) is noise


def test_diffusion_loss():
    pred = torch.zeros(2, 3, 4, 4)
    target = torch.stack([torch.full((3, 4, 4), 1.0), torch.full((3, 4, 4), 2.0)])
    # per-sample MSE = [1, 4]
    assert diffusion_loss(pred, target).item() == pytest.approx(2.5)
    assert diffusion_loss(pred, target, torch.tensor([1.0, 0.5])).item() == pytest.approx(1.5)
    assert diffusion_loss(pred, target, torch.tensor([0.0, 1.0])).item() == pytest.approx(2.0)
    assert diffusion_loss(pred, target, torch.ones(2)).item() == pytest.approx(2.5)
    low = diffusion_loss(pred.bfloat16(), target.bfloat16())
    assert low.dtype == torch.float32 and low.item() == pytest.approx(2.5)
    with pytest.raises(ValueError, match="weights"):
        diffusion_loss(pred, target, torch.ones(3))
    with pytest.raises(ValueError, match="target shape"):
        diffusion_loss(pred, target[:1])


def test_loss_gradient_flows():
    pred = torch.zeros(2, 1, 2, 2, requires_grad=True)
    loss = diffusion_loss(pred, torch.ones(2, 1, 2, 2), torch.tensor([1.0, 3.0]))
    loss.backward()
    # d/dpred of mean_b(w_b * mean((p-1)^2)) = w_b * 2 (p-1) / (4 * 2)
    torch.testing.assert_close(pred.grad[:, 0, 0, 0], torch.tensor([-0.25, -0.75]))

"""The GAN recipe's math against hand-derived values."""

import math

import torch
from multiengine.pipelines.gan import (
    MLP,
    discriminator_loss,
    generator_loss,
    ring_modes,
    sample_quality,
    sample_ring,
)


def test_losses_by_hand():
    # softplus(x) = ln(1 + e^x); at logit 0 every term is ln 2
    zero = torch.zeros(3)
    assert math.isclose(discriminator_loss(zero, zero).item(), 2 * math.log(2), rel_tol=1e-6)
    assert math.isclose(generator_loss(zero).item(), math.log(2), rel_tol=1e-6)
    real, fake = torch.tensor([2.0, -1.0]), torch.tensor([0.5])
    want = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(1))) / 2 + math.log(1 + math.exp(0.5))
    assert math.isclose(discriminator_loss(real, fake).item(), want, rel_tol=1e-6)
    assert math.isclose(generator_loss(fake).item(), math.log(1 + math.exp(-0.5)), rel_tol=1e-6)
    # the generator's gradient at logit 0 is -1/2 per row, averaged: d/dx softplus(-x) = -sigmoid(-x)
    x = torch.zeros(2, requires_grad=True)
    generator_loss(x).backward()
    assert torch.allclose(x.grad, torch.tensor([-0.25, -0.25]))


def test_ring_and_its_samples():
    modes = ring_modes(4, 2.0)
    assert torch.allclose(modes, torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]]), atol=1e-6)
    a = sample_ring(1000, 4, 2.0, 0.1, torch.Generator().manual_seed(0))
    b = sample_ring(1000, 4, 2.0, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (1000, 2)
    assert abs(a.norm(dim=1).mean().item() - 2.0) < 0.02


def test_sample_quality_by_hand():
    modes = ring_modes(4, 2.0)
    # two points on mode 0, one on mode 1, one far away: 3 of 4 close; modes 0 and 1 hold >= 1/4 of the fair
    # share (4 / 4 = 1 point each -> at least 0.25), modes 2 and 3 none
    points = torch.tensor([[2.0, 0.0], [2.1, 0.0], [0.0, 2.0], [0.0, 0.0]])
    q = sample_quality(points, modes, std=0.1)
    assert q["high_quality"] == 0.75 and q["mode_coverage"] == 0.5
    assert math.isclose(q["mode_distance"], (0 + 0.1 + 0 + 2.0) / 4, rel_tol=1e-6)
    # the ring's own samples cover every mode
    assert sample_quality(sample_ring(800, 4, 2.0, 0.1, torch.Generator().manual_seed(1)), modes, 0.1)[
        "mode_coverage"] == 1.0


def test_mlp_shapes():
    assert MLP(8, 16, 2)(torch.zeros(5, 8)).shape == (5, 2)
    assert MLP(2, 16, 1, depth=3)(torch.zeros(5, 2)).shape == (5,)

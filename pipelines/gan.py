"""A GAN's pieces as pure functions: the non-saturating losses (``d_loss = softplus(-D(real)) + softplus(D(fake))``,
``g_loss = softplus(-D(G(z)))``), a ring of Gaussians to learn, tiny MLPs and sample-quality figures."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from multiengine.engines.settings import Range, Settings, setting


def discriminator_loss(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """BCE with label 1 for real rows and 0 for generated ones: mean softplus(-real) + mean softplus(fake)."""
    return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()


def generator_loss(fake_logits: torch.Tensor) -> torch.Tensor:
    """The non-saturating generator loss: BCE with label 1 on generated rows, mean softplus(-logits)."""
    return F.softplus(-fake_logits).mean()


def ring_modes(modes: int, radius: float) -> torch.Tensor:
    """[modes, 2] centres evenly spaced on a circle of ``radius``."""
    angles = torch.arange(modes, dtype=torch.float64) * (2 * math.pi / modes)
    return (radius * torch.stack([angles.cos(), angles.sin()], dim=1)).float()


def sample_ring(n: int, modes: int, radius: float, std: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` points of the ring mixture: a uniformly chosen centre plus isotropic noise of ``std``."""
    centres = ring_modes(modes, radius)
    which = torch.randint(modes, (n,), generator=generator)
    return centres[which] + std * torch.randn(n, 2, generator=generator)


class MLP(torch.nn.Module):
    """``depth`` hidden layers of ``width`` with LeakyReLU; the GAN's generator (noise -> point) and
    discriminator (point -> one logit)."""

    def __init__(self, inputs: int, width: int, outputs: int, depth: int = 2) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        size = inputs
        for _ in range(depth):
            layers += [torch.nn.Linear(size, width), torch.nn.LeakyReLU(0.2)]
            size = width
        layers.append(torch.nn.Linear(size, outputs))
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def sample_quality(samples: torch.Tensor, modes: torch.Tensor, std: float) -> dict[str, float]:
    """``mode_coverage`` (modes holding a quarter of their fair share within 3 std), ``high_quality`` (samples within
    3 std of a mode) and ``mode_distance`` (mean distance to the nearest mode) of ``samples`` [n, 2]."""
    dist = torch.cdist(samples.double(), modes.double())
    nearest, which = dist.min(dim=1)
    close = nearest <= 3 * std
    counts = torch.bincount(which[close], minlength=len(modes)).double()
    fair = len(samples) / len(modes)
    return {"mode_coverage": float((counts >= 0.25 * fair).double().mean()),
            "high_quality": float(close.double().mean()), "mode_distance": float(nearest.mean())}


@dataclass(frozen=True)
class GANSettings(Settings):
    """The two networks and the target distribution."""

    noise_dim: int = setting(8, "generator input size", Range(1))
    width: int = setting(64, "hidden width of both MLPs", Range(1))
    depth: int = setting(2, "hidden layers of both MLPs", Range(1))
    d_steps: int = setting(1, "discriminator steps per generator step", Range(1))
    modes: int = setting(8, "Gaussians on the target ring", Range(1))
    radius: float = setting(2.0, "radius of the ring", Range(0, min_exclusive=True))
    std: float = setting(0.2, "standard deviation of each Gaussian (\"near a mode\" = within 3 std)",
                         Range(0, min_exclusive=True))

    def shape(self, role: str) -> dict[str, int]:
        """The MLP of the generator (``gen``: noise -> a point) or the discriminator (``disc``: a point -> a logit)."""
        inputs, outputs = (self.noise_dim, 2) if role == "gen" else (2, 1)
        return {"inputs": inputs, "width": self.width, "outputs": outputs, "depth": self.depth}

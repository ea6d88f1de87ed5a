"""Pure tensor functions of rectified-flow training (SD3, FLUX): ``x_sigma = (1 - sigma) x0 + sigma noise``, the
velocity target ``noise - x0``, timesteps from the FlowMatchEuler table by a density, loss weightings, FLUX's
packing. Randomness only through an explicit generator."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Names as diffusers' SD3/FLUX training scripts use them for --weighting_scheme: the density schemes
# shape which timesteps are drawn, the weighting schemes draw uniformly and re-weight the loss instead.
DENSITY_SCHEMES: tuple[str, ...] = ("logit_normal", "mode", "uniform")
WEIGHTING_SCHEMES: tuple[str, ...] = ("sigma_sqrt", "cosmap", "none")
SCHEMES: tuple[str, ...] = ("logit_normal", "mode", "sigma_sqrt", "cosmap", "none", "uniform")

__all__ = ["DENSITY_SCHEMES", "SCHEMES", "WEIGHTING_SCHEMES", "check_scheme", "dynamic_shift_mu",
           "flow_loss_weighting", "flow_match_schedule", "flow_noisy_input", "flow_sigma_shift", "flow_target",
           "flux_guidance", "flux_image_ids", "flux_text_ids", "pack_latents", "precondition_outputs",
           "sample_flow_timesteps", "schedule_lookup", "sd3_prompt_embeds", "timestep_density", "unpack_latents"]


def check_scheme(weighting_scheme: str) -> str:
    """``weighting_scheme`` if diffusers' scripts know it, else a ValueError naming the valid ones."""
    if weighting_scheme not in SCHEMES:
        raise ValueError(f"weighting_scheme={weighting_scheme!r}; use one of {list(SCHEMES)} (diffusers' names).")
    return weighting_scheme


# --- the schedule -------------------------------------------------------------------------------
def flow_sigma_shift(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift ``shift * s / (1 + (shift - 1) * s)``: ``shift > 1`` moves mass towards noise."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_match_schedule(num_train_timesteps: int = 1000, shift: float = 1.0, use_dynamic_shifting: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps [N], sigmas [N])`` descending: ``FlowMatchEulerDiscreteScheduler``'s training table, sigmas
    from 1 to ``1 / N``, shifted unless the shift is dynamic (FLUX); ``timesteps = sigmas * N``."""
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps={num_train_timesteps} must be >= 1.")
    if not shift > 0:
        raise ValueError(f"shift={shift} must be > 0.")
    n = int(num_train_timesteps)
    # float32 linspace, as the scheduler builds it (numpy float32), so the table is bit-identical.
    import numpy as np

    t = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy())
    sigmas = t / n
    if not use_dynamic_shifting:
        sigmas = flow_sigma_shift(sigmas, shift)
    return sigmas * n, sigmas


def dynamic_shift_mu(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                     max_shift: float = 1.15) -> float:
    """FLUX's resolution-dependent shift exponent: linear in the image tokens, ``base_shift`` at ``base_seq_len`` to
    ``max_shift`` at ``max_seq_len`` (the sampler uses ``exp(mu)``)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


# --- which timesteps ------------------------------------------------------------------------------
def timestep_density(weighting_scheme: str, batch_size: int, logit_mean: float = 0.0, logit_std: float = 1.0,
                     mode_scale: float = 1.29, generator: torch.Generator | None = None) -> torch.Tensor:
    """``u [B]`` in ``[0, 1]`` (0 = noisiest): ``logit_normal``, ``mode`` or uniform, what diffusers'
    ``compute_density_for_timestep_sampling`` draws from the same CPU generator."""
    check_scheme(weighting_scheme)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1.")
    if weighting_scheme == "logit_normal":
        if not logit_std > 0:
            raise ValueError(f"logit_std={logit_std} must be > 0.")
        u = torch.normal(mean=float(logit_mean), std=float(logit_std), size=(batch_size,), generator=generator)
        return torch.sigmoid(u)
    u = torch.rand((batch_size,), generator=generator)
    if weighting_scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def sample_flow_timesteps(u: torch.Tensor, timesteps: torch.Tensor, sigmas: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indices [B] long, timesteps [B], sigmas [B])`` of the table entries ``floor(u * N)``, as diffusers' scripts
    compute them, clamped to ``N - 1`` (the ``mode`` density maps ``u = 0`` to 1, one past the table)."""
    n = timesteps.shape[0]
    indices = (u * n).long().clamp(0, n - 1)
    return indices, timesteps[indices], sigmas[indices]


def schedule_lookup(values: torch.Tensor, timesteps: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``sigmas`` at the entries whose timestep equals each of ``values [B]`` (diffusers' ``get_sigmas``); a
    timestep that is not in the table is a ValueError."""
    hits = values.reshape(-1, 1).to(timesteps.dtype) == timesteps.reshape(1, -1)
    if not bool(hits.any(dim=1).all()):
        missing = values.reshape(-1)[~hits.any(dim=1)].tolist()
        raise ValueError(f"timesteps {missing} are not entries of the scheduler's table.")
    return sigmas[hits.float().argmax(dim=1)]


# --- noise, target, weights ----------------------------------------------------------------------------
def _per_sample(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if sigmas.ndim != 1 or sigmas.shape[0] != like.shape[0]:
        raise ValueError(f"sigmas must have shape [B] with B={like.shape[0]}, got {tuple(sigmas.shape)}")
    return sigmas.reshape((like.shape[0],) + (1,) * (like.ndim - 1)).to(device=like.device, dtype=like.dtype)


def flow_noisy_input(x0: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * noise`` per sample; ``x0``/``noise`` ``[B, ...]``, ``sigmas [B]``."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != x0 shape {tuple(x0.shape)}")
    s = _per_sample(sigmas, x0)
    return (1.0 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the transformer predicts: ``noise - x0`` (d x_sigma / d sigma)."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != x0 shape {tuple(x0.shape)}")
    return noise - x0


def precondition_outputs(pred: torch.Tensor, noisy: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """SD3 scripts' EDM preconditioning (``--precondition_outputs``): the velocity prediction as an x0 estimate,
    ``noisy - sigma * pred``, whose target is then x0 (the velocity loss's minimiser, weighted by ``sigma^2``)."""
    return pred * (-_per_sample(sigmas, pred)) + noisy


def flow_loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """Per-sample loss weights (diffusers' ``compute_loss_weighting_for_sd3``), float32: ``sigma_sqrt``
    ``sigma^-2``, ``cosmap`` ``2 / (pi (1 - 2 sigma + 2 sigma^2))``, any other scheme 1."""
    check_scheme(weighting_scheme)
    sigmas = sigmas.float()
    if weighting_scheme == "sigma_sqrt":
        return sigmas**-2.0
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


# --- conditioning -------------------------------------------------------------------------------
def sd3_prompt_embeds(clip_hidden: Sequence[torch.Tensor], clip_pooled: Sequence[torch.Tensor],
                      t5_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``StableDiffusion3Pipeline.encode_prompt``'s ``(prompt_embeds, pooled)``: CLIP penultimate states zero-padded
    to the T5 width before the T5 states; ValueError where the CLIP widths exceed it."""
    clip = torch.cat(list(clip_hidden), dim=-1)
    pad = t5_hidden.shape[-1] - clip.shape[-1]
    if pad < 0:
        raise ValueError(f"the CLIP hidden widths add up to {clip.shape[-1]}, more than the T5 width "
                         f"{t5_hidden.shape[-1]}: the transformer's joint_attention_dim must be >= their sum.")
    clip = F.pad(clip, (0, pad))
    return torch.cat([clip, t5_hidden.to(clip.dtype)], dim=-2), torch.cat(list(clip_pooled), dim=-1)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """FLUX tokens: ``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]``, each token a 2x2 patch (channel-major)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for latents of ``height`` x ``width``: ``[B, hw/4, 4C] -> [B, C, h, w]``."""
    b, n, d = packed.shape
    if height % 2 or width % 2 or n != (height // 2) * (width // 2) or d % 4:
        raise ValueError(f"packed shape {tuple(packed.shape)} does not fit latents of {height}x{width}")
    x = packed.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def flux_image_ids(height: int, width: int) -> torch.Tensor:
    """Position ids ``[(h/2)(w/2), 3]`` of the packed tokens, ``(0, row, column)`` in packing order."""
    rows, cols = height // 2, width // 2
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3)


def flux_text_ids(seq_len: int) -> torch.Tensor:
    """Position ids of the T5 tokens: all zero, ``[seq_len, 3]``."""
    return torch.zeros(seq_len, 3)


def flux_guidance(guidance_scale: float, batch_size: int) -> torch.Tensor:
    """The guidance input of a guidance-distilled FLUX transformer: ``guidance_scale`` per sample, float32 ``[B]``."""
    return torch.full((batch_size,), float(guidance_scale), dtype=torch.float32)

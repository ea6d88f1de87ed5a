"""Pure tensor functions of denoising-diffusion training, on the scheduler's ``alphas_cumprod`` ([T], the cumulative
product of ``1 - beta_t``) rather than a scheduler object. Shapes: ``[B, ...]`` (any trailing dims, e.g. latents
``[B, C, H, W]``); per-sample coefficients broadcast over them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREDICTION_TYPES: tuple[str, ...] = ("epsilon", "v_prediction", "sample")

__all__ = ["PREDICTION_TYPES", "add_noise", "compute_snr", "diffusion_loss", "min_snr_weights", "offset_noise",
           "perturb_noise", "training_target", "velocity"]


def _check_prediction_type(prediction_type: str) -> None:
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"Unknown prediction_type {prediction_type!r}; expected one of "
                         + ", ".join(repr(p) for p in PREDICTION_TYPES))


def _coefficients(x: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``sqrt(a_t)`` and ``sqrt(1 - a_t)`` shaped ``[B, 1, ..., 1]``; the roots are taken in float32 (or
    float64) before the cast to ``x.dtype``: in fp16/bf16 they lose precision near ``a_t -> 1``."""
    if timesteps.ndim != 1 or timesteps.shape[0] != x.shape[0]:
        raise ValueError(f"timesteps must have shape [B] with B={x.shape[0]} (batch of x), got "
                         f"{tuple(timesteps.shape)}")
    ac = alphas_cumprod.to(device=x.device)
    if not ac.is_floating_point() or ac.dtype in (torch.float16, torch.bfloat16):
        ac = ac.float()
    a = ac[timesteps.to(device=x.device, dtype=torch.long)]
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    sqrt_a = a.sqrt().reshape(shape).to(x.dtype)
    sqrt_one_minus_a = (1.0 - a).clamp_min(0.0).sqrt().reshape(shape).to(x.dtype)
    return sqrt_a, sqrt_one_minus_a


def add_noise(x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor
              ) -> torch.Tensor:
    """Forward diffusion ``x_t = sqrt(a_t) * x0 + sqrt(1 - a_t) * noise`` (``timesteps`` ``[B]``), shaped like x0."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != x0 shape {tuple(x0.shape)}")
    sqrt_a, sqrt_one_minus_a = _coefficients(x0, timesteps, alphas_cumprod)
    return sqrt_a * x0 + sqrt_one_minus_a * noise


def velocity(x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor
             ) -> torch.Tensor:
    """v-prediction target ``v = sqrt(a_t) * noise - sqrt(1 - a_t) * x0`` (Salimans & Ho, 2022)."""
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} != x0 shape {tuple(x0.shape)}")
    sqrt_a, sqrt_one_minus_a = _coefficients(x0, timesteps, alphas_cumprod)
    return sqrt_a * noise - sqrt_one_minus_a * x0


def training_target(prediction_type: str, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                    alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """What the denoiser predicts: ``epsilon`` -> noise, ``v_prediction`` -> :func:`velocity`, ``sample`` -> x0."""
    _check_prediction_type(prediction_type)
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return velocity(x0, noise, timesteps, alphas_cumprod)
    return x0


def compute_snr(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32 signal-to-noise ratio ``a_t / (1 - a_t)`` (``inf`` where ``a_t == 1``, 0 where ``a_t == 0``)."""
    ac = alphas_cumprod.to(device=timesteps.device)
    ac = ac.double() if ac.dtype == torch.float64 else ac.float()
    a = ac[timesteps.long()]
    alpha = a.sqrt()
    sigma = (1.0 - a).clamp_min(0.0).sqrt()
    return ((alpha / sigma) ** 2).float()


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma weights (Hang et al., 2023) as ``train_text_to_image.py``: epsilon ``min(snr, gamma) / snr`` (1
    at ``snr == 0``), v ``min(snr, gamma) / (snr + 1)``, sample ``min(snr, gamma)``; ``[B]`` float32."""
    _check_prediction_type(prediction_type)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    snr = snr.float()
    clamped = torch.minimum(snr, torch.full_like(snr, float(gamma)))
    if prediction_type == "epsilon":
        weights = clamped / snr
        return torch.where(snr == 0, torch.ones_like(weights), weights)
    if prediction_type == "v_prediction":
        return clamped / (snr + 1.0)
    return clamped


def offset_noise(noise: torch.Tensor, offset: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Offset noise ``noise + offset * randn(B, C, 1, 1)``: a per-channel shift lets the model learn to change an
    image's mean brightness; 0 returns ``noise`` unchanged."""
    if offset == 0:
        return noise
    if noise.ndim < 2:
        raise ValueError(f"offset_noise needs [B, C, ...] noise, got shape {tuple(noise.shape)}")
    shape = tuple(noise.shape[:2]) + (1,) * (noise.ndim - 2)
    shift = torch.randn(shape, generator=generator, device=noise.device, dtype=noise.dtype)
    return noise + offset * shift


def perturb_noise(noise: torch.Tensor, gamma: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Input perturbation (Ning et al., 2023) ``noise + gamma * randn_like(noise)``, for the noisy input only (the
    target keeps the unperturbed noise: the mismatch simulates exposure bias); 0 returns ``noise`` unchanged."""
    if gamma == 0:
        return noise
    extra = torch.randn(noise.shape, generator=generator, device=noise.device, dtype=noise.dtype)
    return noise + gamma * extra


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 MSE: the mean over all elements, or with ``weights`` ``[B]`` ``mean_b(weights[b] * mean((pred[b] -
    target[b])^2))`` (diffusers' min-SNR weighting)."""
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    # float32 because fp16/bf16 squared errors over a whole latent lose most of their precision.
    if weights is None:
        return F.mse_loss(pred.float(), target.float(), reduction="mean")
    if weights.shape != (pred.shape[0],):
        raise ValueError(f"weights must have shape [B]=[{pred.shape[0]}], got {tuple(weights.shape)}")
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none")
    per_sample = per_sample.reshape(pred.shape[0], -1).mean(dim=1)
    return (per_sample * weights.to(device=per_sample.device, dtype=torch.float32)).mean()

"""The training step of diffusers' ``train_text_to_image.py``, on registry engines.

images -> latents through the ``vae`` engine (x scaling factor), captions -> embeddings through the
text-encoder engine(s), noise (optional offset / input perturbation), random timesteps, the target for
the prediction type, MSE with optional min-SNR-gamma weights; backward and step through the ``unet``
engine (which owns accumulation, clipping, the lr schedule and mixed precision).

All randomness of a step comes from an explicit CPU ``torch.Generator`` that the caller seeds from
(seed, step, rank): the same batch and seed give the same loss whatever the ZeRO stage of each role,
and a resumed run draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry

from .math import (
    PREDICTION_TYPES,
    add_noise,
    compute_snr,
    diffusion_loss,
    min_snr_weights,
    offset_noise,
    perturb_noise,
    training_target,
)
from .models import call_engine

logger = logging.getLogger(__name__)

__all__ = ["DiffusionObjective", "StepOutput", "heldout_loss", "step_generator"]


def step_generator(seed: int, step: int, micro_step: int, rank: int) -> torch.Generator:
    """The CPU generator for one micro batch: determined by (seed, step, micro_step, rank) only."""
    digest = hashlib.sha256(f"diffusion:{seed}:{step}:{micro_step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _randn(shape: Sequence[int], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    # Drawn on the CPU and moved: the same numbers on any device, so runs compare across hardware.
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(like.device)


@dataclass
class StepOutput:
    """One micro batch: ``loss`` (scalar float32 with grad), and detached stats."""

    loss: torch.Tensor
    timesteps: torch.Tensor  # [B]
    latents_std: float


class DiffusionObjective:
    """Latents, conditioning and loss for a registry holding ``unet``, ``vae`` and the text encoders.

    Args:
        registry: built registry (see :func:`build_diffusion_registry`).
        text_encoders: role names of the text encoders, in order (``["text_encoder"]`` for SD 1.x).
        alphas_cumprod: ``[T]`` from the noise scheduler.
        prediction_type: ``epsilon``, ``v_prediction`` or ``sample``.
        snr_gamma: min-SNR-gamma weighting when > 0 (diffusers recommends 5.0).
        noise_offset: offset-noise scale (0 = off).
        input_perturbation: input-perturbation scale (0 = off).
        resolution: training size, for SDXL's ``time_ids`` (target size).
    """

    def __init__(
        self,
        registry: EngineRegistry,
        text_encoders: Sequence[str],
        alphas_cumprod: torch.Tensor,
        prediction_type: str = "epsilon",
        snr_gamma: float = 0.0,
        noise_offset: float = 0.0,
        input_perturbation: float = 0.0,
        resolution: int = 512,
    ) -> None:
        if prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type={prediction_type!r}; use one of {list(PREDICTION_TYPES)}.")
        self.registry = registry
        self.text_encoders = list(text_encoders)
        self.alphas_cumprod = alphas_cumprod.float()
        self.num_train_timesteps = int(alphas_cumprod.shape[0])
        self.prediction_type = prediction_type
        self.snr_gamma = snr_gamma
        self.noise_offset = noise_offset
        self.input_perturbation = input_perturbation
        self.resolution = resolution
        self.device = registry.device
        vae_config = registry.role("vae").module.config
        self.scaling_factor = float(vae_config.scaling_factor)
        self.shift_factor = float(getattr(vae_config, "shift_factor", None) or 0.0)
        unet_config = registry.role("unet").module.config
        # SDXL-style unets take the pooled text embedding and size/crop ids as extra conditions.
        self.text_time = getattr(unet_config, "addition_embed_type", None) == "text_time"

    # --- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def latents(self, pixel_values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> float32 latents ``[B, C, H/f, W/f]``, sampled from the vae's
        posterior with ``generator`` and scaled (``(z - shift) * scaling_factor``)."""
        vae = self.registry.role("vae")
        posterior = call_engine(vae.engine, "encode", pixel_values.to(self.device, vae.dtype)).latent_dist
        # DiagonalGaussianDistribution.sample(generator): the same draw for the same generator state.
        z = posterior.mean + posterior.std * _randn(posterior.mean.shape, generator, posterior.mean).to(
            posterior.mean.dtype)
        return (z.float() - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def encode_prompts(self, input_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids per text encoder (each ``[B, L]``) -> ``(hidden [B, L, sum D], pooled [B, P] | None)``.

        One encoder (SD 1.x/2.x): its last hidden state, as diffusers' example. Several (SDXL): each
        encoder's penultimate hidden state, concatenated on the feature axis, and the pooled projection
        of the last one - what ``StableDiffusionXLPipeline.encode_prompt`` builds.
        """
        if len(input_ids) != len(self.text_encoders):
            raise ValueError(f"{len(input_ids)} id tensors for {len(self.text_encoders)} text encoders")
        if len(self.text_encoders) == 1:
            engine = self.registry[self.text_encoders[0]]
            return engine(input_ids[0].to(self.device), return_dict=False)[0].float(), None
        hidden, pooled = [], None
        for name, ids in zip(self.text_encoders, input_ids):
            out = self.registry[name](ids.to(self.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2].float())
            pooled = getattr(out, "text_embeds", None)
            if pooled is None:
                pooled = out[0] if out[0].ndim == 2 else None
        return torch.cat(hidden, dim=-1), None if pooled is None else pooled.float()

    def time_ids(self, batch: dict[str, Any], batch_size: int) -> torch.Tensor:
        """SDXL micro-conditioning ``[B, 6]``: original size, crop top-left, target size."""
        res = self.resolution
        original = batch.get("original_sizes", torch.tensor([[res, res]] * batch_size))
        crops = batch.get("crop_top_lefts", torch.zeros(batch_size, 2, dtype=torch.long))
        target = torch.tensor([[res, res]] * batch_size)
        return torch.cat([original, crops, target], dim=1).float().to(self.device)

    # --- the loss -----------------------------------------------------------------------------
    def unet_forward(
        self,
        unet: Any,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        hidden: torch.Tensor,
        pooled: torch.Tensor | None,
        time_ids: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``unet(noisy [B, C, h, w], timesteps [B], hidden [B, L, D])`` -> prediction ``[B, C, h, w]``;
        inputs are cast to the unet's dtype (a bf16 engine does not cast them itself)."""
        kwargs: dict[str, Any] = {}
        if self.text_time:
            if pooled is None:
                raise ValueError("this unet needs a pooled text embedding (addition_embed_type='text_time'); "
                                 "its last text encoder must have a projection (CLIPTextModelWithProjection).")
            kwargs["added_cond_kwargs"] = {"text_embeds": pooled.to(dtype), "time_ids": time_ids.to(dtype)}
        out = unet(noisy.to(dtype), timesteps.to(self.device), encoder_hidden_states=hidden.to(dtype),
                   return_dict=False, **kwargs)
        return out[0]

    def loss(
        self,
        batch: dict[str, Any],
        generator: torch.Generator,
        timesteps: torch.Tensor | None = None,
        unet_role: str = "unet",
        weighted: bool = True,
    ) -> StepOutput:
        """The training loss of one micro batch.

        Args:
            batch: ``pixel_values [B, 3, H, W]``, ``input_ids [B, L]`` (and ``input_ids_2`` ... for
                more text encoders), optionally ``original_sizes``/``crop_top_lefts`` ``[B, 2]``.
            generator: CPU generator; draws, in order: posterior sample, noise, offset, perturbation,
                timesteps (only when ``timesteps`` is not given).
            timesteps: fixed ``[B]`` timesteps (held-out evaluation), else uniform random.
            unet_role: the role to predict with (``ema`` to evaluate the EMA weights).
            weighted: apply min-SNR weights (when ``snr_gamma > 0``).
        """
        pixel_values = batch["pixel_values"]
        bsz = pixel_values.shape[0]
        latents = self.latents(pixel_values, generator)
        ids = [batch["input_ids"]] + [batch[f"input_ids_{i + 1}"] for i in range(1, len(self.text_encoders))]
        hidden, pooled = self.encode_prompts(ids)

        # Noise is built on the CPU from the generator, with math.py's pure functions, then moved.
        noise = torch.randn(tuple(latents.shape), generator=generator)
        noise = offset_noise(noise, self.noise_offset, generator=generator)
        model_noise = perturb_noise(noise, self.input_perturbation, generator=generator)
        noise, model_noise = noise.to(latents.device), model_noise.to(latents.device)
        if timesteps is None:
            timesteps = torch.randint(0, self.num_train_timesteps, (bsz,), generator=generator)
        timesteps = timesteps.long().to(latents.device)
        noisy = add_noise(latents, model_noise, timesteps, self.alphas_cumprod)
        target = training_target(self.prediction_type, latents, noise, timesteps, self.alphas_cumprod)

        role = self.registry.role(unet_role)
        time_ids = self.time_ids(batch, bsz) if self.text_time else None
        pred = self.unet_forward(role.engine, noisy, timesteps, hidden, pooled, time_ids, role.dtype)
        weights = None
        if weighted and self.snr_gamma > 0:
            snr = compute_snr(timesteps, self.alphas_cumprod)
            weights = min_snr_weights(snr, self.snr_gamma, self.prediction_type)
        return StepOutput(loss=diffusion_loss(pred, target, weights), timesteps=timesteps.detach().cpu(),
                          latents_std=float(latents.std()))


@torch.no_grad()
def heldout_loss(
    objective: DiffusionObjective,
    batches: Sequence[dict[str, Any]],
    timesteps: Sequence[int],
    seed: int,
    unet_role: str = "unet",
) -> float:
    """Mean unweighted loss over this rank's held-out ``batches`` x every timestep in ``timesteps``,
    with noise fixed by ``seed``; averaged over all ranks (the same number on every rank).

    Each rank must pass the same number of batches of the same sizes: every unet forward gathers
    ZeRO-3 weights collectively.
    """
    role = objective.registry.role(unet_role)
    was_training = role.module.training
    role.module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for i, batch in enumerate(batches):
            for t in timesteps:
                # The same (seed, batch, t) draws the same posterior sample and noise before and after training.
                g = step_generator(seed, i, int(t), objective.registry.rank)
                ts = torch.full((batch["pixel_values"].shape[0],), int(t), dtype=torch.long)
                out = objective.loss(batch, g, timesteps=ts, unet_role=unet_role, weighted=False)
                total += torch.tensor([out.loss.item() * len(ts), len(ts)], dtype=torch.float64)
    finally:
        role.module.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])

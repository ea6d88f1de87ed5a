"""The training steps of diffusers' scripts, on registry engines: one objective per kind of model.

* :class:`DiffusionObjective` - ``train_text_to_image.py`` / ``train_text_to_image_sdxl.py`` (unet, DDPM):
  images -> latents through the ``vae`` engine, captions -> embeddings through the text-encoder engine(s),
  noise (optional offset / input perturbation), random timesteps, the target for the prediction type, MSE
  with optional min-SNR-gamma weights.
* :class:`ControlNetObjective` - ``train_controlnet.py``: the same with a trainable ``controlnet`` whose
  residuals go into a frozen ``unet``; the loss reaches the controlnet through the frozen unet.
* :class:`FlowMatchingObjective` - ``train_dreambooth_sd3.py`` / ``train_dreambooth_flux.py`` (transformer,
  rectified flow): timesteps from a density over the FlowMatchEuler table, ``(1 - sigma) x0 + sigma noise``,
  velocity target, the SD3 loss weightings; three text encoders (SD3) or two with packed latents,
  position ids and a guidance input (FLUX).

Backward and step go through the trainable role's engine (it owns accumulation, clipping, the lr
schedule and mixed precision).

All randomness of a step comes from an explicit CPU ``torch.Generator`` that the caller seeds from
(seed, step, rank): the same batch and seed give the same loss whatever the ZeRO stage of each role,
and a resumed run draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry

from . import flow
from .families import family_roles
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

__all__ = [
    "ControlNetObjective",
    "DiffusionObjective",
    "FlowMatchingObjective",
    "StepOutput",
    "differentiable_forward",
    "family_objective",
    "flow_heldout_loss",
    "heldout_loss",
    "heldout_value",
    "prompt_input_ids",
    "step_generator",
]


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
    sigmas: torch.Tensor | None = None  # [B], flow matching only


@torch.no_grad()
def _vae_latents(registry: EngineRegistry, vae_role: str, pixel_values: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
    """``[B, 3, H, W]`` in [-1, 1] -> float32 latents ``[B, C, H/f, W/f]``, sampled from the vae's posterior
    with ``generator`` (one ``randn`` of the latent shape) and normalised: ``(z - shift_factor) * scaling_factor``."""
    vae = registry.role(vae_role)
    config = vae.module.config
    posterior = call_engine(vae.engine, "encode", pixel_values.to(registry.device, vae.dtype)).latent_dist
    # DiagonalGaussianDistribution.sample(generator): the same draw for the same generator state.
    z = posterior.mean + posterior.std * _randn(posterior.mean.shape, generator, posterior.mean).to(
        posterior.mean.dtype)
    shift = float(getattr(config, "shift_factor", None) or 0.0)
    return (z.float() - shift) * float(config.scaling_factor)


def prompt_input_ids(tokenizers: Sequence[Any], captions: Sequence[str],
                     max_lengths: Sequence[int | None] | None = None) -> dict[str, torch.Tensor]:
    """Token ids per text encoder, as the pipelines tokenize prompts: padded to ``max_length`` (default each
    tokenizer's ``model_max_length``; give T5 the pipeline's ``max_sequence_length``), truncated.

    Returns:
        ``{"input_ids": [B, L1], "input_ids_2": [B, L2], ...}`` in the order of ``tokenizers``.
    """
    if isinstance(captions, str):
        raise TypeError("captions must be a sequence of strings, not a single string")
    max_lengths = list(max_lengths) if max_lengths is not None else [None] * len(tokenizers)
    if len(max_lengths) != len(tokenizers):
        raise ValueError(f"{len(max_lengths)} max_lengths for {len(tokenizers)} tokenizers")
    out = {}
    for i, (tok, length) in enumerate(zip(tokenizers, max_lengths)):
        ids = tok(list(captions), padding="max_length", max_length=length or tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids
        out["input_ids" if i == 0 else f"input_ids_{i + 1}"] = ids.long()
    return out


def _input_ids(batch: Mapping[str, Any], count: int) -> list[torch.Tensor]:
    return [batch["input_ids"]] + [batch[f"input_ids_{i + 1}"] for i in range(1, count)]


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

    trained_role = "unet"  # the role loss() predicts with unless told otherwise

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
        return _vae_latents(self.registry, "vae", pixel_values, generator)

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

    def added_cond_kwargs(self, pooled: torch.Tensor | None, time_ids: torch.Tensor | None,
                          dtype: torch.dtype) -> dict[str, Any]:
        """``{"added_cond_kwargs": {...}}`` for a text_time (SDXL) unet or controlnet, else ``{}``."""
        if not self.text_time:
            return {}
        if pooled is None:
            raise ValueError("this unet needs a pooled text embedding (addition_embed_type='text_time'); "
                             "its last text encoder must have a projection (CLIPTextModelWithProjection).")
        return {"added_cond_kwargs": {"text_embeds": pooled.to(dtype), "time_ids": time_ids.to(dtype)}}

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
        out = unet(noisy.to(dtype), timesteps.to(self.device), encoder_hidden_states=hidden.to(dtype),
                   return_dict=False, **self.added_cond_kwargs(pooled, time_ids, dtype))
        return out[0]

    def predict(self, role: str, noisy: torch.Tensor, timesteps: torch.Tensor, hidden: torch.Tensor,
                pooled: torch.Tensor | None, time_ids: torch.Tensor | None, batch: Mapping[str, Any]) -> torch.Tensor:
        """The model's prediction for the noisy latents (``role``: the unet, or its ``ema``)."""
        r = self.registry.role(role)
        return self.unet_forward(r.engine, noisy, timesteps, hidden, pooled, time_ids, r.dtype)

    def heldout_points(self, count: int) -> list[int]:
        """``count`` evenly spaced timesteps (cell centres of ``[0, T)``) for the held-out loss."""
        return [int((i + 0.5) * self.num_train_timesteps / count) for i in range(count)]

    def loss(
        self,
        batch: dict[str, Any],
        generator: torch.Generator,
        timesteps: torch.Tensor | None = None,
        role: str | None = None,
        weighted: bool = True,
    ) -> StepOutput:
        """The training loss of one micro batch.

        Args:
            batch: ``pixel_values [B, 3, H, W]``, ``input_ids [B, L]`` (and ``input_ids_2`` ... for
                more text encoders), optionally ``original_sizes``/``crop_top_lefts`` ``[B, 2]``.
            generator: CPU generator; draws, in order: posterior sample, noise, offset, perturbation,
                timesteps (only when ``timesteps`` is not given).
            timesteps: fixed ``[B]`` timesteps (held-out evaluation), else uniform random.
            role: the role to predict with (default :attr:`trained_role`; ``ema`` to evaluate the EMA weights).
            weighted: apply min-SNR weights (when ``snr_gamma > 0``).
        """
        pixel_values = batch["pixel_values"]
        bsz = pixel_values.shape[0]
        latents = self.latents(pixel_values, generator)
        hidden, pooled = self.encode_prompts(_input_ids(batch, len(self.text_encoders)))

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

        time_ids = self.time_ids(batch, bsz) if self.text_time else None
        pred = self.predict(role or self.trained_role, noisy, timesteps, hidden, pooled, time_ids, batch)
        weights = None
        if weighted and self.snr_gamma > 0:
            snr = compute_snr(timesteps, self.alphas_cumprod)
            weights = min_snr_weights(snr, self.snr_gamma, self.prediction_type)
        return StepOutput(loss=diffusion_loss(pred, target, weights), timesteps=timesteps.detach().cpu(),
                          latents_std=float(latents.std()))


def differentiable_forward(registry: EngineRegistry, role: str, *args: Any, **kwargs: Any) -> Any:
    """Call a frozen role's module with autograd on, so that a loss reaches trainable inputs through it
    (the frozen unet between a trainable ControlNet and the loss). Its parameters get no gradients.

    A frozen engine's own forward runs under ``no_grad`` and would cut the graph; the module itself keeps
    its ZeRO-3 hooks (every layer gathers its weights in the forward and again in the backward). All
    ranks must make the same calls, and the backward must reach it on every rank.
    """
    r = registry.role(role)
    if r.trainable:
        raise ValueError(f"role '{role}' is trainable: call its engine, which owns its backward.")
    with torch.enable_grad():
        return r.module(*args, **kwargs)


class ControlNetObjective(DiffusionObjective):
    """diffusers' ``train_controlnet.py`` step: the trainable ``controlnet`` sees the noisy latents, the
    timestep, the text embedding and the conditioning image, and its residuals are added inside the frozen
    ``unet``, whose prediction gives the same loss as :class:`DiffusionObjective` (noise / v target, min-SNR).

    The batch adds ``conditioning_pixel_values [B, 3, H, W]`` in ``[0, 1]`` (no normalisation, as the
    script's conditioning transform). Same arguments as :class:`DiffusionObjective`, plus
    ``conditioning_scale`` (multiplies the residuals; 1 in training).
    """

    trained_role = "controlnet"

    def __init__(self, registry: EngineRegistry, text_encoders: Sequence[str], alphas_cumprod: torch.Tensor,
                 prediction_type: str = "epsilon", snr_gamma: float = 0.0, noise_offset: float = 0.0,
                 input_perturbation: float = 0.0, resolution: int = 512, conditioning_scale: float = 1.0,
                 unet_role: str = "unet") -> None:
        super().__init__(registry, text_encoders, alphas_cumprod, prediction_type, snr_gamma, noise_offset,
                         input_perturbation, resolution)
        if registry.role(unet_role).trainable:
            raise ValueError(f"role '{unet_role}' is trainable; the ControlNet objective expects a frozen unet.")
        self.unet_role = unet_role
        self.conditioning_scale = float(conditioning_scale)

    def predict(self, role: str, noisy: torch.Tensor, timesteps: torch.Tensor, hidden: torch.Tensor,
                pooled: torch.Tensor | None, time_ids: torch.Tensor | None, batch: Mapping[str, Any]) -> torch.Tensor:
        if "conditioning_pixel_values" not in batch:
            raise KeyError("the ControlNet objective needs batch['conditioning_pixel_values'] [B, 3, H, W] in [0, 1]")
        control = self.registry.role(role)
        cond = batch["conditioning_pixel_values"].to(self.device, control.dtype)
        t = timesteps.to(self.device)
        down, mid = control.engine(noisy.to(control.dtype), t, encoder_hidden_states=hidden.to(control.dtype),
                                   controlnet_cond=cond, conditioning_scale=self.conditioning_scale,
                                   return_dict=False, **self.added_cond_kwargs(pooled, time_ids, control.dtype))
        unet = self.registry.role(self.unet_role)
        dtype = unet.dtype
        out = differentiable_forward(
            self.registry, self.unet_role, noisy.to(dtype), t, encoder_hidden_states=hidden.to(dtype),
            down_block_additional_residuals=[d.to(dtype) for d in down], mid_block_additional_residual=mid.to(dtype),
            return_dict=False, **self.added_cond_kwargs(pooled, time_ids, dtype))
        return out[0]


class FlowMatchingObjective:
    """The rectified-flow step of diffusers' SD3 / FLUX training scripts on a registry holding
    ``transformer``, ``vae`` and the family's text encoders (:func:`family_roles`).

    Args:
        registry: built registry.
        family: ``sd3`` (CLIP-L + CLIP-G penultimate states and pooled projections, T5 states) or ``flux``
            (CLIP-L pooled output, T5 states, packed latents, position ids, guidance when the transformer has
            ``guidance_embeds``).
        scheduler_config: the folder's FlowMatchEulerDiscreteScheduler config (``num_train_timesteps``,
            ``shift``, ``use_dynamic_shifting``): the table of timesteps and sigmas drawn from.
        weighting_scheme: diffusers' ``--weighting_scheme``: ``logit_normal``/``mode``/``uniform`` shape the
            timestep density, ``sigma_sqrt``/``cosmap`` weight the loss (uniform density), ``none``.
        logit_mean, logit_std, mode_scale: the density's parameters (diffusers' defaults 0, 1, 1.29).
        precondition_outputs: SD3 scripts' EDM preconditioning: the loss compares ``noisy - sigma * pred``
            with ``x0`` (diffusers' SD3 scripts default to it; FLUX's do not have it).
        guidance_scale: FLUX guidance input during training (diffusers' default 3.5); ignored without
            ``guidance_embeds``.
        text_encoders: role names (default: the family's).
    """

    trained_role = "transformer"

    def __init__(
        self,
        registry: EngineRegistry,
        family: str,
        scheduler_config: Mapping[str, Any],
        weighting_scheme: str = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        mode_scale: float = 1.29,
        precondition_outputs: bool = False,
        guidance_scale: float = 3.5,
        text_encoders: Sequence[str] | None = None,
    ) -> None:
        roles = family_roles(family)
        if roles.objective != "flow":
            raise ValueError(f"family={family!r} trains with DDPM noise targets: use DiffusionObjective.")
        self.family = family
        self.registry = registry
        self.device = registry.device
        self.text_encoders = list(text_encoders) if text_encoders is not None else list(roles.text_encoders)
        if len(self.text_encoders) != len(roles.text_encoders):
            raise ValueError(f"family {family!r} has {len(roles.text_encoders)} text encoders "
                             f"{list(roles.text_encoders)}, got {self.text_encoders}")
        self.weighting_scheme = flow.check_scheme(weighting_scheme)
        if logit_std <= 0:
            raise ValueError(f"logit_std={logit_std} must be > 0.")
        self.logit_mean, self.logit_std, self.mode_scale = float(logit_mean), float(logit_std), float(mode_scale)
        self.precondition = bool(precondition_outputs)
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.timesteps, self.sigmas = flow.flow_match_schedule(
            self.num_train_timesteps, float(scheduler_config.get("shift", 1.0)),
            bool(scheduler_config.get("use_dynamic_shifting", False)))
        config = registry.role(self.trained_role).module.config
        self.guidance_scale = float(guidance_scale) if getattr(config, "guidance_embeds", False) else None

    # --- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def latents(self, pixel_values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> float32 ``(z - shift_factor) * scaling_factor`` ``[B, C, h, w]``."""
        return _vae_latents(self.registry, "vae", pixel_values, generator)

    @torch.no_grad()
    def encode_prompts(self, input_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids per text encoder -> ``(prompt_embeds [B, L, D], pooled [B, P])`` as the family's
        pipeline builds them (``encode_prompt``), in float32."""
        if len(input_ids) != len(self.text_encoders):
            raise ValueError(f"{len(input_ids)} id tensors for {len(self.text_encoders)} text encoders")
        ids = [x.to(self.device) for x in input_ids]
        if self.family == "sd3":
            hidden, pooled = [], []
            for name, x in zip(self.text_encoders[:2], ids[:2]):
                out = self.registry[name](x, output_hidden_states=True)
                hidden.append(out.hidden_states[-2].float())
                pooled.append(out[0].float())  # text_embeds: the pooled projection
            t5 = self.registry[self.text_encoders[2]](ids[2])[0].float()
            return flow.sd3_prompt_embeds(hidden, pooled, t5)
        clip = self.registry[self.text_encoders[0]](ids[0], output_hidden_states=False)
        t5 = self.registry[self.text_encoders[1]](ids[1])[0].float()
        return t5, clip.pooler_output.float()

    # --- the loss -----------------------------------------------------------------------------
    def transformer_forward(self, transformer: Any, noisy: torch.Tensor, timesteps: torch.Tensor,
                            prompt_embeds: torch.Tensor, pooled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The transformer's velocity prediction ``[B, C, h, w]`` for noisy latents ``[B, C, h, w]`` and
        timesteps ``[B]`` (values of the table, 0..1000); inputs in the transformer's dtype."""
        t = timesteps.to(self.device, torch.float32)
        kwargs = {"encoder_hidden_states": prompt_embeds.to(dtype), "pooled_projections": pooled.to(dtype),
                  "return_dict": False}
        if self.family == "sd3":
            return transformer(hidden_states=noisy.to(dtype), timestep=t, **kwargs)[0]
        b, _, h, w = noisy.shape
        guidance = None
        if self.guidance_scale is not None:
            guidance = flow.flux_guidance(self.guidance_scale, b).to(self.device)
        # FLUX's transformer scales timestep (and guidance) by 1000 itself: the pipeline passes t / 1000.
        out = transformer(hidden_states=flow.pack_latents(noisy.to(dtype)), timestep=t / 1000, guidance=guidance,
                          txt_ids=flow.flux_text_ids(prompt_embeds.shape[1]).to(self.device),
                          img_ids=flow.flux_image_ids(h, w).to(self.device), **kwargs)[0]
        return flow.unpack_latents(out, h, w)

    def heldout_points(self, count: int) -> list[int]:
        """``count`` evenly spaced indices into the timestep table for the held-out loss."""
        return [int((i + 0.5) * self.num_train_timesteps / count) for i in range(count)]

    def loss(
        self,
        batch: Mapping[str, Any],
        generator: torch.Generator,
        indices: torch.Tensor | None = None,
        role: str | None = None,
        weighted: bool = True,
    ) -> StepOutput:
        """The flow-matching loss of one micro batch.

        Args:
            batch: ``pixel_values [B, 3, H, W]`` and ``input_ids``, ``input_ids_2`` (, ``input_ids_3``) per text
                encoder (:func:`prompt_input_ids`).
            generator: CPU generator; draws, in order: posterior sample, noise, the density sample ``u``
                (only when ``indices`` is not given) - the order of diffusers' scripts.
            indices: fixed ``[B]`` positions in the timestep table (held-out evaluation), else drawn from the
                density.
            role: the role to predict with (default ``transformer``; e.g. its ``ema``).
            weighted: apply the scheme's loss weighting (``sigma_sqrt``/``cosmap``).
        """
        latents = self.latents(batch["pixel_values"], generator)
        bsz = latents.shape[0]
        prompt_embeds, pooled = self.encode_prompts(_input_ids(batch, len(self.text_encoders)))
        noise = torch.randn(tuple(latents.shape), generator=generator).to(latents.device)
        if indices is None:
            u = flow.timestep_density(self.weighting_scheme, bsz, self.logit_mean, self.logit_std, self.mode_scale,
                                      generator=generator)
            indices, timesteps, sigmas = flow.sample_flow_timesteps(u, self.timesteps, self.sigmas)
        else:
            indices = indices.long().cpu()
            timesteps, sigmas = self.timesteps[indices], self.sigmas[indices]
        sigmas = sigmas.to(latents.device)
        noisy = flow.flow_noisy_input(latents, noise, sigmas)

        r = self.registry.role(role or self.trained_role)
        pred = self.transformer_forward(r.engine, noisy, timesteps, prompt_embeds, pooled, r.dtype)
        if self.precondition:
            pred, target = flow.precondition_outputs(pred.float(), noisy, sigmas), latents
        else:
            target = flow.flow_target(latents, noise)
        weights = flow.flow_loss_weighting(self.weighting_scheme, sigmas) if weighted else None
        return StepOutput(loss=diffusion_loss(pred, target, weights), timesteps=timesteps.detach().cpu(),
                          latents_std=float(latents.std()), sigmas=sigmas.detach().cpu())


@torch.no_grad()
def _heldout_mean(objective: Any, batches: Sequence[Mapping[str, Any]], points: Sequence[int], seed: int,
                  role: str | None, fixed: Callable[[int, int], torch.Tensor]) -> float:
    name = role or objective.trained_role
    module = objective.registry.role(name).module
    was_training = module.training
    module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    try:
        for i, batch in enumerate(batches):
            for p in points:
                # The same (seed, batch, point) draws the same posterior sample and noise before and after training.
                g = step_generator(seed, i, int(p), objective.registry.rank)
                n = batch["pixel_values"].shape[0]
                out = objective.loss(batch, g, fixed(int(p), n), role=name, weighted=False)
                total += torch.tensor([out.loss.item() * n, n], dtype=torch.float64)
    finally:
        module.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def heldout_loss(
    objective: DiffusionObjective,
    batches: Sequence[dict[str, Any]],
    timesteps: Sequence[int],
    seed: int,
    unet_role: str | None = None,
) -> float:
    """Mean unweighted loss over this rank's held-out ``batches`` x every timestep in ``timesteps``,
    with noise fixed by ``seed``; averaged over all ranks (the same number on every rank). ``unet_role``:
    the role predicting (default the objective's trained role: ``unet``, ``controlnet``; or an ``ema``).

    Each rank must pass the same number of batches of the same sizes: every forward gathers
    ZeRO-3 weights collectively.
    """
    return _heldout_mean(objective, batches, timesteps, seed, unet_role,
                         lambda t, n: torch.full((n,), t, dtype=torch.long))


def flow_heldout_loss(
    objective: FlowMatchingObjective,
    batches: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    seed: int,
    role: str | None = None,
) -> float:
    """:func:`heldout_loss` for flow matching: every batch at every table position in ``indices``
    (:meth:`FlowMatchingObjective.heldout_points`), noise fixed by ``seed``, no loss weighting; the mean
    over all ranks. Collective, like :func:`heldout_loss`."""
    return _heldout_mean(objective, batches, indices, seed, role, lambda i, n: torch.full((n,), i, dtype=torch.long))


def family_objective(registry: EngineRegistry, model_path: str, family: str, text_encoders: Sequence[str], *,
                   resolution: int, prediction_type: str = "", snr_gamma: float = 0.0, noise_offset: float = 0.0,
                   input_perturbation: float = 0.0, flow_options: Mapping[str, Any] | None = None,
                   conditioning_scale: float | None = None) -> tuple[Any, str | None]:
    """The family's objective on the folder's scheduler and its prediction type: FlowMatchingObjective (SD3,
    FLUX; ``flow_options`` its options, prediction type None), else the DDPM objective (``prediction_type`` ""
    = the scheduler's), a ControlNetObjective when ``conditioning_scale`` is given."""
    if family_roles(family).objective == "flow":
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        return FlowMatchingObjective(registry, family, config, text_encoders=text_encoders,
                                     **dict(flow_options or {})), None
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_pretrained(model_path, subfolder="scheduler")
    prediction_type = prediction_type or scheduler.config.prediction_type
    options = {"prediction_type": prediction_type, "snr_gamma": snr_gamma, "noise_offset": noise_offset,
               "input_perturbation": input_perturbation, "resolution": resolution}
    if conditioning_scale is None:
        return DiffusionObjective(registry, text_encoders, scheduler.alphas_cumprod, **options), prediction_type
    return ControlNetObjective(registry, text_encoders, scheduler.alphas_cumprod, conditioning_scale=conditioning_scale,
                               **options), prediction_type


def heldout_value(objective: Any, batches: Sequence[Mapping[str, Any]], points: Sequence[int], seed: int,
                  role: str | None = None) -> float:
    """The held-out loss of ``role`` (None: the trained one) with either objective."""
    if isinstance(objective, FlowMatchingObjective):
        return flow_heldout_loss(objective, batches, points, seed, role=role)
    return heldout_loss(objective, batches, points, seed, unet_role=role)

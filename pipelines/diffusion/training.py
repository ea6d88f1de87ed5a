"""The training steps of diffusers' scripts on registry engines and their settings (the ``diffusion`` section):
DDPM (train_text_to_image), ControlNet (train_controlnet) and flow matching (train_dreambooth_sd3 / _flux). All of
a step's randomness comes from a CPU generator seeded from (seed, step, rank): the same loss at any ZeRO stage and
after a resume."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.settings import OPTIMIZER_CHECKS, Choice, Range, Settings, setting

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

__all__ = ["FLOW_FAMILY_DEFAULTS", "ControlNetObjective", "DDPMSettings", "DiffusionObjective", "DiffusionSettings",
           "FlowMatchingObjective", "StepOutput", "differentiable_forward", "family_objective", "heldout_loss",
           "prompt_input_ids", "step_generator"]

# The flow-matching options' defaults per family, as diffusers' SD3 / FLUX training scripts set them.
FLOW_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"weighting_scheme": "logit_normal", "precondition_outputs": True, "max_sequence_length": 77},
    "flux": {"weighting_scheme": "none", "precondition_outputs": False, "max_sequence_length": 512},
}


@dataclass(frozen=True)
class DDPMSettings(Settings):
    """The DDPM objective of the unet families (SD, SDXL), as diffusers' scripts' options."""

    adam_epsilon: float = setting(1e-8, "AdamW epsilon of the trained role (diffusers' scripts' --adam_epsilon)",
                                  OPTIMIZER_CHECKS["eps"])
    prediction_type: str = setting("", "SD/SDXL: \"\" = the scheduler's; epsilon | v_prediction | sample",
                                   Choice("", *PREDICTION_TYPES))
    snr_gamma: float = setting(0.0, "SD/SDXL: > 0 = min-SNR-gamma weighting (5.0 recommended)", Range(0))
    noise_offset: float = setting(0.0, "SD/SDXL: offset-noise scale", Range(0))
    input_perturbation: float = setting(0.0, "SD/SDXL: input-perturbation scale", Range(0))


@dataclass(frozen=True)
class DiffusionSettings(DDPMSettings):
    """DDPM (SD, SDXL) or rectified flow matching (SD3, FLUX); "" / null / 0 take the family's value."""

    weighting_scheme: str = setting("", "SD3/FLUX: \"\" = the family's (SD3 logit_normal, FLUX none); or uniform, "
                                        "mode, cosmap, ...", Choice("", *flow.SCHEMES))
    logit_mean: float = setting(0.0, "SD3/FLUX logit_normal density: mean")
    logit_std: float = setting(1.0, "SD3/FLUX logit_normal density: standard deviation", Range(0, min_exclusive=True))
    mode_scale: float = setting(1.29, "SD3/FLUX mode density: scale", Range(0))
    precondition_outputs: bool | None = setting(None, "SD3/FLUX: null = the family's (SD3 true, FLUX false): x0 loss "
                                                      "of noisy - sigma * pred")
    guidance_scale: float = setting(3.5, "FLUX with a guidance embedding: the guidance input during training")
    max_sequence_length: int = setting(0, "SD3/FLUX: T5 tokens per caption; 0 = the family's (SD3 77, FLUX 512)",
                                       Range(0))

    DDPM = ("prediction_type", "snr_gamma", "noise_offset", "input_perturbation")
    FLOW = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "precondition_outputs", "guidance_scale",
            "max_sequence_length")

    def flow_option(self, family: str, name: str) -> Any:
        """A flow option with "" / None resolved to the family's."""
        value = getattr(self, name)
        return FLOW_FAMILY_DEFAULTS[family][name] if value is None or (type(value) in (str, int) and not value) \
            else value


def step_generator(seed: int, step: int, micro_step: int, rank: int) -> torch.Generator:
    """The CPU generator for one micro batch: determined by (seed, step, micro_step, rank) only."""
    digest = hashlib.sha256(f"diffusion:{seed}:{step}:{micro_step}:{rank}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@dataclass
class StepOutput:
    """One micro batch: ``loss`` (scalar float32 with grad), and detached stats."""

    loss: torch.Tensor
    timesteps: torch.Tensor  # [B]
    latents_std: float
    sigmas: torch.Tensor | None = None  # [B], flow matching only


def prompt_input_ids(tokenizers: Sequence[Any], captions: Sequence[str],
                     max_lengths: Sequence[int | None] | None = None) -> dict[str, torch.Tensor]:
    """``{"input_ids": [B, L1], "input_ids_2": [B, L2], ...}``: each tokenizer's ids as the pipelines tokenize
    prompts, padded to ``max_lengths`` (None: the tokenizer's ``model_max_length``; T5: max_sequence_length)."""
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


class _Objective:
    """What both objectives share: the registry, the vae's latents, the text encoders, evenly spaced held-out
    positions over ``num_train_timesteps``; ``trained_role`` predicts unless a loss names another (an ``ema``)."""

    num_train_timesteps: int

    def __init__(self, registry: EngineRegistry, text_encoders: Sequence[str], role: str) -> None:
        self.registry, self.device, self.trained_role = registry, registry.device, role
        self.text_encoders = list(text_encoders)

    @torch.no_grad()
    def latents(self, pixel_values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> float32 latents ``[B, C, H/f, W/f]``: one draw of the vae's posterior
        (DiagonalGaussianDistribution.sample(generator)), normalised ``(z - shift_factor) * scaling_factor``."""
        vae = self.registry.role("vae")
        posterior = call_engine(vae.engine, "encode", pixel_values.to(self.device, vae.dtype)).latent_dist
        draw = torch.randn(tuple(posterior.mean.shape), generator=generator, dtype=torch.float32)
        z = posterior.mean + posterior.std * draw.to(posterior.mean.device).to(posterior.mean.dtype)
        config = vae.module.config
        return (z.float() - float(getattr(config, "shift_factor", None) or 0.0)) * float(config.scaling_factor)

    def heldout_points(self, count: int) -> list[int]:
        """``count`` evenly spaced positions (cell centres of ``[0, T)``) for the held-out loss."""
        return [int((i + 0.5) * self.num_train_timesteps / count) for i in range(count)]


class DiffusionObjective(_Objective):
    """Latents, conditioning and loss for a registry holding a unet (``role``), ``vae`` and text encoders, on the
    folder's DDPM ``scheduler``; ``resolution``: SDXL's target size."""

    def __init__(self, registry: EngineRegistry, text_encoders: Sequence[str], scheduler: Any,
                 settings: DDPMSettings | None = None, resolution: int = 512, role: str = "unet") -> None:
        super().__init__(registry, text_encoders, role)
        s = settings or DDPMSettings()
        self.alphas_cumprod = scheduler.alphas_cumprod.float()
        self.num_train_timesteps = int(self.alphas_cumprod.shape[0])
        self.prediction_type = s.prediction_type or str(scheduler.config.prediction_type)
        self.snr_gamma, self.noise_offset, self.input_perturbation = s.snr_gamma, s.noise_offset, s.input_perturbation
        self.resolution = resolution
        # SDXL-style unets take the pooled text embedding and size/crop ids as extra conditions.
        self.text_time = getattr(self.unet_config, "addition_embed_type", None) == "text_time"

    @property
    def unet_config(self) -> Any:
        return self.registry.role(self.trained_role).module.config

    @torch.no_grad()
    def encode_prompts(self, input_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids per text encoder -> ``(hidden, pooled | None)``: SD's last hidden state, or SDXL's penultimate
        states concatenated and the last one's pooled projection."""
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

    def time_ids(self, batch: Mapping[str, Any], batch_size: int) -> torch.Tensor:
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

    def unet_forward(self, unet: Any, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any,
                     dtype: torch.dtype) -> torch.Tensor:
        """``unet(noisy, timesteps, cond.hidden)`` (``cond``: hidden, pooled, time_ids) -> ``[B, C, h, w]``, the
        inputs cast to the unet's dtype (a bf16 engine does not cast them itself)."""
        out = unet(noisy.to(dtype), timesteps.to(self.device), encoder_hidden_states=cond.hidden.to(dtype),
                   return_dict=False, **self.added_cond_kwargs(cond.pooled, cond.time_ids, dtype))
        return out[0]

    def predict(self, role: str, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any,
                batch: Mapping[str, Any]) -> torch.Tensor:
        r = self.registry.role(role)
        return self.unet_forward(r.engine, noisy, timesteps, cond, r.dtype)

    def loss(self, batch: Mapping[str, Any], generator: torch.Generator, timesteps: torch.Tensor | None = None,
             role: str | None = None, weighted: bool = True) -> StepOutput:
        """The training loss of one micro batch; ``generator`` draws posterior sample, noise, offset, perturbation,
        timesteps (unless given); ``role`` predicts; ``weighted``: min-SNR weights when ``snr_gamma > 0``."""
        bsz = batch["pixel_values"].shape[0]
        latents = self.latents(batch["pixel_values"], generator)
        hidden, pooled = self.encode_prompts(_input_ids(batch, len(self.text_encoders)))
        noise = torch.randn(tuple(latents.shape), generator=generator)
        noise = offset_noise(noise, self.noise_offset, generator=generator)
        model_noise = perturb_noise(noise, self.input_perturbation, generator=generator)
        noise, model_noise = noise.to(latents.device), model_noise.to(latents.device)
        if timesteps is None:
            timesteps = torch.randint(0, self.num_train_timesteps, (bsz,), generator=generator)
        timesteps = timesteps.long().to(latents.device)
        noisy = add_noise(latents, model_noise, timesteps, self.alphas_cumprod)
        target = training_target(self.prediction_type, latents, noise, timesteps, self.alphas_cumprod)
        cond = Conditioning(hidden, pooled, self.time_ids(batch, bsz) if self.text_time else None)
        pred = self.predict(role or self.trained_role, noisy, timesteps, cond, batch)
        weights = None
        if weighted and self.snr_gamma > 0:
            weights = min_snr_weights(compute_snr(timesteps, self.alphas_cumprod), self.snr_gamma,
                                      self.prediction_type)
        return StepOutput(loss=diffusion_loss(pred, target, weights), timesteps=timesteps.detach().cpu(),
                          latents_std=float(latents.std()))


@dataclass
class Conditioning:
    """Prompt embeddings ``hidden [B, L, D]``, ``pooled [B, P]`` (or None), SDXL's ``time_ids [B, 6]`` (or None)."""

    hidden: torch.Tensor
    pooled: torch.Tensor | None
    time_ids: torch.Tensor | None = None

    def cat(self, other: Conditioning) -> Conditioning:
        def join(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else torch.cat([a, b])
        return Conditioning(torch.cat([self.hidden, other.hidden]), join(self.pooled, other.pooled),
                            join(self.time_ids, other.time_ids))

    def repeat(self, n: int) -> Conditioning:
        def rep(a: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else a.expand(n, *a.shape[1:])
        return Conditioning(rep(self.hidden), rep(self.pooled), rep(self.time_ids))


def differentiable_forward(registry: EngineRegistry, role: str, *args: Any, **kwargs: Any) -> Any:
    """A frozen role's module called with autograd on (a frozen engine's forward runs under no_grad and would cut
    the graph between a ControlNet and the loss); its parameters get no gradients."""
    r = registry.role(role)
    if r.trainable:
        raise ValueError(f"role '{role}' is trainable: call its engine, which owns its backward.")
    with torch.enable_grad():
        return r.module(*args, **kwargs)


class ControlNetObjective(DiffusionObjective):
    """``train_controlnet.py``: the trainable ``controlnet``'s residuals (times ``conditioning_scale``) go into the
    frozen ``unet_role``, whose prediction gives :class:`DiffusionObjective`'s loss."""

    def __init__(self, registry: EngineRegistry, text_encoders: Sequence[str], scheduler: Any,
                 settings: DDPMSettings | None = None, resolution: int = 512, conditioning_scale: float = 1.0,
                 unet_role: str = "unet") -> None:
        if registry.role(unet_role).trainable:
            raise ValueError(f"role '{unet_role}' is trainable; the ControlNet objective expects a frozen unet.")
        self.unet_role = unet_role
        super().__init__(registry, text_encoders, scheduler, settings, resolution, role="controlnet")
        self.conditioning_scale = float(conditioning_scale)

    @property
    def unet_config(self) -> Any:
        return self.registry.role(self.unet_role).module.config

    def predict(self, role: str, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any,
                batch: Mapping[str, Any]) -> torch.Tensor:
        if "conditioning_pixel_values" not in batch:
            raise KeyError("the ControlNet objective needs batch['conditioning_pixel_values'] [B, 3, H, W] in [0, 1]")
        control = self.registry.role(role)
        image = batch["conditioning_pixel_values"].to(self.device, control.dtype)
        t = timesteps.to(self.device)
        down, mid = control.engine(noisy.to(control.dtype), t, encoder_hidden_states=cond.hidden.to(control.dtype),
                                   controlnet_cond=image, conditioning_scale=self.conditioning_scale,
                                   return_dict=False, **self.added_cond_kwargs(cond.pooled, cond.time_ids,
                                                                               control.dtype))
        dtype = self.registry.role(self.unet_role).dtype
        out = differentiable_forward(
            self.registry, self.unet_role, noisy.to(dtype), t, encoder_hidden_states=cond.hidden.to(dtype),
            down_block_additional_residuals=[d.to(dtype) for d in down], mid_block_additional_residual=mid.to(dtype),
            return_dict=False, **self.added_cond_kwargs(cond.pooled, cond.time_ids, dtype))
        return out[0]


class FlowMatchingObjective(_Objective):
    """The rectified-flow step of diffusers' SD3 / FLUX scripts on a registry holding the transformer (``role``),
    ``vae`` and text encoders; FLUX takes ``guidance_scale`` as its guidance input."""

    def __init__(self, registry: EngineRegistry, family: str, scheduler_config: Mapping[str, Any],
                 settings: DiffusionSettings | None = None, text_encoders: Sequence[str] | None = None,
                 role: str = "transformer") -> None:
        roles = family_roles(family)
        if roles.objective != "flow":
            raise ValueError(f"family={family!r} trains with DDPM noise targets: use DiffusionObjective.")
        super().__init__(registry, roles.text_encoders if text_encoders is None else text_encoders, role)
        if len(self.text_encoders) != len(roles.text_encoders):
            raise ValueError(f"family {family!r} has {len(roles.text_encoders)} text encoders "
                             f"{list(roles.text_encoders)}, got {self.text_encoders}")
        s = settings or DiffusionSettings()
        self.family = family
        self.weighting_scheme = flow.check_scheme(s.flow_option(family, "weighting_scheme"))
        self.logit_mean, self.logit_std, self.mode_scale = float(s.logit_mean), float(s.logit_std), float(s.mode_scale)
        self.precondition = bool(s.flow_option(family, "precondition_outputs"))
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))
        self.timesteps, self.sigmas = flow.flow_match_schedule(
            self.num_train_timesteps, float(scheduler_config.get("shift", 1.0)),
            bool(scheduler_config.get("use_dynamic_shifting", False)))
        config = registry.role(role).module.config
        self.guidance_scale = float(s.guidance_scale) if getattr(config, "guidance_embeds", False) else None

    @torch.no_grad()
    def encode_prompts(self, input_ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids per text encoder -> ``(prompt_embeds [B, L, D], pooled [B, P])`` in float32, as the family's
        pipeline's ``encode_prompt``."""
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

    def transformer_forward(self, transformer: Any, noisy: torch.Tensor, timesteps: torch.Tensor,
                            prompt_embeds: torch.Tensor, pooled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The velocity prediction ``[B, C, h, w]`` for noisy latents and timesteps ``[B]`` (0..1000 table values),
        inputs in the transformer's dtype."""
        t = timesteps.to(self.device, torch.float32)
        kwargs = {"encoder_hidden_states": prompt_embeds.to(dtype), "pooled_projections": pooled.to(dtype),
                  "return_dict": False}
        if self.family == "sd3":
            return transformer(hidden_states=noisy.to(dtype), timestep=t, **kwargs)[0]
        b, _, h, w = noisy.shape
        guidance = None if self.guidance_scale is None else flow.flux_guidance(self.guidance_scale, b).to(self.device)
        # FLUX's transformer scales timestep (and guidance) by 1000 itself: the pipeline passes t / 1000.
        out = transformer(hidden_states=flow.pack_latents(noisy.to(dtype)), timestep=t / 1000, guidance=guidance,
                          txt_ids=flow.flux_text_ids(prompt_embeds.shape[1]).to(self.device),
                          img_ids=flow.flux_image_ids(h, w).to(self.device), **kwargs)[0]
        return flow.unpack_latents(out, h, w)

    def loss(self, batch: Mapping[str, Any], generator: torch.Generator, indices: torch.Tensor | None = None,
             role: str | None = None, weighted: bool = True) -> StepOutput:
        """The flow-matching loss of one micro batch; ``generator`` draws posterior sample, noise, density sample
        (unless ``indices``); ``weighted``: the scheme's loss weighting."""
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
def heldout_loss(objective: Any, batches: Sequence[Mapping[str, Any]], points: Sequence[int], seed: int,
                 role: str | None = None) -> float:
    """Mean unweighted loss of ``role`` over this rank's held-out ``batches`` x ``points``, noise fixed by ``seed``,
    averaged over the ranks (collective)."""
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
                out = objective.loss(batch, g, torch.full((n,), int(p), dtype=torch.long), role=name, weighted=False)
                total += torch.tensor([out.loss.item() * n, n], dtype=torch.float64)
    finally:
        module.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def family_objective(registry: EngineRegistry, model_path: str, family: str, text_encoders: Sequence[str],
                     settings: DDPMSettings, resolution: int, conditioning_scale: float | None = None
                     ) -> tuple[Any, str | None]:
    """The family's objective: FlowMatchingObjective (SD3, FLUX), else DDPM (a ControlNetObjective when
    ``conditioning_scale`` is given)."""
    if family_roles(family).objective == "flow":
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        return FlowMatchingObjective(registry, family, config, settings, text_encoders), None
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler.from_pretrained(model_path, subfolder="scheduler")
    if conditioning_scale is None:
        objective = DiffusionObjective(registry, text_encoders, scheduler, settings, resolution)
    else:
        objective = ControlNetObjective(registry, text_encoders, scheduler, settings, resolution, conditioning_scale)
    return objective, objective.prediction_type

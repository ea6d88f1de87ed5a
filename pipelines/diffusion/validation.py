"""Validation images from a pipeline built on the registry's engines, on all ranks in lockstep.

The pipeline holds the engines' own modules (no copy): under ZeRO-3 every layer gathers its weights
collectively as it runs, so every rank runs the same pipeline call with the same prompts and seed
(a forward on rank 0 alone would wait forever for the others). Rank 0 writes the grid."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.settings import Each, FieldError, Length, Range, Settings, setting
from PIL import Image

from .models import call_engine, read_model_index

logger = logging.getLogger(__name__)

__all__ = ["EMAValidation", "ValidationSettings", "build_pipeline", "generate", "image_grid"]


_PROMPTS = 4


@dataclass(frozen=True)
class ValidationSettings(Settings):
    """Images generated before, after and every N steps (the same on every rank)."""

    enabled: bool = setting(True, "validation grids before and after training (and every `every` steps when > 0)")
    every: int = setting(100, "also every N steps (0 = only before and after)", Range(0), when="enabled")
    prompts: list[str] = setting([], "[] = validation.num_prompts shapes prompts (built-in data) or captions of your "
                                     "held-out rows", Each(Length(1)), when="enabled")
    num_prompts: int = setting(_PROMPTS, "how many prompts when validation.prompts is []", Range(1), when="enabled")
    num_inference_steps: int = setting(20, "sampler steps", Range(1), when="enabled")
    guidance_scale: float | None = setting(None, "null = the pipeline's default (SD/SDXL 7.5, SD3 7.0, FLUX 3.5)",
                                           when="enabled", example=2.0)
    seed: int = setting(0, "the sampler's seed (the same images on every rank)", Range(0), when="enabled")

    def check(self) -> None:
        if self.prompts and self.num_prompts != _PROMPTS:
            raise FieldError("num_prompts", self.num_prompts, "applies only while validation.prompts is []",
                             "drop validation.num_prompts")


@dataclass(frozen=True)
class EMAValidation(ValidationSettings):
    use_ema: bool = setting(True, "generate with the EMA weights when EMA is on (as diffusers' examples)",
                            when="enabled")

# Pipeline components that fine-tuning never needs: passed as None so from_pretrained skips them.
_OPTIONAL = ("safety_checker", "feature_extractor", "image_encoder")


def build_pipeline(
    registry: EngineRegistry,
    model_path: str,
    text_encoders: Sequence[str],
    unet_role: str = "unet",
    prediction_type: str | None = None,
    *,
    denoiser: str = "unet",
    components: Mapping[str, str] | None = None,
    class_name: str | None = None,
) -> Any:
    """The folder's pipeline class (or ``class_name``) on the registry's denoiser (from role ``unet_role``), vae,
    text encoders and ``components``; tokenizers and scheduler from ``model_path``; no weights copied."""
    import diffusers

    index = read_model_index(model_path)
    cls = getattr(diffusers, class_name or index["_class_name"])
    parts: dict[str, Any] = {denoiser: registry.role(unet_role).module, "vae": registry.role("vae").module}
    parts.update({name: registry.role(name).module for name in text_encoders})
    parts.update({name: registry.role(role).module for name, role in (components or {}).items()})
    parts.update({name: None for name in _OPTIONAL if name in index})
    pipe = cls.from_pretrained(model_path, **parts)
    if prediction_type and pipe.scheduler.config.get("prediction_type") != prediction_type:
        pipe.scheduler.register_to_config(prediction_type=prediction_type)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floating(v, dtype) for v in obj)
    return obj


@contextlib.contextmanager
def _unet_inputs_in_own_dtype(unet: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Cast the unet's floating inputs (never the timestep) to its own dtype: pipelines cast them to the text
    encoder's, wrong for an fp32 EMA beside a bf16 text encoder."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = (_cast_floating(args[0], dtype), *args[1:]) if args else args
        kwargs = {k: v if k == "timestep" else _cast_floating(v, dtype) for k, v in kwargs.items()}
        return args, kwargs

    handle = unet.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def generate(
    pipe: Any,
    registry: EngineRegistry,
    prompts: Sequence[str],
    resolution: int,
    num_inference_steps: int = 25,
    guidance_scale: float | None = 7.5,
    seed: int = 0,
    **pipeline_kwargs: Any,
) -> list[Image.Image]:
    """One image per prompt, the same on every rank (all ranks call it); ``pipeline_kwargs`` go to the pipeline and
    its latents are decoded through the vae engine like in training."""
    vae = registry.role("vae")
    generator = torch.Generator().manual_seed(seed)  # CPU: the same draws on any device
    # The pipeline calls the text encoders' modules directly, and their embedding layers read weight
    # shapes before any ZeRO-3 fetch hook has run: gather them (frozen) for the call.
    encoders = [r.name for r in registry.roles() if r.name.startswith("text_encoder")]
    gather = registry.gathered(*encoders) if encoders else contextlib.nullcontext()
    denoiser = getattr(pipe, "unet", None) or pipe.transformer
    kwargs = dict(pipeline_kwargs)
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    with gather, _unet_inputs_in_own_dtype(denoiser, denoiser.dtype):
        latents = pipe(
            list(prompts),
            height=resolution,
            width=resolution,
            num_inference_steps=num_inference_steps,
            generator=generator,
            output_type="latent",
            **kwargs,
        ).images  # [N, C, h, w] scaled latents (FLUX: [N, tokens, 4C])
    if latents.ndim == 3 and hasattr(pipe, "_unpack_latents"):
        latents = pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)
    config = vae.module.config
    shift = float(getattr(config, "shift_factor", None) or 0.0)
    latents = latents.float() / float(config.scaling_factor) + shift
    images = call_engine(vae.engine, "decode", latents.to(vae.dtype), return_dict=False)[0]  # [N, 3, H, W]
    return pipe.image_processor.postprocess(images.float().cpu(), output_type="pil")


def _wrap(draw: Any, text: str, font: Any, width: int) -> list[str]:
    """Greedy word wrap of ``text`` to lines at most ``width`` pixels wide (a word wider than that stays whole)."""
    lines: list[str] = []
    for word in text.split():
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and draw.textlength(candidate, font=font) <= width:
            lines[-1] = candidate
        else:
            lines.append(word)
    return lines or [""]


def image_grid(
    images: Sequence[Image.Image],
    cols: int | None = None,
    prompts: Sequence[str] | None = None,
    step: int | None = None,
    min_size: int = 256,
) -> Image.Image:
    """Paste equally sized images into a grid row by row, each upscaled (nearest) to at least ``min_size`` pixels,
    with its prompt and step in a white strip under it when given."""
    from PIL import ImageDraw, ImageFont

    if not images:
        raise ValueError("no images to put in a grid")
    if prompts is not None and len(prompts) != len(images):
        raise ValueError(f"{len(prompts)} prompts for {len(images)} images")
    cols = cols or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    scale = max(1, math.ceil(min_size / min(w, h)))
    w, h = w * scale, h * scale
    labels = []
    if prompts is not None or step is not None:
        labels = [" ".join(x for x in ((prompts[i] if prompts is not None else ""),
                                        (f"(step {step})" if step is not None else "")) if x)
                  for i in range(len(images))]
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    wrapped = [_wrap(measure, label, font, w - 8) for label in labels]
    top, bottom = measure.textbbox((0, 0), "Ag", font=font)[1::2]
    line_height = bottom - top + 4
    strip = (max(len(x) for x in wrapped) * line_height + 8) if wrapped else 0
    grid = Image.new("RGB", (cols * w, rows * (h + strip)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for i, image in enumerate(images):
        x, y = (i % cols) * w, (i // cols) * (h + strip)
        grid.paste(image.convert("RGB").resize((w, h), Image.NEAREST), (x, y))
        if strip:
            draw.line([(x, y + h), (x + w - 1, y + h)], fill=(200, 200, 200))  # where the label strip starts
        for j, line in enumerate(wrapped[i] if wrapped else []):
            draw.text((x + 4, y + h + 4 + j * line_height), line, fill=(0, 0, 0), font=font)
    return grid

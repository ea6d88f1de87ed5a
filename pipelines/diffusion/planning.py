"""The memory planner's view of a diffusers pipeline: which family its components make, the tiny models and the
ControlNet a recipe would build (read without keeping weights), and the activation peaks of its denoiser, vae
and text encoders. Flat arguments; the recipes' planners read their configs and call these."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from multiengine.engines import planner as P
from multiengine.engines.settings import SettingsError

__all__ = ["denoiser_activation_bytes", "denoiser_name", "encoder_names", "is_t5", "meta_controlnet", "pipeline_family",
           "text_tokens", "tiny_pipeline", "tiny_pipeline_info", "vae_activation_bytes", "vae_scale"]


def denoiser_name(components: Mapping[str, P.ModelInfo], title: str, source: str, *, controlnet: bool = False) -> str:
    """The pipeline's denoiser component, "unet" or "transformer" (``controlnet``: the unet a ControlNet feeds),
    refused naming ``source``'s components when it or the vae is missing."""
    name = "unet" if "unet" in components or controlnet else "transformer"
    if name not in components or "vae" not in components:
        what = "a ControlNet for a unet" if controlnet else "a unet or a transformer beside a vae"
        raise SettingsError(f"{title} trains {what}; {source} has components {sorted(components)}.")
    return name


def tiny_pipeline(output_dir: str, seed: int, resolution: int, family: str) -> tuple[dict[str, P.ModelInfo], str]:
    """The tiny ``family`` model a run writes under ``output_dir`` when it is there, else one built as it would."""
    folder = os.path.join(output_dir, f"tiny_{family}")
    if os.path.isfile(os.path.join(folder, "model_index.json")):
        return P.pipeline_info(folder), folder
    return tiny_pipeline_info(seed, resolution, family)


@functools.cache
def tiny_pipeline_info(seed: int, resolution: int, family: str) -> tuple[dict[str, P.ModelInfo], str]:
    """The recipes' tiny model of ``family`` (a few M parameters), built in a temporary folder to read its headers."""
    from multiengine.pipelines.diffusion.runs import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="multiengine_plan_") as tmp:
        folder = build_tiny_model(os.path.join(tmp, f"tiny_{family}"), seed, resolution, family)
        parts = P.pipeline_info(folder)
    return parts, f"the recipe's tiny {family} (built as the run would)"


def pipeline_family(components: Mapping[str, P.ModelInfo]) -> str:
    """sd | sdxl | sd3 | flux from the components alone (a hub name planned with --assume has no index)."""
    if "transformer" in components:
        return "flux" if "axes_dims_rope" in components["transformer"].config else "sd3"
    return "sdxl" if "text_encoder_2" in components else "sd"


def encoder_names(components: Mapping[str, P.ModelInfo]) -> list[str]:
    return sorted((n for n in components if n.startswith("text_encoder")), key=lambda n: (len(n), n))


def is_t5(info: P.ModelInfo) -> bool:
    return info.class_name.startswith("T5") or "d_model" in info.config


def text_tokens(components: Mapping[str, P.ModelInfo], max_sequence_length: int = 0) -> tuple[dict[str, int], int]:
    """Tokens per caption of each text encoder as the recipes pad them, and the text tokens the denoiser attends to
    (SD/SDXL: the longest CLIP's; SD3: with T5's; FLUX: T5's only)."""
    from .runs import t5_length

    family = pipeline_family(components)
    t5 = t5_length(family, max_sequence_length)
    tokens = {n: t5 if is_t5(components[n]) else int(components[n].config.get("max_position_embeddings", 77))
              for n in encoder_names(components)}
    clip = max((tokens[n] for n in tokens if not is_t5(components[n])), default=77)
    return tokens, t5 if family == "flux" else clip + t5


def vae_scale(vae: P.ModelInfo) -> int:
    """The vae's downsampling factor (8 for SD's, one 2x per level below the top)."""
    return 2 ** (len(vae.config.get("block_out_channels", (1, 1, 1, 1))) - 1)


def vae_activation_bytes(vae: P.ModelInfo, *, batch: int, resolution: int, dtype: str) -> int:
    """Activation peak of one frozen vae encode or decode of ``batch`` images."""
    channels = int(vae.config.get("block_out_channels", (128,))[0])
    return P.conv_frozen_activation_bytes(batch=batch, height=resolution, width=resolution, channels=channels,
                                          dtype=dtype)


def denoiser_activation_bytes(info: P.ModelInfo, name: str, *, res: int, scale: int, batch: int, dtype: str,
                              trainable: bool, checkpointing: bool, text_tokens: int) -> int:
    """Activation peak of one denoiser forward (+ backward when trainable) on ``batch`` latents; ``name``: unet
    or transformer."""
    if name == "unet":
        return P.unet_activation_bytes(info.config, batch=batch, latent_height=res // scale, latent_width=res // scale,
                                       dtype=dtype, trainable=trainable, gradient_checkpointing=checkpointing,
                                       text_tokens=text_tokens)
    seq = P.dit_tokens(info.config, height=res, width=res, text_tokens=text_tokens, vae_scale=scale)
    return P.transformer_activation_bytes(P.dit_dims(info.config), batch=batch, seq=seq, dtype=dtype,
                                          trainable=trainable, gradient_checkpointing=checkpointing, logits=False)


def meta_controlnet(unet: P.ModelInfo, scale: int) -> P.ModelInfo:
    """The ControlNetModel a recipe initialises from ``unet``, built on the meta device (no weights)."""
    tensors, config = _meta_controlnet_tensors(json.dumps(dict(unet.config), sort_keys=True), scale)
    return P.ModelInfo(source=f"a ControlNet from the unet of {unet.source}", tensors=tensors, config=config,
                       class_name="ControlNetModel")


@functools.cache
def _meta_controlnet_tensors(unet_config: str, scale: int) -> tuple[tuple[P.TensorEntry, ...], dict[str, Any]]:
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from .controlnet import conditioning_embedding_channels

    with torch.device("meta"):
        base = UNet2DConditionModel.from_config(json.loads(unet_config))
        model = ControlNetModel.from_unet(base, load_weights_from_unet=False,
                                          conditioning_embedding_out_channels=conditioning_embedding_channels(scale))
    tensors = tuple(P.TensorEntry(n, tuple(p.shape), "F32") for n, p in model.named_parameters())
    return tensors, dict(model.config)

"""A ControlNet initialised from a unet, as diffusers' ``train_controlnet.py`` does (``ControlNetModel.from_unet``).

The conditioning image enters through a small conv stack that must downsample it to the latent size: one
stride-2 stage per vae downsampling (SD's vae: 8x, three stages, channels 16/32/96/256; the tiny vae:
2x, one stage)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines.settings import Choice, Settings, setting

from .models import ModelSettings

__all__ = ["CONTROLNET_PIPELINES", "ControlNetModelSettings", "ControlNetSettings", "conditioning_embedding_channels",
           "controlnet_factory", "controlnet_from_unet", "load_full_copy"]

# The ControlNet pipeline of each base family (diffusers' ControlNetModel conditions a unet: SD 1.x/2.x and SDXL).
CONTROLNET_PIPELINES = {"sd": "StableDiffusionControlNetPipeline", "sdxl": "StableDiffusionXLControlNetPipeline"}


@dataclass(frozen=True)
class ControlNetModelSettings(ModelSettings):
    """The base SD or SDXL pipeline folder (a ControlNet conditions a unet)."""

    tiny_family: str = setting("sd", "tiny model only: sd | sdxl", Choice(*CONTROLNET_PIPELINES), when="pretrained=")


@dataclass(frozen=True)
class ControlNetSettings(Settings):
    conditioning_scale: float = setting(1.0, "multiplies the controlnet's residuals (1 in diffusers' training)")


# diffusers' default conditioning-embedding widths, for an 8x vae.
_CHANNELS: tuple[int, ...] = (16, 32, 96, 256)


def conditioning_embedding_channels(vae_scale_factor: int) -> tuple[int, ...]:
    """Widths of the conditioning embedding for a vae that downsamples ``vae_scale_factor`` times:
    ``(16, 32, 96, 256)`` for 8 (diffusers' default), ``(16, 32)`` for 2."""
    stages = int(round(math.log2(vae_scale_factor))) if vae_scale_factor >= 1 else -1
    if stages < 0 or 2**stages != vae_scale_factor or stages + 1 > len(_CHANNELS):
        raise ValueError(f"vae_scale_factor={vae_scale_factor}: use a power of two up to {2 ** (len(_CHANNELS) - 1)}.")
    return _CHANNELS[: stages + 1]


def controlnet_from_unet(unet: torch.nn.Module, vae_scale_factor: int = 8, seed: int = 0,
                         conditioning_channels: int = 3) -> torch.nn.Module:
    """``ControlNetModel.from_unet(unet)`` (encoder weights copied, zero-initialised outputs: it changes nothing
    yet), its random parts seeded by ``seed`` on every rank; the global RNG is left untouched."""
    from diffusers import ControlNetModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ControlNetModel.from_unet(
            unet, conditioning_embedding_out_channels=conditioning_embedding_channels(vae_scale_factor),
            conditioning_channels=conditioning_channels)


def load_full_copy(cls: Any, model_path: str, subfolder: str, variant: str | None = None) -> torch.nn.Module:
    """``cls`` with the safetensors weights of ``model_path/subfolder`` as full tensors even inside a stage-3 build
    (``from_config`` + state dict; ``from_pretrained`` would load partitioned)."""
    from multiengine.engines import zero_init_paused
    from safetensors.torch import load_file

    folder = os.path.join(model_path, subfolder)
    name = "diffusion_pytorch_model" + (f".{variant}" if variant else "")
    single, index = os.path.join(folder, name + ".safetensors"), os.path.join(folder, name + ".safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = [os.path.join(folder, x) for x in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{folder!r} has no {name}.safetensors (or its .index.json); the ControlNet is "
                                "initialised from safetensors weights only.")
    with zero_init_paused():
        model = cls.from_config(cls.load_config(model_path, subfolder=subfolder))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    model.load_state_dict(state, strict=True)
    return model


def controlnet_factory(model_path: str, seed: int = 0, variant: str | None = None,
                       controlnet_path: str | None = None) -> Callable[[], Any]:
    """A role's model factory: a ControlNet from the folder's unet (read whole on the host, then dropped) or the one
    saved at ``controlnet_path``; partitioned when its engine is built."""

    def build() -> torch.nn.Module:
        from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel
        from multiengine.engines import zero_init_paused

        if controlnet_path:
            return ControlNetModel.from_pretrained(controlnet_path, **({"variant": variant} if variant else {}))
        unet = load_full_copy(UNet2DConditionModel, model_path, "unet", variant)
        factor = 2 ** (len(AutoencoderKL.load_config(model_path, subfolder="vae")["block_out_channels"]) - 1)
        with zero_init_paused():
            return controlnet_from_unet(unet, factor, seed)

    return build

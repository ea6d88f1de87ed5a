"""Model families and their roles, read from a diffusers folder's ``model_index.json``.

=======  =============================  ============  ==========================================  ==========
family   pipeline (``_class_name``)     denoiser      text encoders (role = folder)               objective
=======  =============================  ============  ==========================================  ==========
sd       StableDiffusionPipeline        unet          text_encoder (CLIP)                         ddpm
sdxl     StableDiffusionXLPipeline      unet          text_encoder (CLIP-L), text_encoder_2 (G)    ddpm
sd3      StableDiffusion3Pipeline       transformer   text_encoder, text_encoder_2 (CLIP-L/G),    flow
                                                      text_encoder_3 (T5)
flux     FluxPipeline                   transformer   text_encoder (CLIP-L), text_encoder_2 (T5)   flow
=======  =============================  ============  ==========================================  ==========

Each text encoder's tokenizer is the folder with ``text_encoder`` replaced by ``tokenizer``. ControlNet
pipelines (``StableDiffusionControlNetPipeline`` ...) belong to their base family and add a ``controlnet``.
Pure functions: json only, no model is loaded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

FAMILIES: tuple[str, ...] = ("sd", "sdxl", "sd3", "flux")

__all__ = ["FAMILIES", "PIPELINE_CLASSES", "FamilyRoles", "family_of_pipeline", "family_roles", "model_family"]

# Pipeline class -> family. Img2img/inpaint variants save the same components as their text-to-image class.
PIPELINE_CLASSES: dict[str, str] = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionImg2ImgPipeline": "sd",
    "StableDiffusionInpaintPipeline": "sd",
    "StableDiffusionControlNetPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusionXLImg2ImgPipeline": "sdxl",
    "StableDiffusionXLInpaintPipeline": "sdxl",
    "StableDiffusionXLControlNetPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
    "StableDiffusion3Img2ImgPipeline": "sd3",
    "StableDiffusion3ControlNetPipeline": "sd3",
    "FluxPipeline": "flux",
    "FluxImg2ImgPipeline": "flux",
    "FluxControlNetPipeline": "flux",
}


@dataclass(frozen=True)
class FamilyRoles:
    """A family's role names: ``pooled_from`` (encoders whose pooled output conditions the denoiser),
    ``objective`` (``ddpm`` | ``flow``), ``pipeline`` (the diffusers class), ``lora_targets`` (diffusers' defaults)."""

    family: str
    pipeline: str
    denoiser: str
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    pooled_from: tuple[str, ...]
    objective: str
    lora_targets: tuple[str, ...] = ()

    @property
    def frozen(self) -> tuple[str, ...]:
        """The roles a denoiser fine-tune keeps frozen: the vae and every text encoder."""
        return ("vae", *self.text_encoders)


# train_text_to_image_lora(_sdxl).py, train_dreambooth_lora_sd3.py, train_dreambooth_lora_flux.py defaults.
_UNET_LORA = ("to_k", "to_q", "to_v", "to_out.0")
_JOINT_ATTENTION_LORA = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                         "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")
_FLUX_LORA = _JOINT_ATTENTION_LORA + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")

_ROLES: dict[str, FamilyRoles] = {
    "sd": FamilyRoles("sd", "StableDiffusionPipeline", "unet", ("text_encoder",), ("tokenizer",), (), "ddpm",
                      _UNET_LORA),
    "sdxl": FamilyRoles("sdxl", "StableDiffusionXLPipeline", "unet", ("text_encoder", "text_encoder_2"),
                        ("tokenizer", "tokenizer_2"), ("text_encoder_2",), "ddpm", _UNET_LORA),
    "sd3": FamilyRoles("sd3", "StableDiffusion3Pipeline", "transformer",
                       ("text_encoder", "text_encoder_2", "text_encoder_3"),
                       ("tokenizer", "tokenizer_2", "tokenizer_3"), ("text_encoder", "text_encoder_2"), "flow",
                       _JOINT_ATTENTION_LORA),
    "flux": FamilyRoles("flux", "FluxPipeline", "transformer", ("text_encoder", "text_encoder_2"),
                        ("tokenizer", "tokenizer_2"), ("text_encoder",), "flow", _FLUX_LORA),
}


def family_roles(family: str) -> FamilyRoles:
    """The roles of ``family`` (one of :data:`FAMILIES`)."""
    if family not in _ROLES:
        raise ValueError(f"family={family!r}; use one of {list(FAMILIES)}.")
    return _ROLES[family]


def family_of_pipeline(class_name: str) -> str:
    """``"StableDiffusion3Pipeline"`` -> ``"sd3"``; a clear error for a pipeline we do not train."""
    if class_name not in PIPELINE_CLASSES:
        raise ValueError(
            f"model_index.json _class_name={class_name!r} is not a supported family; supported pipelines: "
            + ", ".join(sorted(PIPELINE_CLASSES)))
    return PIPELINE_CLASSES[class_name]


def _read_index(path: str) -> dict[str, Any]:
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{path!r} is not a diffusers folder: it has no model_index.json.")
    with open(index, encoding="utf-8") as f:
        return json.load(f)


def model_family(path: str) -> str:
    """``"sd" | "sdxl" | "sd3" | "flux"`` from a folder's model_index.json; an error names missing components."""
    index = _read_index(path)
    family = family_of_pipeline(str(index.get("_class_name", "")))
    roles = family_roles(family)
    present = {k for k, v in index.items() if isinstance(v, list) and v and v[0]}
    missing = [c for c in (roles.denoiser, "vae", *roles.text_encoders) if c not in present]
    if missing:
        raise ValueError(f"{path!r}: a {index['_class_name']} folder without {missing} in model_index.json; "
                         "training needs every component (text encoders given as null are not supported).")
    return family

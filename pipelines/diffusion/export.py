"""Exports that load with no project code: a diffusers pipeline folder, per-role folders, LoRA weights.

Every rank gathers (never rank 0 alone: under ZeRO-3 that hangs), rank 0 writes: the tensors written
are full, never the empty shards of a partitioned model. Folders are written under a temporary name
and renamed into place, so a crash never leaves a half-written export that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Sequence

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.dist import barrier

from .models import read_model_index

logger = logging.getLogger(__name__)

__all__ = ["export_pipeline", "export_roles", "save_lora", "save_role_pretrained"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _cast_folder(folder: str, dtype: torch.dtype) -> None:
    """Rewrite every safetensors file of a saved model with floating tensors in ``dtype`` (and the
    dtype recorded in config.json): every component of an export then loads in one dtype."""
    from safetensors.torch import load_file, save_file

    name = str(dtype).replace("torch.", "")
    for entry in os.listdir(folder):
        path = os.path.join(folder, entry)
        if entry.endswith(".safetensors"):
            tensors = load_file(path)
            if any(t.is_floating_point() and t.dtype != dtype for t in tensors.values()):
                tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
                save_file(tensors, path, metadata={"format": "pt"})
        elif entry == "config.json":
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            changed = False
            for key in ("torch_dtype", "dtype"):
                if key in config:
                    config[key], changed = name, True
            if changed:
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(config, f, indent=2, sort_keys=True)


def save_role_pretrained(registry: EngineRegistry, role: str, out_dir: str, dtype: str | None = "fp32") -> str:
    """Gather ``role`` on all ranks and ``save_pretrained`` it on rank 0 (safetensors), cast to ``dtype``
    (``None`` keeps the engine's dtype). All ranks must call it."""
    module = registry.role(role).module
    with registry.gathered(role):
        if registry.is_main:
            if os.path.isdir(out_dir):
                shutil.rmtree(out_dir)
            module.save_pretrained(out_dir, safe_serialization=True)
    if registry.is_main and dtype is not None:
        _cast_folder(out_dir, _DTYPES[dtype])
    barrier()
    return out_dir


def export_pipeline(
    registry: EngineRegistry,
    model_path: str,
    out_dir: str,
    text_encoders: Sequence[str],
    unet_role: str = "unet",
    dtype: str = "fp32",
    prediction_type: str | None = None,
) -> str:
    """A complete diffusers folder: ``unet`` from ``unet_role`` (``ema`` for the EMA weights), ``vae`` and
    the text encoders gathered from their engines; tokenizers, scheduler and any other component copied
    from ``model_path`` with its ``model_index.json``. ``prediction_type`` (when training changed it) is
    written into the scheduler config. ``<PipelineClass>.from_pretrained(out_dir)`` loads it.
    All ranks must call it."""
    index = read_model_index(model_path)
    roles = {"unet": unet_role, "vae": "vae", **{name: name for name in text_encoders}}
    tmp = out_dir.rstrip("/") + ".tmp"
    if registry.is_main:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    barrier()
    for component, role in roles.items():
        save_role_pretrained(registry, role, os.path.join(tmp, component), dtype)
    if registry.is_main:
        for component, spec in index.items():
            src = os.path.join(model_path, component)
            if component in roles or not isinstance(spec, list) or not os.path.isdir(src):
                continue
            shutil.copytree(src, os.path.join(tmp, component))
        shutil.copy(os.path.join(model_path, "model_index.json"), os.path.join(tmp, "model_index.json"))
        scheduler_config = os.path.join(tmp, "scheduler", "scheduler_config.json")
        if prediction_type and os.path.isfile(scheduler_config):
            with open(scheduler_config, encoding="utf-8") as f:
                config = json.load(f)
            config["prediction_type"] = prediction_type
            with open(scheduler_config, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2, sort_keys=True)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        logger.info("exported pipeline (unet from '%s') to %s", unet_role, out_dir)
    barrier()
    return out_dir


def export_roles(registry: EngineRegistry, out_dir: str, roles: Sequence[str], dtype: str = "fp32") -> dict[str, str]:
    """``out_dir/<role>/`` for each role (``save_pretrained`` layout). All ranks must call it."""
    return {role: save_role_pretrained(registry, role, os.path.join(out_dir, role), dtype) for role in roles}


def save_lora(registry: EngineRegistry, out_dir: str, role: str = "unet") -> str:
    """The unet's LoRA adapter as ``out_dir/pytorch_lora_weights.safetensors``, in the layout
    ``StableDiffusionPipeline.load_lora_weights`` reads (as diffusers' LoRA example writes it:
    ``convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))``). Only the adapter weights are
    gathered. All ranks must call it."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    module = registry.role(role).module
    adapter = [p for n, p in module.named_parameters() if "lora_" in n]
    if not adapter:
        raise ValueError(f"role '{role}' has no LoRA parameters to save.")
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_tensor") for p in adapter):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(adapter)
    with gather:
        if registry.is_main:
            state = {k: v.detach().to("cpu", torch.float32).clone()
                     for k, v in get_peft_model_state_dict(module).items()}
            os.makedirs(out_dir, exist_ok=True)
            StableDiffusionPipeline.save_lora_weights(
                out_dir, unet_lora_layers=convert_state_dict_to_diffusers(state), safe_serialization=True)
            logger.info("saved LoRA adapter (%d tensors) to %s", len(state), out_dir)
    barrier()
    return out_dir

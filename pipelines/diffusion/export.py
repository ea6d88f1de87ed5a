"""Exports that load with no project code (a diffusers pipeline folder, per-role folders, LoRA weights), each
written through the engines' atomic export."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, atomic_dir, save_role, write_role
from multiengine.engines.export import cast_folder
from multiengine.engines.settings import DTYPES, Choice, Each, Length, Settings, setting

from .models import read_model_index

logger = logging.getLogger(__name__)

__all__ = ["ExportSettings", "RoleExportSettings", "export_pipeline", "export_roles", "export_run", "save_lora"]


def export_pipeline(
    registry: EngineRegistry,
    model_path: str,
    out_dir: str,
    components: dict[str, str],
    dtype: str = "fp32",
    prediction_type: str | None = None,
    class_name: str | None = None,
    cast_copied: bool = False,
) -> str:
    """A complete diffusers folder: each ``component -> role`` gathered from its engine, the rest copied from
    ``model_path``; ``prediction_type`` into the scheduler config, a new component (``controlnet``) added to
    ``model_index.json`` with ``class_name``; ``cast_copied`` casts copied models to ``dtype``. All ranks call it."""
    index = read_model_index(model_path)
    with atomic_dir(out_dir, registry.is_main) as tmp:
        for component, role in components.items():
            write_role(registry, role, os.path.join(tmp, component), dtype=dtype, merge_lora=True)
        if registry.is_main:
            for component, spec in index.items():
                src = os.path.join(model_path, component)
                if component in components or not isinstance(spec, list) or not os.path.isdir(src):
                    continue
                shutil.copytree(src, os.path.join(tmp, component))
                if cast_copied and dtype and any(f.endswith(".safetensors") for f in os.listdir(src)):
                    cast_folder(os.path.join(tmp, component), dtype)
            written = dict(index)
            for component, role in components.items():
                if component not in written:
                    cls = type(_unwrapped(registry.role(role).module))
                    written[component] = [cls.__module__.split(".")[0], cls.__name__]
            if class_name:
                written["_class_name"] = class_name
            with open(os.path.join(tmp, "model_index.json"), "w", encoding="utf-8") as f:
                json.dump(written, f, indent=2)
            scheduler_config = os.path.join(tmp, "scheduler", "scheduler_config.json")
            if prediction_type and os.path.isfile(scheduler_config):
                with open(scheduler_config, encoding="utf-8") as f:
                    config = json.load(f)
                config["prediction_type"] = prediction_type
                with open(scheduler_config, "w", encoding="utf-8") as f:
                    json.dump(config, f, indent=2, sort_keys=True)
    if registry.is_main:
        logger.info("exported pipeline (%s) to %s", ", ".join(f"{c}<-{r}" for c, r in components.items()), out_dir)
    return out_dir


def export_roles(registry: EngineRegistry, out_dir: str, roles: Sequence[str], dtype: str = "fp32") -> dict[str, str]:
    """``out_dir/<role>/`` for each role (``save_pretrained`` layout). All ranks must call it."""
    return {role: save_role(registry, role, os.path.join(out_dir, role), dtype=dtype)["model"] for role in roles}


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def save_lora(registry: EngineRegistry, out_dir: str, role: str = "unet", component: str = "unet",
              pipeline_class: str = "StableDiffusionPipeline") -> str:
    """The denoiser's LoRA adapter as ``out_dir/pytorch_lora_weights.safetensors`` as diffusers' LoRA scripts
    write it (unet: diffusers names, ``unet_lora_layers``; transformer: peft names). All ranks must call it."""
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    if component not in ("unet", "transformer"):
        raise ValueError(f"component={component!r}: LoRA is saved for a unet or a transformer.")
    module = registry.role(role).module
    adapter = [p for n, p in module.named_parameters() if "lora_" in n]
    if not adapter:
        raise ValueError(f"role '{role}' has no LoRA parameters to save.")
    gather = contextlib.nullcontext()
    if any(hasattr(p, "ds_tensor") for p in adapter):
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(adapter)
    with atomic_dir(out_dir, registry.is_main) as tmp, gather:
        if registry.is_main:
            state = {k: v.detach().to("cpu", torch.float32).clone()
                     for k, v in get_peft_model_state_dict(module).items()}
            cls = getattr(diffusers, pipeline_class)
            if component == "unet":
                cls.save_lora_weights(tmp, unet_lora_layers=convert_state_dict_to_diffusers(state),
                                      safe_serialization=True)
            else:
                cls.save_lora_weights(tmp, transformer_lora_layers=state, safe_serialization=True)
            logger.info("saved LoRA adapter of %s (%d tensors) to %s", role, len(state), out_dir)
    return out_dir


@dataclass(frozen=True)
class ExportSettings(Settings):
    enabled: bool = setting(True, "export/<pipeline> (a diffusers pipeline folder) and export/lora for LoRA runs")
    dtype: str = setting("fp32", "dtype of every exported component", Choice(*DTYPES), when="enabled")


@dataclass(frozen=True)
class RoleExportSettings(ExportSettings):
    roles: list[str] = setting([], "per-role folders besides the pipeline, e.g. [unet, ema] ([] = none)",
                               Each(Length(1)), when="enabled", items_when={"ema": "ema.enabled"})


def export_run(registry: EngineRegistry, out_dir: str, model_path: str, components: dict[str, str],
               settings: ExportSettings, *, lora: tuple[str, str, str] | None = None, pipeline: str = "pipeline",
               **pipeline_options: Any) -> dict[str, str]:
    """A fine-tune's exports under ``out_dir``: ``<pipeline>/``, ``lora/`` when ``lora`` = (role, component,
    pipeline class), then the per-role folders."""
    written = {pipeline: export_pipeline(registry, model_path, os.path.join(out_dir, pipeline), components,
                                         dtype=settings.dtype, **pipeline_options)}
    if lora:
        written["lora"] = save_lora(registry, os.path.join(out_dir, "lora"), role=lora[0], component=lora[1],
                                    pipeline_class=lora[2])
    roles = getattr(settings, "roles", ())
    written.update(export_roles(registry, out_dir, [r for r in roles if r not in written], dtype=settings.dtype))
    return written

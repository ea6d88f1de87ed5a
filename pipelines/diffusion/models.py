"""The model folder of a diffusion run and its components as engines: the ``model`` and ``ema`` settings, loading
a component of a diffusers folder (its class from ``model_index.json``), calling an engine's module method through
its forward, and the EMA update of the trained denoiser.

Two layouts (``mode``): ``zero3`` places every role as configured; ``seed_baseline`` is diffusers' scripts under
DeepSpeed ZeRO-3: only the trained model goes through ZeRO, the frozen ones (and the EMA) are whole stage-0 copies."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, barrier, ema_decay, ema_update
from multiengine.engines.settings import Choice, FieldError, Range, Settings, setting

from .families import FAMILIES

ZERO3, SEED_BASELINE = "zero3", "seed_baseline"
MODES: tuple[str, ...] = (ZERO3, SEED_BASELINE)
_TEXT_ENCODER = re.compile(r"^text_encoder(_\d+)?$")

__all__ = ["MODES", "SEED_BASELINE", "ZERO3", "EMASettings", "ModelSettings", "call_engine", "component_loader",
           "load_component", "read_model_index", "text_encoder_names", "tokenizer_name", "update_ema"]


@dataclass(frozen=True)
class ModelSettings(Settings):
    pretrained: str = setting("", "the diffusers pipeline folder or hub name (SD, SDXL, SD3, FLUX) every component "
                                  "comes from; \"\" = the tiny model of model.tiny_family, built here")
    revision: str = setting("", "hub revision of a hub name (\"\" = main)", when="pretrained")
    variant: str = setting("", "weight variant passed to from_pretrained (e.g. fp16; \"\" = the default weights)",
                           when="pretrained")
    tiny_family: str = setting("sd", "tiny model only: sd | sdxl | sd3 | flux", Choice(*FAMILIES), when="pretrained=")
    tiny_vae_steps: int = setting(300, "tiny model only: pretrain its random vae on the training images first "
                                       "(0 = no)", Range(0), when="pretrained=")

    def path(self) -> str:
        """The local folder of ``pretrained`` (a hub name downloaded by rank 0 first); all ranks call it."""
        if os.path.isdir(self.pretrained):
            return self.pretrained
        from diffusers import DiffusionPipeline

        kwargs = {"revision": self.revision or None, "variant": self.variant or None}
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            DiffusionPipeline.download(self.pretrained, **kwargs)
        barrier()
        return str(DiffusionPipeline.download(self.pretrained, **kwargs))


@dataclass(frozen=True)
class EMASettings(Settings):
    """diffusers' EMAModel options (:func:`multiengine.engines.ema_decay`)."""

    enabled: bool = setting(True, "keep an EMA role (sharded like the denoiser; exported in the pipeline when on)")
    decay: float = setting(0.99, "the largest decay (diffusers' EMAModel default 0.9999 suits long runs)", Range(0, 1),
                           when="enabled")
    use_ema_warmup: bool = setting(False, "true: 1 - (1 + s/inv_gamma)^-power; false: (1 + s) / (10 + s)",
                                   when="enabled")
    min_decay: float = setting(0.0, "the smallest decay after the first update", Range(0, 1), when="enabled")
    update_after_step: int = setting(0, "copy the weights (decay 0) for this many steps first", Range(0),
                                     when="enabled")
    inv_gamma: float = setting(1.0, "warmup: inverse multiplicative factor", Range(0, min_exclusive=True),
                               when="use_ema_warmup")
    power: float = setting(2 / 3, "warmup: exponent (2/3 for long runs, 3/4 for short ones)",
                           Range(0, min_exclusive=True), when="use_ema_warmup")

    def check(self) -> None:
        if self.min_decay > self.decay:
            raise FieldError("min_decay", self.min_decay, f"is above decay={self.decay}", "use min_decay <= decay")


def read_model_index(model_path: str) -> dict[str, Any]:
    """``model_index.json`` of a diffusers folder (component name -> [library, class])."""
    path = os.path.join(model_path, "model_index.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_path!r} is not a diffusers folder: it has no model_index.json.")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def text_encoder_names(model_path: str) -> list[str]:
    """The text encoders of a diffusers folder, in order (``text_encoder``, ``text_encoder_2``, ...)."""
    index = read_model_index(model_path)
    names = [k for k, v in index.items() if _TEXT_ENCODER.match(k) and isinstance(v, list) and v[0]]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]) if n[-1].isdigit() else 1)


def tokenizer_name(encoder_name: str) -> str:
    """``text_encoder`` -> ``tokenizer``, ``text_encoder_2`` -> ``tokenizer_2``."""
    return encoder_name.replace("text_encoder", "tokenizer", 1)


def load_component(model_path: str, name: str, variant: str | None = None) -> torch.nn.Module:
    """``<class from model_index>.from_pretrained(model_path, subfolder=name)``: partitioned inside a stage-3 role's
    build scope, a full copy anywhere else."""
    index = read_model_index(model_path)
    if not isinstance(index.get(name), list) or not index[name][0]:
        raise KeyError(f"{model_path!r} has no component '{name}' in model_index.json.")
    library, class_name = index[name]
    cls = getattr(__import__(library, fromlist=[class_name]), class_name)
    return cls.from_pretrained(model_path, subfolder=name, **({"variant": variant} if variant else {}))


def call_engine(engine: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``engine.module.<method>(...)`` (a vae's ``encode``/``decode``) routed through the engine's forward, so that
    ZeRO-3's hooks bracket the call (and a frozen role runs without autograd). Every rank makes the same calls."""
    module = engine.module
    module.forward = getattr(module, method)  # instance attribute: nn.Module.__call__ runs it with the hooks
    try:
        return engine(*args, **kwargs)
    finally:
        del module.forward


@torch.no_grad()
def component_loader(model: Any, model_path: str) -> Any:
    """``load(name)``: a role factory of the component ``name`` of ``model_path`` (with ``model.variant`` where
    ``model.pretrained`` is given)."""
    variant = (model.variant or None) if model.pretrained else None
    return lambda name: (lambda: load_component(model_path, name, variant))


def update_ema(registry: EngineRegistry, step: int, settings: EMASettings, source: str, target: str = "ema") -> float:
    """One EMA update after 1-based optimizer step ``step`` with diffusers' EMAModel decay (returned), on local
    partitions, or with a sharded source gathered for a whole EMA (seed_baseline). All ranks call it."""
    s = settings
    decay = ema_decay(step, decay=s.decay, min_decay=s.min_decay, update_after_step=s.update_after_step,
                      use_ema_warmup=s.use_ema_warmup, inv_gamma=s.inv_gamma, power=s.power)
    src, dst = registry.role(source), registry.role(target)
    if src.stage == dst.stage:
        ema_update(dst.module, src.module, decay)
        return decay
    with registry.gathered(source):
        for t, p in zip(dst.module.parameters(), src.module.parameters(), strict=True):
            t.data.lerp_(p.data.to(t.device, t.dtype), 1.0 - decay)
    return decay

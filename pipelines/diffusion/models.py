"""The roles of a diffusion fine-tune, each its own engine in an :class:`EngineRegistry`.

* ``unet`` - trainable (full fine-tune, or LoRA adapters only), ZeRO-3 by default;
* ``vae``, ``text_encoder`` (and ``text_encoder_2`` ... for SDXL-style models) - frozen, ZeRO-3 by
  default, each with its own stage, dtype and offload;
* ``ema`` - optional EMA of the unet: a frozen, stateful role sharded like the unet.

Two modes:

* ``"zero3"`` - every role as configured (all ZeRO-3 by default): no rank holds a full copy of any model;
* ``"seed_baseline"`` - what diffusers' ``train_text_to_image.py`` does under DeepSpeed ZeRO-3: only
  the unet goes through ZeRO-3; the vae and text encoders are full copies on every rank (built here
  as stage-0 roles), and the EMA is a full copy updated by gathering the unet every step.

Models load with ``from_pretrained`` from a diffusers folder (``model_index.json``, ``unet/``,
``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``); the classes come from ``model_index.json``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from multiengine.engines import (
    EngineRegistry,
    LoraSpec,
    OptimSpec,
    Placement,
    RoleSpec,
    barrier,
    ema_decay,
    ema_update,
    frozen_role,
    trainable_role,
)

logger = logging.getLogger(__name__)

ZERO3 = "zero3"
SEED_BASELINE = "seed_baseline"
MODES: tuple[str, ...] = (ZERO3, SEED_BASELINE)
_TEXT_ENCODER = re.compile(r"^text_encoder(_\d+)?$")

__all__ = [
    "MODES",
    "SEED_BASELINE",
    "UNET_LORA_TARGETS",
    "ZERO3",
    "build_diffusion_registry",
    "call_engine",
    "denoiser_name",
    "diffusion_role_specs",
    "read_model_index",
    "resolve_model_path",
    "text_encoder_names",
    "tokenizer_name",
    "update_ema",
]


# LoRA on the unet's attention projections, as diffusers' train_text_to_image_lora.py (gaussian init).
UNET_LORA_TARGETS: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")


# --- the model folder --------------------------------------------------------------------------
def resolve_model_path(name_or_path: str, revision: str | None = None, variant: str | None = None) -> str:
    """A local diffusers folder for ``name_or_path``: the folder itself, or a hub snapshot that rank 0
    downloads while the others wait (then every rank reads the same cache). All ranks must call it."""
    if os.path.isdir(name_or_path):
        return name_or_path
    from diffusers import DiffusionPipeline

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    kwargs: dict[str, Any] = {"revision": revision, "variant": variant}
    if rank == 0:
        DiffusionPipeline.download(name_or_path, **kwargs)
    barrier()
    return str(DiffusionPipeline.download(name_or_path, **kwargs))


def read_model_index(model_path: str) -> dict[str, Any]:
    """``model_index.json`` of a diffusers folder (component name -> [library, class])."""
    path = os.path.join(model_path, "model_index.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_path!r} is not a diffusers folder: it has no model_index.json.")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def text_encoder_names(model_path: str) -> list[str]:
    """The text encoders of a diffusers folder, in order: ``["text_encoder"]`` for SD 1.x/2.x,
    ``["text_encoder", "text_encoder_2"]`` for SDXL. Each becomes its own frozen role."""
    index = read_model_index(model_path)
    names = [k for k, v in index.items() if _TEXT_ENCODER.match(k) and isinstance(v, list) and v[0]]
    return sorted(names, key=lambda n: int(n.rsplit("_", 1)[1]) if n[-1].isdigit() else 1)


def tokenizer_name(encoder_name: str) -> str:
    """``text_encoder`` -> ``tokenizer``, ``text_encoder_2`` -> ``tokenizer_2``."""
    return encoder_name.replace("text_encoder", "tokenizer", 1)


def _component_class(model_path: str, name: str) -> type:
    index = read_model_index(model_path)
    if name not in index or not isinstance(index[name], list) or not index[name][0]:
        raise KeyError(f"{model_path!r} has no component '{name}' in model_index.json.")
    library, class_name = index[name]
    module = __import__(library, fromlist=[class_name])
    return getattr(module, class_name)


def load_component(model_path: str, name: str, variant: str | None = None) -> torch.nn.Module:
    """``<class from model_index>.from_pretrained(model_path, subfolder=name)``. Inside a stage-3 role's
    build scope this loads partitioned (transformers via HfDeepSpeedConfig, diffusers via the registry's
    loader); anywhere else it loads a full copy."""
    cls = _component_class(model_path, name)
    kwargs: dict[str, Any] = {"subfolder": name}
    if variant:
        kwargs["variant"] = variant
    return cls.from_pretrained(model_path, **kwargs)


# --- role factories ----------------------------------------------------------------------------


def denoiser_name(model_path: str) -> str:
    """``"unet"`` (SD 1.x/2.x, SDXL) or ``"transformer"`` (SD3, FLUX): the folder's trainable component."""
    index = read_model_index(model_path)
    for name in ("unet", "transformer"):
        if isinstance(index.get(name), list) and index[name][0]:
            return name
    raise ValueError(f"{model_path!r}: model_index.json has neither a unet nor a transformer to train.")


def diffusion_role_specs(
    model_path: str,
    *,
    mode: str = ZERO3,
    unet: Placement | None = None,
    vae: Placement | None = None,
    text_encoder: Placement | Mapping[str, Placement] | None = None,
    ema: Placement | None = None,
    optim: OptimSpec | None = None,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    gradient_checkpointing: bool = False,
    lora: LoraSpec | None = None,
    variant: str | None = None,
    seed: int = 0,
    denoiser: str | None = None,
) -> list[RoleSpec]:
    """RoleSpecs for the denoiser (trainable: ``unet``, or ``transformer`` for SD3/FLUX; its placement is
    ``unet``), ``vae`` and every text encoder (frozen), and ``ema`` when ``ema`` is given (its placement;
    its stage follows the denoiser's in ``zero3`` mode so that the update runs on matching local partitions).
    ``text_encoder``: one placement for every text encoder, or ``{name: placement}`` per encoder (a T5 at
    ZeRO-3 with offload beside CLIPs without); ``denoiser`` defaults to the folder's (:func:`denoiser_name`).

    In ``seed_baseline`` mode the vae and text encoders are forced to stage 0 (full copies on every
    rank) and the EMA to a full stage-0 copy, as in diffusers' examples. ``unet``, ``vae`` and
    ``text_encoder`` default to ``Placement()``, ``optim`` to ``OptimSpec(weight_decay=1e-2)``.
    """
    unet, vae = unet or Placement(), vae or Placement()
    text_encoder = text_encoder or Placement()
    optim = optim or OptimSpec(weight_decay=1e-2)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; use one of {list(MODES)}.")
    denoiser = denoiser or denoiser_name(model_path)
    encoders = text_encoder_names(model_path)
    if isinstance(text_encoder, Placement):
        per_encoder = {name: text_encoder for name in encoders}
    else:
        missing = [n for n in encoders if n not in text_encoder]
        if missing:
            raise ValueError(f"no placement for text encoder(s) {missing} of {model_path!r}")
        per_encoder = {name: text_encoder[name] for name in encoders}
    if mode == SEED_BASELINE:
        vae = Placement(stage=0, dtype=vae.dtype)
        per_encoder = {name: Placement(stage=0, dtype=p.dtype) for name, p in per_encoder.items()}
        if ema is not None:
            ema = Placement(stage=0, dtype=ema.dtype)
    elif ema is not None and ema.stage != unet.stage:
        logger.info("ema: stage %d requested, built at the %s's stage %d (updates run on matching partitions)",
                    ema.stage, denoiser, unet.stage)
        ema = replace(ema, stage=unet.stage, offload_params=ema.offload_params and unet.stage == 3)

    def component(name: str) -> Callable[[], torch.nn.Module]:
        return lambda: load_component(model_path, name, variant)

    specs = [
        trainable_role(denoiser, component(denoiser), unet, optim, micro_batch_size=micro_batch_size,
                       grad_accum=grad_accum, lora=lora, gradient_checkpointing=gradient_checkpointing, seed=seed),
        frozen_role("vae", component("vae"), vae),
    ]
    specs += [frozen_role(name, component(name), per_encoder[name]) for name in encoders]
    if ema is not None:
        # Same weights as the denoiser at step 0 (same factory, same LoRA seed); no checkpointing needed.
        specs.append(frozen_role("ema", component(denoiser), ema, stateful=True, lora=lora, seed=seed))
    return specs


def build_diffusion_registry(
    model_path: str, *, registry: EngineRegistry | None = None, backend: str = "auto", **options: Any
) -> EngineRegistry:
    """The roles of :func:`diffusion_role_specs` (same keyword arguments) added to ``registry`` (a new
    one with ``backend`` when None) and built. All ranks must call it."""
    registry = registry if registry is not None else EngineRegistry(backend=backend)
    for spec in diffusion_role_specs(model_path, **options):
        registry.add(spec)
    return registry.build()


# --- using the engines ---------------------------------------------------------------------------
def call_engine(engine: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``engine.module.<method>(*args, **kwargs)`` (e.g. the vae's ``encode``/``decode``), routed through
    the engine's forward.

    Under ZeRO-3 the engine's forward and the top module's hooks bracket each call (marking the pass,
    resetting the parameter-fetch trace); calling ``engine.module.encode`` directly would skip them and
    let the trace grow by one pass per call. For a frozen role the engine's forward also runs without
    autograd. Every rank must make the same calls in the same order (each layer's weights are gathered).
    """
    module = engine.module
    module.forward = getattr(module, method)  # instance attribute: nn.Module.__call__ runs it with the hooks
    try:
        return engine(*args, **kwargs)
    finally:
        del module.forward


@torch.no_grad()
def update_ema(registry: EngineRegistry, step: int, decay: float = 0.9999, use_ema_warmup: bool = False, *,
               min_decay: float = 0.0, update_after_step: int = 0, inv_gamma: float = 1.0, power: float = 2 / 3,
               source: str = "unet", target: str = "ema") -> float:
    """One EMA update after optimizer step ``step`` (1-based: EMAModel's ``optimization_step``), with the decay
    of diffusers' ``EMAModel`` for the same options (:func:`ema_decay`). Returns the decay used.

    Same stage for both roles: on local partitions, no gather (:func:`ema_update`). A full EMA copy of a
    sharded unet (seed_baseline): the unet is gathered on every rank and the copy updated, which is what
    diffusers' EMAModel does under ZeRO-3. All ranks must call it.
    """
    decay = ema_decay(step, decay=decay, min_decay=min_decay, update_after_step=update_after_step,
                      use_ema_warmup=use_ema_warmup, inv_gamma=inv_gamma, power=power)
    src, dst = registry.role(source), registry.role(target)
    if src.stage == dst.stage:
        ema_update(dst.module, src.module, decay)
        return decay
    with registry.gathered(source):
        for t, s in zip(dst.module.parameters(), src.module.parameters(), strict=True):
            t.data.lerp_(s.data.to(t.device, t.dtype), 1.0 - decay)
    return decay

"""Text-to-image fine-tuning of every diffusers family with every model sharded: the denoiser trainable
(``unet`` for SD 1.x/2.x and SDXL, ``transformer`` for SD3 and FLUX), the vae and each text encoder frozen,
each its own DeepSpeed engine (ZeRO-3 by default), optional EMA (sharded like the denoiser) and LoRA.

    multiengine run sd_finetune --config tiny --nproc-per-node 2                 # tiny SD, CPU
    multiengine run sd_finetune --config tiny_sdxl --nproc-per-node 2            # tiny SDXL / SD3 / FLUX
    multiengine run sd_finetune --config tiny --nproc-per-node 2 mode=seed_baseline
    multiengine run sd_finetune --config sdxl_full --nproc-per-node 8 data.source=/data/my_imagefolder

The family comes from the folder's ``model_index.json`` (``model.tiny_family`` for the embedded tiny model):
SD and SDXL train with the DDPM objective (noise / v-prediction, min-SNR), SD3 and FLUX with rectified flow
matching (``flow.*``: timestep density, loss weighting, preconditioning, FLUX guidance, T5 length).
``mode=seed_baseline`` reproduces diffusers' scripts under ZeRO-3 (frozen roles full copies on every rank,
EMA a full copy) for comparison. Writes metrics.jsonl, summary.json, validation grids, checkpoints and
export/ (pipeline/, per-role folders, lora/) under output_dir.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from multiengine.engines import LoraSpec, OptimSpec, barrier, current_rss_bytes, mean_over_ranks, shard_batches
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.export import export_pipeline, export_roles, save_lora
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles, model_family
from multiengine.pipelines.diffusion.flow import SCHEMES
from multiengine.pipelines.diffusion.math import PREDICTION_TYPES
from multiengine.pipelines.diffusion.models import (
    MODES,
    diffusion_role_specs,
    read_model_index,
    resolve_model_path,
    text_encoder_names,
    tokenizer_name,
    update_ema,
)
from multiengine.pipelines.diffusion.tiny import build_tiny, pretrain_tiny_vae
from multiengine.pipelines.diffusion.training import (
    DiffusionObjective,
    FlowMatchingObjective,
    flow_heldout_loss,
    heldout_loss,
    prompt_input_ids,
    step_generator,
)
from multiengine.pipelines.diffusion.validation import build_pipeline, generate, image_grid
from multiengine.recipes.common import check_rows_per_rank, placement
from multiengine.engines.recipe_config import Check, Choice, Each, Length, Range, RecipeConfigError, config_problem
from multiengine.recipes.lifecycle import COMMON_DEFAULTS, Recipe

logger = logging.getLogger(__name__)

SHAPES_PROMPTS = [
    "a red square on a white background",
    "a blue circle on a black background",
    "a green triangle on a gray background",
    "a yellow circle on a white background",
]
# The flow-matching options' defaults per family, as diffusers' SD3 / FLUX training scripts set them.
FLOW_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"weighting_scheme": "logit_normal", "precondition_outputs": True, "max_sequence_length": 77},
    "flux": {"weighting_scheme": "none", "precondition_outputs": False, "max_sequence_length": 512},
}
TEXT_ENCODER_ROLES = ("text_encoder", "text_encoder_2", "text_encoder_3")
ROLE_NAMES = ("unet", "transformer", "vae", *TEXT_ENCODER_ROLES, "ema")

DATA_DEFAULTS: dict[str, Any] = {  # image-caption rows (docs/data.md)
    "source": Key("", "imagefolder (metadata.jsonl), data file, save_to_disk folder or hub name; \"\" = shapes"),
    "sources": Key([], "several sources with weights: [{path, weight, columns, split}] (instead of data.source)"),
    "columns": Key({"image": Key("", "your column names (\"\" = data.image_column / caption_column)"), "caption": Key("", "your column names (\"\" = data.image_column / caption_column)")}, "your "
                                                                                                                                                                                             "column "
                                                                                                                                                                                             "names "
                                                                                                                                                                                             "(\"\" "
                                                                                                                                                                                             "= "
                                                                                                                                                                                             "data.image_column "
                                                                                                                                                                                             "/ "
                                                                                                                                                                                             "caption_column)"),
    "image_column": Key("image", "the image column (alias of data.columns.image)"),
    "caption_column": Key("text", "the caption column (alias of data.columns.caption)"),
    "train_split": Key("train", "the split of a hub dataset or DatasetDict folder to train on"),
    "eval_source": Key("", "separate evaluation rows (same forms as data.source); wins over data.eval_split"),
    "eval_split": Key("", "held-out rows: a fraction (0.05), a count (16), a split name (test); \"\" = "
                          "eval.heldout_size"),
    "check_images": Key(True, "before any rank starts: open every image and list the unreadable ones"),
    "resolution": Key(512, "training (and validation) size in pixels, square"),
    "center_crop": Key(True, "center crop after resizing the shorter side (false: random crop)"),
    "random_flip": Key(False, "random horizontal flip"),
    "builtin_size": Key(128, "images of the built-in shapes dataset (generated under output_dir/data)"),
    "max_train_samples": Key(0, "use only the first N training rows (0 = all)"),
    "num_workers": Key(0, "DataLoader workers per rank"),
    "cache_dir": Key("", "datasets cache folder (\"\" = the default)"),
}

TRAIN_DEFAULTS: dict[str, Any] = {  # the denoiser's optimisation
    "micro_batch_size": Key(1, "images per rank per forward"),
    "grad_accum": Key(1, "micro batches per optimizer step (global batch = micro x accum x ranks)"),
    "lr": Key(1e-5, "peak learning rate"),
    "lr_scheduler": Key("constant", "diffusers.optimization.get_scheduler names (constant, cosine, ...)"),
    "lr_warmup_steps": Key(0, "warmup, in optimizer steps"),
    "adam_beta1": Key(0.9, "AdamW beta1"),
    "adam_beta2": Key(0.999, "AdamW beta2"),
    "adam_weight_decay": Key(1e-2, "AdamW weight decay"),
    "adam_epsilon": Key(1e-8, "AdamW epsilon"),
    "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
    "gradient_checkpointing": Key(False, "activation checkpointing of the denoiser"),
    "prediction_type": Key("", "SD/SDXL: \"\" = the scheduler's; epsilon | v_prediction | sample"),
    "snr_gamma": Key(0.0, "SD/SDXL: > 0 = min-SNR-gamma weighting (5.0 recommended)"),
    "noise_offset": Key(0.0, "SD/SDXL: offset-noise scale"),
    "input_perturbation": Key(0.0, "SD/SDXL: input-perturbation scale"),
}

EMA_DEFAULTS: dict[str, Any] = {  # EMA of the denoiser, diffusers' EMAModel options
    "enabled": Key(False, "keep an EMA role (sharded like the denoiser; exported in the pipeline when on)"),
    "decay": Key(0.9999, "the largest decay"),
    "use_ema_warmup": Key(False, "true: 1 - (1 + s/inv_gamma)^-power; false: (1 + s) / (10 + s)"),
    "min_decay": Key(0.0, "the smallest decay after the first update"),
    "update_after_step": Key(0, "copy the weights (decay 0) for this many steps first"),
    "inv_gamma": Key(1.0, "warmup: inverse multiplicative factor"),
    "power": Key(2 / 3, "warmup: exponent (2/3 for long runs, 3/4 for short ones)"),
    "dtype": Key("fp32", "EMA weights' dtype (bf16 would round away small updates)"),
    "offload_params": Key(False, "ZeRO-3 parameter offload of the EMA to the host"),
    "max_decay": Key(None, "removed: use ema.decay"),
    "warmup": Key(None, "removed: use ema.use_ema_warmup"),
}

VALIDATION_DEFAULTS: dict[str, Any] = {  # images generated before, after and every N steps
    "enabled": Key(True, "validation grids before and after training (and every `every` steps when > 0)"),
    "every": Key(0, "also every N steps (0 = only before and after)"),
    "prompts": Key([], "[] = the shapes prompts (built-in data) or captions of your held-out rows"),
    "num_prompts": Key(4, "how many held-out captions when validation.prompts is []"),
    "num_inference_steps": Key(25, "sampler steps"),
    "guidance_scale": Key(None, "null = the pipeline's default (SD/SDXL 7.5, SD3 7.0, FLUX 3.5)"),
    "seed": Key(0, "the sampler's seed (the same images on every rank)"),
    "use_ema": Key(True, "generate with the EMA weights when EMA is on (as diffusers' examples)"),
}

EVAL_DEFAULTS: dict[str, Any] = {  # held-out loss at fixed noise and timesteps
    "heldout_size": Key(8, "held-out rows for the loss (taken from the data unless eval_source/eval_split); 0 = none"),
    "timesteps": Key(8, "evenly spaced timesteps (schedule positions) per held-out image"),
    "every": Key(0, "also every N steps when > 0 (always before and after)"),
    "seed": Key(1234, "the held-out noise's seed"),
}

KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": "outputs/sd_finetune",
    "max_steps": Key(100, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (diffusers' layout: frozen roles whole)"),
    "model": Key({
        "pretrained": Key("", "diffusers folder or hub name (SD, SDXL, SD3, FLUX); \"\" = the tiny model, built here"),
        "revision": Key("", "hub revision (\"\" = main)"),
        "variant": Key("", "weight variant passed to from_pretrained (e.g. fp16; \"\" = the default weights)"),
        "tiny_family": Key("sd", "tiny model only: sd | sdxl | sd3 | flux"),
        "tiny_vae_steps": Key(0, "tiny model only: pretrain its random vae on the training images first"),
        "tiny_text_encoders": Key(None, "removed: use model.tiny_family (sdxl has two text encoders)"),
    }, "the diffusers folder to fine-tune"),
    "data": Key({**DATA_DEFAULTS}, "image-caption rows (docs/data.md)"),
    "train": Key({**TRAIN_DEFAULTS}, "the denoiser's optimisation"),
    "flow": Key({
        "weighting_scheme": Key("", "\"\" = the family's (SD3 logit_normal, FLUX none); or uniform, mode, cosmap, ..."),
        "logit_mean": Key(0.0, "logit_normal density: mean"),
        "logit_std": Key(1.0, "logit_normal density: standard deviation"),
        "mode_scale": Key(1.29, "mode density: scale"),
        "precondition_outputs": Key(None, "null = the family's (SD3 true, FLUX false): x0 loss of noisy - sigma * "
                                          "pred"),
        "guidance_scale": Key(3.5, "FLUX with a guidance embedding: the guidance input during training"),
        "max_sequence_length": Key(0, "T5 tokens per caption; 0 = the family's (SD3 77, FLUX 512)"),
    }, "SD3 / FLUX: rectified flow matching, as diffusers' SD3 / FLUX scripts"),
    "roles": Key({
        "unet": Key({"stage": Key(3, "SD, SDXL"), "dtype": Key("bf16", "SD, SDXL"), "offload_params": Key(False, "SD, SDXL"), "offload_optimizer": Key(False, "SD, SDXL")}, "SD, "
                                                                                                                                                                            "SDXL"),
        "transformer": Key({"stage": Key(3, "SD3, FLUX"), "dtype": Key("bf16", "SD3, FLUX"), "offload_params": Key(False, "SD3, FLUX"), "offload_optimizer": Key(False, "SD3, FLUX")}, "SD3, "
                                                                                                                                                                                       "FLUX"),
        # gather_forward: gather a frozen ZeRO-3 role whole for each call (one collective, 1/N between calls)
        "vae": Key({"stage": Key(3, "frozen vae"), "dtype": Key("bf16", "frozen vae"), "offload_params": Key(False, "frozen vae"), "gather_forward": Key(True, "frozen vae")}, "frozen "
                                                                                                                                                                               "vae"),
        "text_encoder": Key({"stage": Key(3, "the first"), "dtype": Key("bf16", "the first"), "offload_params": Key(False, "the first"), "gather_forward": Key(True, "the first")}, "the "
                                                                                                                                                                                    "first"),
        # stage -1 / dtype "": as roles.text_encoder (SDXL's CLIP-G, SD3's CLIP-G, FLUX's T5)
        "text_encoder_2": Key({"stage": Key(-1, "the second"), "dtype": Key("", "the second"), "offload_params": Key(False, "the second"), "gather_forward": Key(True, "the second")}, "the "
                                                                                                                                                                                       "second"),
        "text_encoder_3": Key({"stage": Key(-1, "SD3's T5"), "dtype": Key("", "SD3's T5"), "offload_params": Key(False, "SD3's T5"), "gather_forward": Key(True, "SD3's T5")}, "SD3's "
                                                                                                                                                                               "T5"),
    }, "placement per role (one section per role name of the model)"),
    "ema": Key({**EMA_DEFAULTS}, "EMA of the denoiser, diffusers' EMAModel options"),
    "lora": Key({
        "enabled": Key(False, "train adapters only"),
        "rank": Key(4, "adapter rank"),
        "alpha": Key(0.0, "scale numerator (0 = rank)"),
        "target_modules": Key([], "[] = diffusers' defaults of the family (unet: to_k/q/v/out.0; SD3/FLUX: "
                                  "attention...)"),
    }, "LoRA on the denoiser, base weights frozen"),
    "validation": Key({**VALIDATION_DEFAULTS}, "images generated before, after and every N steps"),
    "eval": Key({**EVAL_DEFAULTS}, "held-out loss at fixed noise and timesteps"),
    "export": Key({
        "enabled": Key(True, "write export/pipeline (and export/lora for LoRA runs)"),
        "dtype": Key("fp32", "dtype of every exported component"),
        "roles": Key([], "per-role folders besides the pipeline, e.g. [unet, ema] ([] = none)"),
    }, "outputs under output_dir/export"),
}


# The placement keys of a role section (one line each in DEFAULTS, so their meanings live here).
ROLE_KEY_HELP = {
    "stage": "ZeRO stage of this role (0-3; a frozen role asked for 1 or 2 is built at 0: nothing to shard)",
    "dtype": "fp32 | bf16 | fp16 (fp16 has no CPU path)",
    "offload_params": "ZeRO-3 parameter offload to the host",
    "offload_optimizer": "ZeRO optimizer-state offload to the host (DeepSpeed's CPU Adam)",
    "gather_forward": "ZeRO-3 frozen role: gather it whole once per call instead of layer by layer",
}
HELP = {f"roles.{r}.{k}": text for r, section in DEFAULTS["roles"].items() for k, text in ROLE_KEY_HELP.items()
        if k in section}
HELP.update({"roles.text_encoder_2.stage": "ZeRO stage; -1 = as roles.text_encoder",
             "roles.text_encoder_2.dtype": "fp32 | bf16 | fp16; \"\" = as roles.text_encoder",
             "roles.text_encoder_3.stage": "ZeRO stage; -1 = as roles.text_encoder",
             "roles.text_encoder_3.dtype": "fp32 | bf16 | fp16; \"\" = as roles.text_encoder"})


class Removed(Check):
    """A key that no longer exists: any value is an error that names its replacement."""

    allow_none = True

    def __init__(self, replacement: str) -> None:
        self.replacement = replacement

    def describe(self) -> str:
        return f"removed (use {self.replacement})"

    def problem(self, value: Any) -> str | None:
        return f"was removed (use {self.replacement})"

    def fix(self, key: str, value: Any) -> str:
        return f"drop {key} and set {self.replacement}"


_STAGE = Range(0, 3)
_FOLLOW_STAGE = Range(-1, 3)
_DTYPE = Choice("fp32", "bf16", "fp16")
CHECKS = {
    "max_steps": Range(1),
    "mode": Choice(*MODES),
    "seed": Range(0),
    "model.tiny_family": Choice(*FAMILIES),
    "model.tiny_vae_steps": Range(0),
    "model.tiny_text_encoders": Removed("model.tiny_family=sdxl for a model with two text encoders"),
    "data.resolution": Range(8),
    "data.builtin_size": Range(2),
    "data.max_train_samples": Range(0),
    "data.num_workers": Range(0),
    "train.micro_batch_size": Range(1),
    "train.grad_accum": Range(1),
    "train.lr": Range(0, min_exclusive=True),
    "train.lr_warmup_steps": Range(0),
    "train.adam_beta1": Range(0, 1, max_exclusive=True),
    "train.adam_beta2": Range(0, 1, max_exclusive=True),
    "train.adam_weight_decay": Range(0),
    "train.adam_epsilon": Range(0, min_exclusive=True),
    "train.max_grad_norm": Range(0),
    "train.prediction_type": Choice("", *PREDICTION_TYPES),
    "train.snr_gamma": Range(0),
    "train.noise_offset": Range(0),
    "train.input_perturbation": Range(0),
    "flow.weighting_scheme": Choice("", *SCHEMES),
    "flow.logit_std": Range(0, min_exclusive=True),
    "flow.mode_scale": Range(0),
    "flow.precondition_outputs": Choice(True, False, allow_none=True),
    "flow.guidance_scale": Range(0),
    "flow.max_sequence_length": Range(0),
    "roles.unet.stage": _STAGE,
    "roles.transformer.stage": _STAGE,
    "roles.vae.stage": _STAGE,
    "roles.text_encoder.stage": _STAGE,
    "roles.text_encoder_2.stage": _FOLLOW_STAGE,
    "roles.text_encoder_3.stage": _FOLLOW_STAGE,
    "roles.unet.dtype": _DTYPE,
    "roles.transformer.dtype": _DTYPE,
    "roles.vae.dtype": _DTYPE,
    "roles.text_encoder.dtype": _DTYPE,
    "roles.text_encoder_2.dtype": Choice("", "fp32", "bf16", "fp16"),
    "roles.text_encoder_3.dtype": Choice("", "fp32", "bf16", "fp16"),
    "ema.decay": Range(0, 1),
    "ema.min_decay": Range(0, 1),
    "ema.update_after_step": Range(0),
    "ema.inv_gamma": Range(0, min_exclusive=True),
    "ema.power": Range(0, min_exclusive=True),
    "ema.dtype": _DTYPE,
    "ema.max_decay": Removed("ema.decay (diffusers' EMAModel name)"),
    "ema.warmup": Removed("ema.use_ema_warmup (diffusers' EMAModel name; default false)"),
    "lora.rank": Range(1),
    "lora.alpha": Range(0),
    "lora.target_modules": Each(Length(1)),
    "validation.every": Range(-1),
    "validation.prompts": Each(Length(1)),
    "validation.num_prompts": Range(1),
    "validation.num_inference_steps": Range(1),
    "validation.guidance_scale": Range(0, allow_none=True),
    "eval.heldout_size": Range(0),
    "eval.timesteps": Range(1),
    "eval.every": Range(0),
    "export.dtype": _DTYPE,
    "export.roles": Each(Choice(*ROLE_NAMES)),
    "checkpoint.every": Range(0),
    "checkpoint.keep_last": Range(0),
}


def _cfg_str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def eval_split_value(cfg: Any) -> float | int | str:
    """``data.eval_split`` as load_image_caption_data takes it: a fraction, a count, a split name; "" =
    ``eval.heldout_size`` rows held out of the training data."""
    text = str(cfg.data.eval_split).strip()
    if not text:
        return int(cfg.eval.heldout_size)
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number >= 1 and number.is_integer() else number


def data_spec(cfg: Any) -> Any:
    """The training source(s): ``data.sources`` when given, else ``data.source``."""
    sources = _plain(cfg.data.sources) or []
    return sources if sources else str(cfg.data.source)


def data_columns(cfg: Any) -> dict[str, str]:
    return {k: str(v) for k, v in _plain(cfg.data.columns).items() if v}


def check_family_options(cfg: Any, family: str, where: str = "") -> None:
    """Options that belong to the other objective are an error, never silently ignored."""
    suffix = f" ({where})" if where else ""
    objective = family_roles(family).objective
    if objective == "flow":
        for key, default in (("prediction_type", ""), ("snr_gamma", 0.0), ("noise_offset", 0.0),
                             ("input_perturbation", 0.0)):
            if cfg.train[key] != default:
                raise config_problem(f"train.{key}", cfg.train[key], f"applies to the DDPM families (sd, sdxl), not "
                                     f"to this {family} model{suffix}", f"drop train.{key}; SD3/FLUX use flow.*")
    elif "flow" in cfg:
        flow_defaults = DEFAULTS["flow"]
        for key, default in flow_defaults.items():
            if cfg.flow[key] != default:
                raise config_problem(f"flow.{key}", cfg.flow[key], f"applies to the flow-matching families (sd3, "
                                     f"flux), not to this {family} model{suffix}", f"drop flow.{key}")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts, without building a model: the model folder (and its family's options), the
    data sources, columns and rows, held-out size against the rows, every image readable, and a micro batch of
    training images per rank on ``world_size`` ranks."""
    from multiengine.pipelines.checks import check_diffusers_folder, check_model_folder

    family = str(cfg.model.tiny_family)
    if cfg.model.pretrained:
        path = str(cfg.model.pretrained)
        try:
            if check_model_folder(path, "model.pretrained", kind="diffusers") == "local":
                check_diffusers_folder(path, "model.pretrained")
                family = model_family(os.path.expanduser(path))
            else:
                family = ""
        except (ValueError, FileNotFoundError) as exc:
            raise _data_problem("model.pretrained", path, "is not a usable diffusers folder", exc,
                                named=("model.pretrained",)) from None
    if family:
        check_family_options(cfg, family)
        validate_resolution(cfg, family, str(cfg.model.pretrained))
    check_data(cfg)
    check_batches(cfg, world_size)


def validate_resolution(cfg: Any, family: str, path: str) -> None:
    multiple = resolution_multiple(family, os.path.expanduser(path) if path and os.path.isdir(
        os.path.expanduser(path)) else None)
    res = int(cfg.data.resolution)
    if res % multiple:
        raise config_problem("data.resolution", res, f"is not a multiple of {multiple}, which this {family} model "
                             "needs (vae downsampling x the denoiser's patches / levels)",
                             f"use data.resolution={max(multiple, res // multiple * multiple)}")


def resolution_multiple(family: str, model_path: str | None) -> int:
    """What the image side must be a multiple of: the vae's downsampling times the denoiser's (2x2 patches
    for SD3/FLUX, one 2x per unet level below the top). From the configs only; the tiny models when no folder."""
    if model_path is None:
        return {"sd": 4, "sdxl": 4, "sd3": 4, "flux": 4}[family]
    with open(os.path.join(model_path, "vae", "config.json"), encoding="utf-8") as f:
        vae = json.load(f)
    factor = 2 ** (len(vae.get("block_out_channels", [1])) - 1)
    denoiser = family_roles(family).denoiser
    with open(os.path.join(model_path, denoiser, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if denoiser == "unet":
        return factor * 2 ** (len(config.get("block_out_channels", [1])) - 1)
    return factor * 2 if family == "flux" else factor * int(config.get("patch_size", 2))


def _data_problem(key: str, spec: Any, problem: str, exc: Exception,
                  named: tuple[str, ...] = ("data.source", "data.eval_source")) -> RecipeConfigError:
    """A data or model-folder error as the config error: as it is when it already names its key (one of
    ``named``), the value and the fix."""
    if str(exc).startswith(named):
        return RecipeConfigError(str(exc))
    return config_problem(key, spec, problem, str(exc))


def check_data(cfg: Any, conditioning: bool = False) -> dict[str, Any] | None:
    """The user's data: each source exists, has the columns and rows, enough rows for the held-out split,
    and (``data.check_images``) every image opens. The built-in data needs only its sizes."""
    from multiengine.pipelines.sources import DataSourceError

    spec = data_spec(cfg)
    heldout = int(cfg.eval.heldout_size)
    if not spec:
        if not str(cfg.data.eval_split).strip() and not cfg.data.eval_source and heldout >= cfg.data.builtin_size:
            raise config_problem("eval.heldout_size", heldout, f"leaves no training rows of the built-in data "
                                 f"({cfg.data.builtin_size} images)",
                                 f"set eval.heldout_size below {cfg.data.builtin_size} or raise data.builtin_size")
        return None
    key = "data.sources" if _plain(cfg.data.sources) else "data.source"
    extra = {"conditioning_image": str(cfg.data.columns.get("conditioning_image") or "conditioning_image")} \
        if conditioning else None
    try:
        report = data_lib.check_image_caption_data(
            spec, columns=data_columns(cfg), image_column=str(cfg.data.image_column),
            caption_column=str(cfg.data.caption_column), split=str(cfg.data.train_split), key=key,
            cache_dir=_cfg_str(cfg.data.cache_dir), extra_image_columns=extra)
    except (DataSourceError, ValueError, FileNotFoundError) as exc:
        raise _data_problem(key, spec, "cannot be used as image-caption data", exc) from None
    split = eval_split_value(cfg)
    if not cfg.data.eval_source and isinstance(split, int) and split >= report["rows"]:
        name = "eval.heldout_size" if not str(cfg.data.eval_split).strip() else "data.eval_split"
        raise config_problem(name, split, f"holds out every row of the data ({report['rows']} rows)",
                             f"set {name} below {report['rows']}")
    if cfg.data.check_images:
        bad = data_lib.unreadable_images(spec, columns=data_columns(cfg), image_column=str(cfg.data.image_column),
                                         caption_column=str(cfg.data.caption_column),
                                         split=str(cfg.data.train_split), cache_dir=_cfg_str(cfg.data.cache_dir),
                                         extra_image_columns=extra)
        if bad:
            shown = "; ".join(bad[:10]) + (f"; ... ({len(bad)} in all)" if len(bad) > 10 else "")
            raise config_problem(key, spec, f"has {len(bad)} unreadable image(s): {shown}",
                                 "remove or replace those files (or set data.check_images=false to find them "
                                 "only when training reads them)")
    return report



def _held_out_of(n: int, split: Any) -> int:
    """Rows heldout_split takes out of ``n`` for a fraction or count (0 for a split name or none)."""
    if isinstance(split, bool) or not isinstance(split, (int, float)) or split <= 0:
        return 0
    return max(1, round(split * n)) if isinstance(split, float) and split < 1 else int(split)


def training_rows(cfg: Any, conditioning: bool = False) -> tuple[int, int]:
    """``(training rows, rows held out of them for evaluation)`` as the run will have them (load_rows, then
    data.max_train_samples): counted for the built-in shapes, loaded like the run loads them otherwise."""
    split = eval_split_value(cfg)
    spec = data_spec(cfg)
    if not spec:
        n = int(cfg.data.builtin_size)
        held = 0 if cfg.data.eval_source else _held_out_of(n, split)
        train = n - held
    else:
        columns, extra = data_columns(cfg), None
        if conditioning:  # as ControlNetTraining.load_rows
            extra = {"conditioning_image": str(cfg.data.columns.get("conditioning_image") or "conditioning_image")}
            columns = {k: v for k, v in columns.items() if k != "conditioning_image"}
        try:
            data = data_lib.load_image_caption_data(
                spec, columns=columns, image_column=str(cfg.data.image_column),
                caption_column=str(cfg.data.caption_column), train_split=str(cfg.data.train_split),
                eval_source=_plain(cfg.data.eval_source) or None, eval_split=split, seed=cfg.seed,
                cache_dir=_cfg_str(cfg.data.cache_dir), extra_images=extra)
        except (ValueError, FileNotFoundError) as exc:
            key = "data.sources" if _plain(cfg.data.sources) else "data.source"
            raise _data_problem(key, spec, "cannot be split into training and evaluation rows", exc) from None
        train = len(data.train)
        held = len(data.eval) if data.eval is not None and "held out" in str(data.eval_origin) else 0
    if cfg.data.max_train_samples:
        train = min(train, int(cfg.data.max_train_samples))
    return train, held


def check_batches(cfg: Any, world_size: int, conditioning: bool = False) -> None:
    """_setup_data: each rank's share of the training images (ShardedEpochSampler, the tail dropped) must fill a
    micro batch (a DataLoader with drop_last)."""
    train, held = training_rows(cfg, conditioning)
    check_rows_per_rank(train, world_size, key="train.micro_batch_size", value=int(cfg.train.micro_batch_size),
                        unit="images", heldout=held,
                        heldout_key="data.eval_split" if str(cfg.data.eval_split).strip() else "eval.heldout_size")

class SDFinetune(Recipe):
    """diffusers' text-to-image fine-tunes (SD, SDXL) and SD3 / FLUX flow-matching fine-tunes on the shared
    lifecycle; validation grids before, after and every ``validation.every`` steps."""

    name = "sd_finetune"
    headline = (("loss", "held-out diffusion loss", False), ("loss_ema", "held-out diffusion loss of the EMA", False))
    plot_panels = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]
    conditioning = False  # the controlnet recipe adds conditioning images to every batch

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.validations: list[dict[str, Any]] = []
        self.heldout: dict[str, float] = {}  # "<tag>/loss" (and "<tag>/loss_ema")
        self.vae_pretrain: dict[str, Any] | None = None  # pretrain_tiny_vae's result when this run did it
        self._rows: Any = None

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.step_metrics]

    @property
    def builtin_data(self) -> bool:
        return not data_spec(self.cfg)

    @property
    def ema_on(self) -> bool:
        return bool((self.cfg.get("ema") or {}).get("enabled", False))

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        if cfg.mode not in MODES:
            raise RecipeConfigError(f"mode={cfg.mode!r}; use one of {list(MODES)}.")
        # 1. data and model folder: rank 0 generates / builds / downloads while the others wait
        self.data_source = self._data_source()
        self.model_path = self._model_path()
        self.family = model_family(self.model_path)
        self.family_roles = family_roles(self.family)
        check_family_options(cfg, self.family, self.model_path)
        self.denoiser = self.family_roles.denoiser
        self.text_encoders = text_encoder_names(self.model_path)
        # 2. roles: each its own engine with its own placement
        self.add_roles()
        registry.build()
        # 3. the objective of the family, then the data
        self.objective = self.make_objective()
        self._setup_data()

    def placements(self) -> dict[str, Any]:
        roles = self.cfg.roles
        first = placement(roles.text_encoder, trainable=False)
        encoders = {name: first if name == "text_encoder" else placement(roles[name], follow=first, trainable=False)
                    for name in self.text_encoders}
        return {"denoiser": placement(roles[self.denoiser]), "vae": placement(roles.vae, trainable=False),
                "text_encoders": encoders}

    def lora_spec(self) -> LoraSpec | None:
        cfg = self.cfg
        if not cfg.lora.enabled:
            return None
        targets = tuple(cfg.lora.target_modules) or self.family_roles.lora_targets
        return LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha or None, target_modules=targets, init="gaussian")

    def optim_spec(self) -> OptimSpec:
        cfg, t = self.cfg, self.cfg.train
        return OptimSpec(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                         eps=t.adam_epsilon, scheduler=t.lr_scheduler, warmup_steps=t.lr_warmup_steps,
                         total_steps=cfg.max_steps, max_grad_norm=t.max_grad_norm or None)

    def add_roles(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        place = self.placements()
        ema = None
        if cfg.ema.enabled:
            ema = placement({"stage": place["denoiser"].stage, "dtype": cfg.ema.dtype,
                             "offload_params": cfg.ema.offload_params}, trainable=False)
        for spec in diffusion_role_specs(
            self.model_path, mode=cfg.mode, unet=place["denoiser"], vae=place["vae"],
            text_encoder=place["text_encoders"], ema=ema, optim=self.optim_spec(),
            micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
            gradient_checkpointing=t.gradient_checkpointing, lora=self.lora_spec(),
            variant=_cfg_str(cfg.model.variant), seed=cfg.seed, denoiser=self.denoiser,
        ):
            self.registry.add(spec)

    def flow_options(self) -> dict[str, Any]:
        f, defaults = self.cfg.flow, FLOW_FAMILY_DEFAULTS[self.family]
        return {"weighting_scheme": f.weighting_scheme or defaults["weighting_scheme"],
                "logit_mean": f.logit_mean, "logit_std": f.logit_std, "mode_scale": f.mode_scale,
                "precondition_outputs": defaults["precondition_outputs"] if f.precondition_outputs is None
                else bool(f.precondition_outputs), "guidance_scale": f.guidance_scale}

    def make_objective(self) -> Any:
        cfg, t = self.cfg, self.cfg.train
        if self.family_roles.objective == "flow":
            from diffusers import FlowMatchEulerDiscreteScheduler

            config = FlowMatchEulerDiscreteScheduler.load_config(self.model_path, subfolder="scheduler")
            self.prediction_type = None
            return FlowMatchingObjective(self.registry, self.family, config, text_encoders=self.text_encoders,
                                         **self.flow_options())
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_pretrained(self.model_path, subfolder="scheduler")
        self.prediction_type = t.prediction_type or scheduler.config.prediction_type
        return DiffusionObjective(
            self.registry, self.text_encoders, scheduler.alphas_cumprod, prediction_type=self.prediction_type,
            snr_gamma=t.snr_gamma, noise_offset=t.noise_offset, input_perturbation=t.input_perturbation,
            resolution=cfg.data.resolution)

    @property
    def t5_length(self) -> int:
        if self.family_roles.objective != "flow":
            return 0
        return int(self.cfg.flow.max_sequence_length) or FLOW_FAMILY_DEFAULTS[self.family]["max_sequence_length"]

    def _model_path(self) -> str:
        cfg = self.cfg
        if cfg.model.pretrained:
            path = resolve_model_path(cfg.model.pretrained, _cfg_str(cfg.model.revision), _cfg_str(cfg.model.variant))
            if cfg.model.tiny_vae_steps and self.registry.is_main:
                logger.info("model.tiny_vae_steps=%s skipped: model.pretrained=%s brings its own vae",
                            cfg.model.tiny_vae_steps, cfg.model.pretrained)
            return path
        family = str(cfg.model.tiny_family)
        path = self.path(f"tiny_{family}")
        if self.registry.is_main:
            build_tiny_model(path, cfg.seed, cfg.data.resolution, family)
        barrier()
        if cfg.model.tiny_vae_steps:
            self.pretrain_vae(path)
        return path

    def pretrain_vae(self, path: str) -> None:
        """model.tiny_vae_steps on every rank (each encodes and decodes its share of every batch) on the
        training images at data.resolution; rank 0 saves the vae while the others wait."""
        cfg, registry = self.cfg, self.registry
        train = self.rows().train
        if cfg.data.max_train_samples:
            train = train.select(range(min(int(cfg.data.max_train_samples), len(train))))
        if registry.is_main:
            logger.info("model.tiny_vae_steps=%s: the random tiny vae learns the training images first (0 skips "
                        "it)", cfg.model.tiny_vae_steps)
        self.vae_pretrain = pretrain_tiny_vae(
            path, _ImageColumn(train, "image"), int(cfg.model.tiny_vae_steps), seed=cfg.seed,
            resolution=int(cfg.data.resolution), device=registry.device)
        barrier()

    def rows(self) -> Any:
        """load_rows once per run (the vae pre-train and _setup_data share them); rank 0 first, so that it
        writes the datasets cache and the others read it instead of racing to write it."""
        if self._rows is None:
            if not self.registry.is_main:
                barrier()
            self._rows = self.load_rows()
            if self.registry.is_main:
                barrier()
        return self._rows

    def make_builtin_data(self, folder: str) -> None:
        cfg = self.cfg
        data_lib.make_shapes_dataset(folder, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed)

    def _data_source(self) -> Any:
        """data.sources / data.source, or the built-in shapes dataset that rank 0 generates under output_dir/data."""
        if not self.builtin_data:
            return data_spec(self.cfg)
        source = self.path("data", "shapes")
        if self.registry.is_main:
            self.make_builtin_data(source)
        barrier()
        return source

    def tokenizers(self) -> list[Any]:
        from transformers import AutoTokenizer

        return [AutoTokenizer.from_pretrained(self.model_path, subfolder=tokenizer_name(n)) for n in self.text_encoders]

    def token_lengths(self) -> list[int | None]:
        """Padded length per text encoder: CLIP its tokenizer's (77), T5 ``flow.max_sequence_length``."""
        index = read_model_index(self.model_path)
        return [self.t5_length if str(index[n][1]).startswith("T5") else None for n in self.text_encoders]

    def load_rows(self) -> Any:
        cfg = self.cfg
        return data_lib.load_image_caption_data(
            self.data_source, columns=data_columns(cfg), image_column=str(cfg.data.image_column),
            caption_column=str(cfg.data.caption_column), train_split=str(cfg.data.train_split),
            eval_source=_plain(cfg.data.eval_source) or None, eval_split=eval_split_value(cfg), seed=cfg.seed,
            cache_dir=_cfg_str(cfg.data.cache_dir))

    def make_dataset(self, rows: Any, transform: Any) -> Any:
        return data_lib.ImageCaptionDataset(rows, transform, "image", "caption", seed=self.cfg.seed)

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        data = self.rows()
        train_rows = data.train
        if cfg.data.max_train_samples:
            train_rows = train_rows.select(range(min(cfg.data.max_train_samples, len(train_rows))))
        heldout_rows = None
        if data.eval is not None and cfg.eval.heldout_size:
            heldout_rows = data.eval.select(range(min(int(cfg.eval.heldout_size), len(data.eval))))
        self.eval_origin = data.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        tokenizers, lengths = self.tokenizers(), self.token_lengths()
        self.tokenizer_list, self.lengths = tokenizers, lengths
        collate = functools.partial(_collate, tokenizers=tokenizers, lengths=lengths)
        transform = data_lib.ImageTransform(cfg.data.resolution, cfg.data.center_crop, cfg.data.random_flip)
        self.train_set = self.make_dataset(train_rows, transform)
        self.sampler = data_lib.ShardedEpochSampler(len(self.train_set), registry.world_size, registry.rank,
                                                    seed=cfg.seed)
        micro = cfg.train.micro_batch_size
        if len(self.sampler) < micro:
            raise RecipeConfigError(
                f"{len(self.train_set)} training images give {len(self.sampler)} per rank, fewer than "
                f"train.micro_batch_size={micro}; lower train.micro_batch_size or add data.")
        self.loader = torch.utils.data.DataLoader(
            self.train_set, batch_size=micro, sampler=self.sampler, collate_fn=collate, drop_last=True,
            num_workers=cfg.data.num_workers)
        self.consumed = 0  # samples of the current epoch trained on by this rank (the sampler may run ahead)
        self.batches = self._batch_stream()

        # Held-out: deterministic transform, the same number of batches on every rank (lockstep forwards).
        self.heldout_batches: list[dict[str, Any]] = []
        if heldout_rows is not None:
            heldout = self.make_dataset(heldout_rows, data_lib.ImageTransform(cfg.data.resolution, center_crop=True,
                                                                              random_flip=False))
            self.heldout_batches = shard_batches(heldout, collate, micro, registry.world_size, registry.rank)
            if not self.heldout_batches:
                logger.warning("%d held-out rows are fewer than the %d ranks: no held-out loss", len(heldout),
                               registry.world_size)
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """validation.prompts; else the shapes prompts for the built-in data, or the first distinct captions of
        the held-out rows (of the training rows when nothing is held out)."""
        cfg = self.cfg
        if cfg.validation.prompts:
            return [str(p) for p in cfg.validation.prompts]
        if self.builtin_data:
            return list(SHAPES_PROMPTS)
        out: list[str] = []
        for caption in rows["caption"]:
            text = caption[0] if isinstance(caption, (list, tuple)) else caption
            if isinstance(text, str) and text not in out:
                out.append(text)
            if len(out) >= cfg.validation.num_prompts:
                break
        return out

    def _batch_stream(self) -> Iterator[dict[str, Any]]:
        while True:
            if self.sampler.position >= len(self.sampler):
                self.sampler.set_epoch(self.sampler.epoch + 1)
            self.train_set.set_epoch(self.sampler.epoch)  # augmentation follows the sampler's epoch
            self.consumed = self.sampler.position
            for batch in self.loader:
                self.consumed += len(batch["captions"])
                yield batch
            self.consumed = len(self.sampler)  # the dropped tail counts as seen, like the sampler does

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(consumed=self.consumed), "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.heldout = dict(state.get("heldout", {}))
        self.validations = []

    # --- training --------------------------------------------------------------------------------
    @property
    def trained(self) -> str:
        """The trainable role: the denoiser here, the controlnet in the controlnet recipe."""
        return self.denoiser

    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        engine = registry[self.trained]
        micro_losses = []
        for micro in range(engine.gradient_accumulation_steps()):
            # 1. this rank's next micro batch (sharded, resumable sampler)
            batch = next(self.batches)
            # 2. all randomness of the micro batch from (seed, step, micro, rank): stage-independent
            generator = step_generator(cfg.seed, self.step, micro, registry.rank)
            # 3. latents via the vae engine, embeddings via the text-encoder engines, noise, timesteps (DDPM:
            #    uniform; flow: the density), the target and the weighted MSE; the denoiser gathers its
            #    ZeRO-3 shards layer by layer
            out = self.objective.loss(batch, generator)
            # 4. backward through the trainable engine (it divides by the accumulation steps)
            engine.backward(out.loss)
            # 5. optimizer step, gradient clipping and lr schedule at the accumulation boundary only
            engine.step()
            micro_losses.append(out.loss.item())
        # 6. EMA: on matching local partitions (zero3), or by gathering the denoiser (seed_baseline)
        decay = self.update_ema() if self.ema_on else None
        # 7. the loss averaged over micro batches and ranks, lr, memory per role
        record = {**mean_over_ranks({"loss": statistics.fmean(micro_losses)}), "lr": engine.get_lr()[0],
                  **_memory_metrics(registry)}
        if decay is not None:
            record["ema_decay"] = decay
        return record

    def update_ema(self) -> float:
        e = self.cfg.ema
        return update_ema(self.registry, self.step + 1, e.decay, e.use_ema_warmup, min_decay=e.min_decay,
                          update_after_step=e.update_after_step, inv_gamma=e.inv_gamma, power=e.power,
                          source=self.trained)

    def after_step(self, last: bool) -> None:
        every = self.cfg.validation.every
        if every > 0 and self.step % every == 0 and not last:
            self.validate(f"step_{self.step}")

    def heldout_value(self, role: str | None = None) -> float:
        if isinstance(self.objective, FlowMatchingObjective):
            return flow_heldout_loss(self.objective, self.heldout_batches, self.heldout_points, self.cfg.eval.seed,
                                     role=role)
        return heldout_loss(self.objective, self.heldout_batches, self.heldout_points, self.cfg.eval.seed,
                            unet_role=role)

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps (raw denoiser, and the EMA when on), and validation
        images before and after training; all ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            result["loss"] = self.heldout_value()
            if self.ema_on:
                result["loss_ema"] = self.heldout_value("ema")
            for key, value in result.items():
                self.heldout[f"{tag}/{key}"] = value
        if tag in ("before", "after"):
            self.validate(tag)
        return result

    def validation_role(self) -> str:
        cfg = self.cfg
        return "ema" if self.ema_on and cfg.validation.use_ema else self.trained

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"max_sequence_length": self.t5_length} if self.t5_length else {}

    def validate(self, tag: str) -> None:
        """Images for the validation prompts, on all ranks in lockstep; rank 0 saves the labelled grid."""
        cfg, registry = self.cfg, self.registry
        if not cfg.validation.enabled or not self.prompts:
            return
        role = self.validation_role()
        t0 = time.perf_counter()
        pipe = self.validation_pipeline(role)
        module = registry.role(self.trained).module
        was_training = module.training
        module.eval()
        try:
            images = generate(pipe, registry, self.prompts, cfg.data.resolution, cfg.validation.num_inference_steps,
                              cfg.validation.guidance_scale, cfg.validation.seed, **self.pipeline_kwargs())
        finally:
            module.train(was_training)
        del pipe
        path = self.path("validation", f"{self.step:06d}_{tag}.png")
        entry = {"step": self.step, "tag": tag, "file": path, "role": role, "prompts": list(self.prompts),
                 "seconds": time.perf_counter() - t0}
        if registry.is_main:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            grid = self.grid(images)
            grid.save(path)
            with open(self.path("validation", "index.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            # One tag for every validation, so TensorBoard's step slider walks through before/step_N/after.
            self.metrics.log_image(self.step, "validation/grid", grid)
            logger.info("validation grid (%s, step %d, %s): %s", tag, self.step, role, path)
        self.metrics.log(self.step, {"images": len(images), "seconds": entry["seconds"]}, prefix="validation")
        self.validations.append(entry)

    def grid(self, images: list[Any]) -> Any:
        """The labelled grid of one validation: each image with its prompt and the step."""
        return image_grid(images, prompts=self.prompts, step=self.step)

    # --- outputs ---------------------------------------------------------------------------------
    def export_components(self) -> dict[str, str]:
        role = "ema" if self.ema_on else self.trained
        return {self.denoiser: role, "vae": "vae", **{name: name for name in self.text_encoders}}

    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        components = self.export_components()
        written: dict[str, Any] = {"pipeline": export_pipeline(
            registry, self.model_path, self.path("export", "pipeline"), components, dtype=cfg.export.dtype,
            prediction_type=self.prediction_type)}
        if cfg.lora.enabled:
            written["lora"] = save_lora(registry, self.path("export", "lora"), role=components[self.denoiser],
                                        component=self.denoiser, pipeline_class=self.family_roles.pipeline)
        missing = [r for r in cfg.export.roles if r not in registry]
        if missing:
            raise RecipeConfigError(f"export.roles={list(cfg.export.roles)}: {missing} not among this run's roles "
                                    f"{[r.name for r in registry.roles()]}")
        written.update(export_roles(registry, self.path("export"), list(cfg.export.roles), dtype=cfg.export.dtype))
        return written

    def summary_metrics(self) -> dict[str, Any]:
        times = [m["step_time_s"] for m in (self.step_metrics[1:] or self.step_metrics)]
        return {
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "step_time_s_median": statistics.median(times) if times else None,
            **{f"heldout/{k}": v for k, v in self.heldout.items()},
        }

    def summary_extra(self) -> dict[str, Any]:
        extra = {"mode": self.cfg.mode, "family": self.family, "denoiser": self.denoiser,
                 "model_path": self.model_path, "text_encoders": self.text_encoders,
                 "evaluation_rows": self.eval_origin, "validation": self.validations}
        if self.family_roles.objective == "flow":
            extra["flow"] = {**self.flow_options(), "max_sequence_length": self.t5_length}
        if self.vae_pretrain is not None:
            extra["tiny_vae_pretrain"] = self.vae_pretrain
        return extra

    def plot_title(self) -> str:
        return f"{self.name} ({self.family}, {self.registry.world_size} ranks)"


class _ImageColumn(Sequence):
    """One column of a datasets.Dataset as a sequence, each item decoded when indexed (not all at once)."""

    def __init__(self, rows: Any, column: str) -> None:
        self.rows, self.column = rows, column

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[int(index)][self.column]


def build_tiny_model(path: str, seed: int, resolution: int, family: str = "sd") -> str:
    """The embedded default model of ``family`` (``sd``, ``sdxl``, ``sd3``, ``flux``): the tiny builders of
    pipelines/diffusion/tiny.py. An int ``family`` is the removed ``text_encoders`` count: an error."""
    if not isinstance(family, str):
        raise RecipeConfigError(f"build_tiny_model(..., {family!r}): pass the family (sd, sdxl, sd3, flux); "
                                "the text-encoder count is gone (2 text encoders = sdxl).")
    if family not in FAMILIES:
        raise RecipeConfigError(f"model.tiny_family={family!r}; use one of {list(FAMILIES)}.")
    return build_tiny(family, path, seed=seed, resolution=resolution)


def _collate(examples: list[dict[str, Any]], tokenizers: list[Any], lengths: list[int | None]) -> dict[str, Any]:
    """``data.collate`` with ``input_ids`` (``input_ids_2`` ...) per text encoder, each padded to its length."""
    batch = data_lib.collate(examples, tokenizer=tokenizers[0])
    batch.update(prompt_input_ids(tokenizers, batch["captions"], lengths))
    if all("conditioning_pixel_values" in e for e in examples):
        batch["conditioning_pixel_values"] = torch.stack([e["conditioning_pixel_values"] for e in examples])
    return batch


def _memory_metrics(registry: Any) -> dict[str, float]:
    """This rank's bytes per role (params held, grads, optimizer state) and process memory."""
    out: dict[str, float] = {}
    for row in registry.memory_report():
        role = row["role"]
        out[f"mem/{role}/param_bytes"] = row["param_bytes"]
        out[f"mem/{role}/params_local"] = row["params_local"]
        if row["trainable"]:
            out[f"mem/{role}/grad_bytes"] = row["grad_bytes"]
            out[f"mem/{role}/optimizer_bytes"] = row["optimizer_bytes"]
    out["mem/rss_bytes"] = current_rss_bytes()
    if torch.cuda.is_available():
        out["mem/cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["mem/cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


main = SDFinetune.main

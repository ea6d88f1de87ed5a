"""Text-to-image fine-tuning of every diffusers family with every model sharded: the denoiser trainable
(``roles.unet`` for SD 1.x/2.x and SDXL, ``roles.transformer`` for SD3 and FLUX), the vae and each text encoder
frozen, each its own DeepSpeed engine (ZeRO-3 by default), optional EMA (sharded like the denoiser) and LoRA.

    multiengine run sd_finetune --config tiny --nproc-per-node 2                 # tiny SD, CPU
    multiengine run sd_finetune --config tiny_sdxl --nproc-per-node 2            # tiny SDXL / SD3 / FLUX
    multiengine run sd_finetune --config tiny --nproc-per-node 2 mode=seed_baseline
    multiengine run sd_finetune --config sdxl_full --nproc-per-node 8 data.source=/data/my_imagefolder

The family comes from the folder's ``model_index.json`` (``model.tiny_family`` for the embedded tiny model):
SD and SDXL train with the DDPM objective (noise / v-prediction, min-SNR), SD3 and FLUX with rectified flow
matching (timestep density, loss weighting, preconditioning, FLUX guidance, T5 length); both under
``diffusion.*``. ``mode=seed_baseline`` reproduces diffusers' scripts under ZeRO-3 (frozen roles full copies on
every rank, EMA a full copy) for comparison. Writes metrics.jsonl, summary.json, validation grids, checkpoints
and export/ (pipeline/, per-role folders, lora/) under output_dir.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

from multiengine.engines import Placement, barrier, mean_over_ranks
from multiengine.engines.recipe_config import (
    Choice,
    Each,
    Key,
    Length,
    Range,
    RecipeConfigError,
    Satisfies,
    config_problem,
    split_keys,
)
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.export import export_pipeline, export_roles, save_lora
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles, model_family
from multiengine.pipelines.diffusion.flow import SCHEMES
from multiengine.pipelines.diffusion.math import PREDICTION_TYPES
from multiengine.pipelines.diffusion.models import (
    MODES,
    diffusion_role_specs,
    resolve_model_path,
    text_encoder_names,
    update_ema,
)
from multiengine.pipelines.diffusion.runs import (
    SHAPES_PROMPTS,
    ImageColumn,
    TrainImages,
    build_tiny_model,
    collate_captions,
    eval_split_value,
    flow_options,
    held_out_of,
    memory_metrics,
    resolution_multiple,
    run_validation,
    save_validation,
    t5_length,
    text_tokenizers,
    token_lengths,
    validation_captions,
)
from multiengine.pipelines.diffusion.tiny import pretrain_tiny_vae
from multiengine.pipelines.diffusion.training import (
    DiffusionObjective,
    FlowMatchingObjective,
    flow_heldout_loss,
    heldout_loss,
    step_generator,
)
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes.common import check_rows_per_rank, recipe_checks
from multiengine.recipes.lifecycle import COMMON_KEYS, Recipe
from multiengine.recipes.schema import Role, lora_spec, optim_spec, placement, role_keys

__all__ = ["SHAPES_PROMPTS", "build_tiny_model", "check_family_options", "main"]
logger = logging.getLogger(__name__)


def component_model(name: str) -> Key:
    return Key("", f"\"\" = the {name}/ folder of model.pretrained (a component comes from the pipeline folder only)")


# What the trained role (the denoiser; the controlnet in the controlnet recipe) changes from the shared role
# defaults: the tiny run's optimisation, diffusers' AdamW weight decay, LoRA targets from the family.
TRAINED: dict[str, Any] = {
    "dtype": "fp32", "lr": 1e-3, "weight_decay": 1e-2, "scheduler": "constant_with_warmup", "warmup_steps": 5,
    "micro_batch_size": Key(8, "images per rank per forward (global batch = micro x grad_accum x ranks)"),
    "lora": {"target_modules": Key([], "[] = diffusers' targets of the family (unet: to_k/q/v/out.0; SD3/FLUX: "
                                       "their attention projections)")},
}
# Frozen components: fp32 on CPU, gathered whole once per call (one collective; 1/N between calls).
FROZEN: dict[str, Any] = {"dtype": "fp32", "gather_forward": True}
ROLES = (
    Role("unet", "SD 1.x/2.x and SDXL: the denoiser, trained (an SD3/FLUX model refuses these keys: use "
         "roles.transformer)", trainable=True, keys={**TRAINED, "model": component_model("unet")}),
    Role("transformer", "SD3 and FLUX: the denoiser, trained (an SD/SDXL model refuses these keys: use "
         "roles.unet)", trainable=True, keys={**TRAINED, "model": component_model("transformer")}),
    Role("vae", "frozen: latents of the training images, validation decodes", keys={**FROZEN,
                                                                                     "model": component_model("vae")}),
    Role("text_encoder", "frozen: the first text encoder (CLIP-L)",
         keys={**FROZEN, "model": component_model("text_encoder")}),
    Role("text_encoder_2", "frozen: SDXL's and SD3's CLIP-G, FLUX's T5", follows="text_encoder",
         keys={"gather_forward": True, "model": component_model("text_encoder_2")}),
    Role("text_encoder_3", "frozen: SD3's T5", follows="text_encoder",
         keys={"gather_forward": True, "model": component_model("text_encoder_3")}),
)
DENOISERS = ("unet", "transformer")

SD_DATA_KEYS: dict[str, Any] = {  # image-caption rows (docs/data.md)
    "source": Key("", "imagefolder (metadata.jsonl), data file, save_to_disk folder or hub name; \"\" = shapes"),
    "sources": Key([], "several sources with weights: [{path, weight, columns, split}] (instead of data.source)"),
    "columns": Key({"image": Key("", "your image column (\"\" = data.image_column)"),
                    "caption": Key("", "your caption column (\"\" = data.caption_column)")},
                   "your column names per field"),
    "image_column": Key("image", "the image column (alias of data.columns.image)"),
    "caption_column": Key("text", "the caption column (alias of data.columns.caption)"),
    "train_split": Key("train", "the split of a hub dataset or DatasetDict folder to train on"),
    "eval_source": Key("", "separate evaluation rows (same forms as data.source); wins over data.eval_split"),
    "eval_split": Key("", "held-out rows: a fraction (0.05), a count (16), a split name (test); \"\" = "
                          "eval.heldout_size"),
    "check_images": Key(True, "before any rank starts: open every image and list the unreadable ones"),
    "resolution": Key(32, "training (and validation) size in pixels, square"),
    "center_crop": Key(True, "center crop after resizing the shorter side (false: random crop)"),
    "random_flip": Key(False, "random horizontal flip"),
    "builtin_size": Key(136, "images of the built-in shapes dataset (generated under output_dir/data)"),
    "max_train_samples": Key(0, "use only the first N training rows (0 = all)"),
    "num_workers": Key(0, "DataLoader workers per rank"),
    "cache_dir": Key("", "datasets cache folder (\"\" = the default)"),
}
DDPM_KEYS: dict[str, Any] = {
    "prediction_type": Key("", "SD/SDXL: \"\" = the scheduler's; epsilon | v_prediction | sample"),
    "snr_gamma": Key(0.0, "SD/SDXL: > 0 = min-SNR-gamma weighting (5.0 recommended)"),
    "noise_offset": Key(0.0, "SD/SDXL: offset-noise scale"),
    "input_perturbation": Key(0.0, "SD/SDXL: input-perturbation scale"),
}
FLOW_KEYS: dict[str, Any] = {
    "weighting_scheme": Key("", "SD3/FLUX: \"\" = the family's (SD3 logit_normal, FLUX none); or uniform, mode, "
                                "cosmap, ..."),
    "logit_mean": Key(0.0, "SD3/FLUX: logit_normal density: mean"),
    "logit_std": Key(1.0, "SD3/FLUX: logit_normal density: standard deviation"),
    "mode_scale": Key(1.29, "SD3/FLUX: mode density: scale"),
    "precondition_outputs": Key(None, "SD3/FLUX: null = the family's (SD3 true, FLUX false): x0 loss of noisy - "
                                      "sigma * pred"),
    "guidance_scale": Key(3.5, "FLUX with a guidance embedding: the guidance input during training"),
    "max_sequence_length": Key(0, "SD3/FLUX: T5 tokens per caption; 0 = the family's (SD3 77, FLUX 512)"),
}
DIFFUSION_KEYS = Key({
    "adam_epsilon": Key(1e-8, "AdamW epsilon of the trained role (diffusers' scripts' --adam_epsilon)"),
    **DDPM_KEYS, **FLOW_KEYS,
}, "the objective: DDPM (SD, SDXL) or rectified flow matching (SD3, FLUX), as diffusers' training scripts")
EMA_KEYS = Key({
    "enabled": Key(True, "keep an EMA role (sharded like the denoiser; exported in the pipeline when on)"),
    "decay": Key(0.99, "the largest decay (diffusers' EMAModel default 0.9999 suits long runs)"),
    "use_ema_warmup": Key(False, "true: 1 - (1 + s/inv_gamma)^-power; false: (1 + s) / (10 + s)"),
    "min_decay": Key(0.0, "the smallest decay after the first update"),
    "update_after_step": Key(0, "copy the weights (decay 0) for this many steps first"),
    "inv_gamma": Key(1.0, "warmup: inverse multiplicative factor"),
    "power": Key(2 / 3, "warmup: exponent (2/3 for long runs, 3/4 for short ones)"),
    "dtype": Key("fp32", "EMA weights' dtype (bf16 would round away small updates)"),
    "offload_params": Key(False, "ZeRO-3 parameter offload of the EMA to the host"),
}, "EMA of the denoiser, diffusers' EMAModel options")
VALIDATION_KEYS: dict[str, Any] = {  # images generated before, after and every N steps
    "enabled": Key(True, "validation grids before and after training (and every `every` steps when > 0)"),
    "every": Key(100, "also every N steps (0 = only before and after)"),
    "prompts": Key([], "[] = the shapes prompts (built-in data) or captions of your held-out rows"),
    "num_prompts": Key(4, "how many held-out captions when validation.prompts is []"),
    "num_inference_steps": Key(20, "sampler steps"),
    "guidance_scale": Key(None, "null = the pipeline's default (SD/SDXL 7.5, SD3 7.0, FLUX 3.5)"),
    "seed": Key(0, "the sampler's seed (the same images on every rank)"),
    "use_ema": Key(True, "generate with the EMA weights when EMA is on (as diffusers' examples)"),
}
EVAL_KEYS = Key({
    "heldout_size": Key(8, "held-out rows for the loss (taken from the data unless eval_source/eval_split); 0 = none"),
    "timesteps": Key(8, "evenly spaced timesteps (schedule positions) per held-out image"),
    "every": Key(0, "also every N steps when > 0 (always before and after)"),
    "seed": Key(1234, "the held-out noise's seed"),
}, "held-out loss at fixed noise and timesteps")
MODEL_KEYS: dict[str, Any] = {
    "pretrained": Key("", "the diffusers pipeline folder or hub name (SD, SDXL, SD3, FLUX) every roles.<component> "
                          "comes from; \"\" = the tiny model of model.tiny_family, built here"),
    "revision": Key("", "hub revision (\"\" = main)"),
    "variant": Key("", "weight variant passed to from_pretrained (e.g. fp16; \"\" = the default weights)"),
    "tiny_family": Key("sd", "tiny model only: sd | sdxl | sd3 | flux"),
    "tiny_vae_steps": Key(300, "tiny model only: pretrain its random vae on the training images first (0 = no)"),
}
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/sd_finetune", "everything the run writes goes under this folder"),
    "max_steps": Key(200, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (diffusers' layout: frozen roles whole)"),
    "model": Key(MODEL_KEYS, "the diffusers pipeline folder to fine-tune"),
    "roles": role_keys(ROLES),
    "diffusion": DIFFUSION_KEYS,
    "data": Key(SD_DATA_KEYS, "image-caption rows (docs/data.md)"),
    "ema": EMA_KEYS,
    "validation": Key(VALIDATION_KEYS, "images generated before, after and every N steps"),
    "eval": EVAL_KEYS,
    "export": Key({
        "enabled": Key(True, "write export/pipeline (and export/lora for LoRA runs)"),
        "dtype": Key("fp32", "dtype of every exported component"),
        "roles": Key([], "per-role folders besides the pipeline, e.g. [unet, ema] ([] = none)"),
    }, "outputs under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
_DTYPE = Choice("fp32", "bf16", "fp16")


def diffusion_checks(trained: str, tiny_families: tuple[str, ...]) -> dict[str, Any]:
    """The checks sd_finetune and controlnet share beyond the by-name ones."""
    return {
        "mode": Choice(*MODES), "model.tiny_family": Choice(*tiny_families), "model.tiny_vae_steps": Range(0),
        "data.resolution": Range(8), "data.builtin_size": Range(2), "data.max_train_samples": Range(0),
        "data.num_workers": Range(0), "data.eval_split": Satisfies(lambda v: isinstance(v, str), "\"\", a fraction, "
                                                                   "a count or a split name"),
        f"roles.{trained}.lora.target_modules": Each(Length(1)), "diffusion.adam_epsilon": Range(0, min_exclusive=True),
        "diffusion.prediction_type": Choice("", *PREDICTION_TYPES), "diffusion.snr_gamma": Range(0),
        "diffusion.noise_offset": Range(0), "diffusion.input_perturbation": Range(0),
        "validation.prompts": Each(Length(1)), "validation.num_prompts": Range(1),
        "validation.num_inference_steps": Range(1), "validation.guidance_scale": Range(0, allow_none=True),
        "eval.timesteps": Range(1), "export.dtype": _DTYPE,
    }


CHECKS = recipe_checks(DEFAULTS, {
    **diffusion_checks("unet", FAMILIES), "roles.transformer.lora.target_modules": Each(Length(1)),
    "diffusion.weighting_scheme": Choice("", *SCHEMES), "diffusion.logit_std": Range(0, min_exclusive=True),
    "diffusion.mode_scale": Range(0), "diffusion.precondition_outputs": Choice(True, False, allow_none=True),
    "diffusion.guidance_scale": Range(0), "diffusion.max_sequence_length": Range(0),
    "ema.min_decay": Range(0, 1), "ema.update_after_step": Range(0), "ema.inv_gamma": Range(0, min_exclusive=True),
    "ema.power": Range(0, min_exclusive=True), "ema.dtype": _DTYPE,
    "export.roles": Each(Choice(*(r.name for r in ROLES), "ema")),
})


def renamed(trained: str, hint: str = "") -> dict[str, str]:
    """The old keys (train.*, lora.*, flow.*) -> their new names; ``hint`` follows a role key's new name."""
    new = f"roles.{trained}"
    out = {f"train.{k}": f"{new}.{k}{hint}" for k in ("micro_batch_size", "grad_accum", "lr", "max_grad_norm",
                                                       "gradient_checkpointing")}
    out.update({"train.lr_scheduler": f"{new}.scheduler{hint}", "train.lr_warmup_steps": f"{new}.warmup_steps{hint}",
                "train.adam_weight_decay": f"{new}.weight_decay{hint}",
                "train.adam_beta1": f"{new}.betas (a list [beta1, beta2]){hint}",
                "train.adam_beta2": f"{new}.betas (a list [beta1, beta2]){hint}",
                "train.adam_epsilon": "diffusion.adam_epsilon", "train.*": "diffusion.*", "flow.*": "diffusion.*",
                "lora.enabled": f"{new}.lora.r (to the adapter rank, e.g. 4; 0 = no LoRA){hint}",
                "lora.rank": f"{new}.lora.r{hint}", "lora.*": f"{new}.lora.*",
                "model.tiny_text_encoders": "model.tiny_family (sdxl: two text encoders)",
                "ema.max_decay": "ema.decay", "ema.warmup": "ema.use_ema_warmup"})
    return out


RENAMED = renamed("unet", " (roles.transformer.* for SD3/FLUX)")


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def check_components(cfg: Any, roles: tuple[str, ...]) -> None:
    """Every component comes from model.pretrained: a role's own model or tokenizer folder is refused."""
    for name in roles:
        for key in ("model", "tokenizer"):
            if cfg.roles[name][key]:
                raise config_problem(f"roles.{name}.{key}", cfg.roles[name][key], "is not supported: every component "
                                     "is loaded from the pipeline folder model.pretrained",
                                     f"set roles.{name}.{key}=\"\" and point model.pretrained at a diffusers folder "
                                     "holding this component")


def check_family_options(cfg: Any, family: str, where: str = "") -> None:
    """The settings of what this family does not have are an error, never silently ignored: the other
    denoiser's role keys, and the other objective's diffusion.* keys."""
    suffix = f" ({where})" if where else ""
    denoiser = family_roles(family).denoiser
    other = "transformer" if denoiser == "unet" else "unet"
    given = _flat(_plain(cfg.roles[other]))
    for key, default in _flat(DEFAULTS["roles"][other]).items():
        if given[key] != default:
            raise config_problem(f"roles.{other}.{key}", given[key], f"is set, but this {family} model has no "
                                 f"{other}{suffix}: its denoiser is roles.{denoiser}",
                                 f"set roles.{denoiser}.{key} instead")
    ddpm = family_roles(family).objective != "flow"
    for key, default in (FLOW_KEYS if ddpm else DDPM_KEYS).items():
        if cfg.diffusion[key] != default.default:
            kind = "flow-matching families (sd3, flux)" if ddpm else "DDPM families (sd, sdxl)"
            raise config_problem(f"diffusion.{key}", cfg.diffusion[key], f"applies to the {kind}, not to this "
                                 f"{family} model{suffix}", f"drop diffusion.{key}")


def model_folder_family(cfg: Any) -> str:
    """The family of model.pretrained (a local folder, checked), model.tiny_family when empty, "" for a hub name."""
    from multiengine.pipelines.checks import check_diffusers_folder, check_model_folder

    if not cfg.model.pretrained:
        return str(cfg.model.tiny_family)
    path = str(cfg.model.pretrained)
    try:
        if check_model_folder(path, "model.pretrained", kind="diffusers") != "local":
            return ""
        check_diffusers_folder(path, "model.pretrained")
        return model_family(os.path.expanduser(path))
    except (ValueError, FileNotFoundError) as exc:
        raise _data_problem("model.pretrained", path, "is not a usable diffusers folder", exc,
                            named=("model.pretrained",)) from None


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts, without building a model: the model folder (and its family's options), the
    data sources, columns and rows, held-out size against the rows, every image readable, and a micro batch of
    training images per rank on ``world_size`` ranks."""
    check_components(cfg, tuple(r.name for r in ROLES))
    family = model_folder_family(cfg)
    if family:
        check_family_options(cfg, family)
        validate_resolution(cfg, family, str(cfg.model.pretrained))
        denoiser = family_roles(family).denoiser
    else:  # a hub name: the family is known once downloaded; the denoiser the config sets, else the unet
        denoiser = "transformer" if _flat(_plain(cfg.roles.transformer)) != _flat(DEFAULTS["roles"]["transformer"]) \
            else "unet"
    check_data(cfg)
    check_batches(cfg, world_size, denoiser)


def validate_resolution(cfg: Any, family: str, path: str) -> None:
    folder = os.path.expanduser(path) if path and os.path.isdir(os.path.expanduser(path)) else None
    multiple, res = resolution_multiple(family, folder), int(cfg.data.resolution)
    if res % multiple:
        raise config_problem("data.resolution", res, f"is not a multiple of {multiple}, which this {family} model "
                             "needs (vae downsampling x the denoiser's patches / levels)",
                             f"use data.resolution={max(multiple, res // multiple * multiple)}")


def _data_problem(key: str, spec: Any, problem: str, exc: Exception,
                  named: tuple[str, ...] = ("data.source", "data.eval_source")) -> RecipeConfigError:
    """A data or model-folder error as the config error: as it is when it already names its key."""
    return RecipeConfigError(str(exc)) if str(exc).startswith(named) else config_problem(key, spec, problem, str(exc))


def data_args(cfg: Any, conditioning: bool = False) -> dict[str, Any]:
    """load_image_caption_data's / check_image_caption_data's arguments from the data section."""
    columns = {k: str(v) for k, v in _plain(cfg.data.columns).items() if v}
    extra = None
    if conditioning:  # the conditioning images load as an extra image column
        extra = {"conditioning_image": columns.pop("conditioning_image", "conditioning_image")}
    return {"columns": columns, "image_column": str(cfg.data.image_column),
            "caption_column": str(cfg.data.caption_column), "cache_dir": str(cfg.data.cache_dir) or None,
            "extra": extra}


def data_spec(cfg: Any) -> Any:
    """The training source(s): ``data.sources`` when given, else ``data.source``."""
    return _plain(cfg.data.sources) or str(cfg.data.source)


def check_data(cfg: Any, conditioning: bool = False) -> dict[str, Any] | None:
    """The user's data: each source exists, has the columns and rows, enough rows for the held-out split,
    and (``data.check_images``) every image opens. The built-in data needs only its sizes."""
    from multiengine.pipelines.sources import DataSourceError

    spec, heldout = data_spec(cfg), int(cfg.eval.heldout_size)
    if not spec:
        if not str(cfg.data.eval_split).strip() and not cfg.data.eval_source and heldout >= cfg.data.builtin_size:
            raise config_problem("eval.heldout_size", heldout, f"leaves no training rows of the built-in data "
                                 f"({cfg.data.builtin_size} images)",
                                 f"set eval.heldout_size below {cfg.data.builtin_size} or raise data.builtin_size")
        return None
    key = "data.sources" if _plain(cfg.data.sources) else "data.source"
    args = data_args(cfg, conditioning)
    extra, split = args.pop("extra"), str(cfg.data.train_split)
    try:
        report = data_lib.check_image_caption_data(spec, split=split, key=key, extra_image_columns=extra, **args)
    except (DataSourceError, ValueError, FileNotFoundError) as exc:
        raise _data_problem(key, spec, "cannot be used as image-caption data", exc) from None
    held = eval_split_value(cfg.data.eval_split, cfg.eval.heldout_size)
    if not cfg.data.eval_source and isinstance(held, int) and held >= report["rows"]:
        name = "eval.heldout_size" if not str(cfg.data.eval_split).strip() else "data.eval_split"
        raise config_problem(name, held, f"holds out every row of the data ({report['rows']} rows)",
                             f"set {name} below {report['rows']}")
    if cfg.data.check_images:
        bad = data_lib.unreadable_images(spec, split=split, extra_image_columns=extra, **args)
        if bad:
            shown = "; ".join(bad[:10]) + (f"; ... ({len(bad)} in all)" if len(bad) > 10 else "")
            raise config_problem(key, spec, f"has {len(bad)} unreadable image(s): {shown}",
                                 "remove or replace those files (or set data.check_images=false to find them "
                                 "only when training reads them)")
    return report


def load_rows(cfg: Any, source: Any, conditioning: bool = False) -> Any:
    args = data_args(cfg, conditioning)
    return data_lib.load_image_caption_data(
        source, train_split=str(cfg.data.train_split), eval_source=_plain(cfg.data.eval_source) or None,
        eval_split=eval_split_value(cfg.data.eval_split, cfg.eval.heldout_size), seed=cfg.seed,
        extra_images=args.pop("extra"), **args)


def check_batches(cfg: Any, world_size: int, trained: str, conditioning: bool = False) -> None:
    """Each rank's share of the training images (ShardedEpochSampler, the tail dropped) must fill a micro
    batch (a DataLoader with drop_last); rows counted as the run will have them."""
    spec, split = data_spec(cfg), eval_split_value(cfg.data.eval_split, cfg.eval.heldout_size)
    if not spec:
        n = int(cfg.data.builtin_size)
        held = 0 if cfg.data.eval_source else held_out_of(n, split)
        train = n - held
    else:
        try:
            data = load_rows(cfg, spec, conditioning)
        except (ValueError, FileNotFoundError) as exc:
            key = "data.sources" if _plain(cfg.data.sources) else "data.source"
            raise _data_problem(key, spec, "cannot be split into training and evaluation rows", exc) from None
        train = len(data.train)
        held = len(data.eval) if data.eval is not None and "held out" in str(data.eval_origin) else 0
    if cfg.data.max_train_samples:
        train = min(train, int(cfg.data.max_train_samples))
    check_rows_per_rank(train, world_size, key=f"roles.{trained}.micro_batch_size",
                        value=int(cfg.roles[trained].micro_batch_size), unit="images", heldout=held,
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

    @property
    def trained(self) -> str:
        """The trainable role: the denoiser here, the controlnet in the controlnet recipe."""
        return self.denoiser

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. data and model folder: rank 0 generates / builds / downloads while the others wait
        self.data_source = self._data_source()
        self.model_path = self._model_path()
        self.family = model_family(self.model_path)
        self.family_roles = family_roles(self.family)
        self.denoiser = self.family_roles.denoiser
        self.check_family(self.model_path)
        self.text_encoders = text_encoder_names(self.model_path)
        self.t5_length = t5_length(self.family, cfg.diffusion.get("max_sequence_length", 0))
        # 2. roles: each its own engine with its own placement
        self.add_roles()
        registry.build()
        # 3. the objective of the family, then the data
        self.objective = self.make_objective()
        self._setup_data()

    def check_family(self, where: str) -> None:
        check_family_options(self.cfg, self.family, where)

    def add_roles(self) -> None:
        cfg, d = self.cfg, self.denoiser
        place = placement(cfg, ROLES, d)
        ema = Placement(stage=place.stage, dtype=str(cfg.ema.dtype), offload_params=bool(cfg.ema.offload_params)) \
            if cfg.ema.enabled else None
        lora = lora_spec(cfg, d, init="gaussian", target_modules=tuple(cfg.roles[d].lora.target_modules)
                         or self.family_roles.lora_targets)
        for spec in diffusion_role_specs(
            self.model_path, mode=cfg.mode, unet=place, vae=placement(cfg, ROLES, "vae"),
            text_encoder={n: placement(cfg, ROLES, n) for n in self.text_encoders}, ema=ema,
            optim=optim_spec(cfg, d, cfg.max_steps, eps=float(cfg.diffusion.adam_epsilon)),
            micro_batch_size=cfg.roles[d].micro_batch_size, grad_accum=cfg.roles[d].grad_accum,
            gradient_checkpointing=cfg.roles[d].gradient_checkpointing, lora=lora,
            variant=str(cfg.model.variant) or None, seed=cfg.seed, denoiser=d,
        ):
            self.registry.add(spec)

    def flow_options(self) -> dict[str, Any]:
        f = self.cfg.diffusion
        return flow_options(self.family, weighting_scheme=f.weighting_scheme, logit_mean=f.logit_mean,
                            logit_std=f.logit_std, mode_scale=f.mode_scale,
                            precondition_outputs=f.precondition_outputs, guidance_scale=f.guidance_scale)

    def ddpm_scheduler(self) -> Any:
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_pretrained(self.model_path, subfolder="scheduler")
        self.prediction_type = self.cfg.diffusion.prediction_type or scheduler.config.prediction_type
        return scheduler

    def make_objective(self) -> Any:
        cfg, d = self.cfg, self.cfg.diffusion
        if self.family_roles.objective == "flow":
            from diffusers import FlowMatchEulerDiscreteScheduler

            config = FlowMatchEulerDiscreteScheduler.load_config(self.model_path, subfolder="scheduler")
            self.prediction_type = None
            return FlowMatchingObjective(self.registry, self.family, config, text_encoders=self.text_encoders,
                                         **self.flow_options())
        scheduler = self.ddpm_scheduler()
        return DiffusionObjective(
            self.registry, self.text_encoders, scheduler.alphas_cumprod, prediction_type=self.prediction_type,
            snr_gamma=d.snr_gamma, noise_offset=d.noise_offset, input_perturbation=d.input_perturbation,
            resolution=cfg.data.resolution)

    def _model_path(self) -> str:
        cfg = self.cfg
        if cfg.model.pretrained:
            variant = str(cfg.model.variant) or None
            path = resolve_model_path(cfg.model.pretrained, str(cfg.model.revision) or None, variant)
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
            path, ImageColumn(train, "image"), int(cfg.model.tiny_vae_steps), seed=cfg.seed,
            resolution=int(cfg.data.resolution), device=registry.device)
        barrier()

    def rows(self) -> Any:
        """The rows once per run (the vae pre-train and _setup_data share them); rank 0 first, so that it
        writes the datasets cache and the others read it instead of racing to write it."""
        if self._rows is None:
            if not self.registry.is_main:
                barrier()
            self._rows = load_rows(self.cfg, self.data_source, self.conditioning)
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

    def make_dataset(self, rows: Any, transform: Any) -> Any:
        return data_lib.ImageCaptionDataset(rows, transform, "image", "caption", seed=self.cfg.seed)

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        data = self.rows()
        train_rows, heldout_rows = data.train, None
        if cfg.data.max_train_samples:
            train_rows = train_rows.select(range(min(cfg.data.max_train_samples, len(train_rows))))
        if data.eval is not None and cfg.eval.heldout_size:
            heldout_rows = data.eval.select(range(min(int(cfg.eval.heldout_size), len(data.eval))))
        self.eval_origin = data.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        tokenizers = text_tokenizers(self.model_path, self.text_encoders)
        lengths = token_lengths(self.model_path, self.text_encoders, self.t5_length)

        def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
            return collate_captions(examples, tokenizers, lengths)

        res = cfg.data.resolution
        self.train_set = self.make_dataset(train_rows, data_lib.ImageTransform(res, cfg.data.center_crop,
                                                                               cfg.data.random_flip))
        heldout = None if heldout_rows is None else self.make_dataset(heldout_rows, data_lib.ImageTransform(
            res, center_crop=True, random_flip=False))
        micro = int(cfg.roles[self.trained].micro_batch_size)
        try:
            self.images = TrainImages(self.train_set, heldout, collate, micro_batch_size=micro,
                                      world_size=registry.world_size, rank=registry.rank, seed=cfg.seed,
                                      num_workers=cfg.data.num_workers)
        except ValueError as exc:
            raise RecipeConfigError(f"{exc}: lower roles.{self.trained}.micro_batch_size or add data.") from None
        self.batches, self.heldout_batches = self.images.stream(), self.images.heldout
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """validation.prompts; else the shapes prompts for the built-in data, or the first distinct captions of
        the held-out rows (of the training rows when nothing is held out)."""
        cfg = self.cfg
        if cfg.validation.prompts:
            return [str(p) for p in cfg.validation.prompts]
        return list(SHAPES_PROMPTS) if self.builtin_data else validation_captions(rows["caption"],
                                                                                  cfg.validation.num_prompts)

    @property
    def sampler(self) -> Any:
        return self.images.sampler

    @property
    def consumed(self) -> int:
        return self.images.consumed

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.images.state_dict(), "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.images.sampler.load_state_dict(state["sampler"])
        self.heldout = dict(state.get("heldout", {}))
        self.validations = []

    # --- training --------------------------------------------------------------------------------
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
                  **memory_metrics(registry)}
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

    # --- evaluation ------------------------------------------------------------------------------
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
        return "ema" if self.ema_on and self.cfg.validation.use_ema else self.trained

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"max_sequence_length": self.t5_length} if self.t5_length else {}

    def validate(self, tag: str) -> None:
        """Images for the validation prompts, on all ranks in lockstep; rank 0 saves the labelled grid."""
        v, registry = self.cfg.validation, self.registry
        if not v.enabled or not self.prompts:
            return
        role, t0 = self.validation_role(), time.perf_counter()
        pipe = self.validation_pipeline(role)
        images = run_validation(registry, pipe, self.trained, self.prompts, resolution=self.cfg.data.resolution,
                                steps=v.num_inference_steps, guidance_scale=v.guidance_scale, seed=v.seed,
                                **self.pipeline_kwargs())
        del pipe
        entry = {"step": self.step, "tag": tag, "file": self.path("validation", f"{self.step:06d}_{tag}.png"),
                 "role": role, "prompts": list(self.prompts), "seconds": time.perf_counter() - t0}
        if registry.is_main:
            grid = self.grid(images)
            save_validation(entry["file"], entry, grid)
            # One tag for every validation, so TensorBoard's step slider walks through before/step_N/after.
            self.metrics.log_image(self.step, "validation/grid", grid)
            logger.info("validation grid (%s, step %d, %s): %s", tag, self.step, role, entry["file"])
        self.metrics.log(self.step, {"images": len(images), "seconds": entry["seconds"]}, prefix="validation")
        self.validations.append(entry)

    def grid(self, images: list[Any]) -> Any:
        """The labelled grid of one validation: each image with its prompt and the step."""
        return image_grid(images, prompts=self.prompts, step=self.step)

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        role = "ema" if self.ema_on else self.trained
        components = {self.denoiser: role, "vae": "vae", **{name: name for name in self.text_encoders}}
        written: dict[str, Any] = {"pipeline": export_pipeline(
            registry, self.model_path, self.path("export", "pipeline"), components, dtype=cfg.export.dtype,
            prediction_type=self.prediction_type)}
        if cfg.roles[self.denoiser].lora.r:
            written["lora"] = save_lora(registry, self.path("export", "lora"), role=role, component=self.denoiser,
                                        pipeline_class=self.family_roles.pipeline)
        missing = [r for r in cfg.export.roles if r not in registry]
        if missing:
            raise RecipeConfigError(f"export.roles={list(cfg.export.roles)}: {missing} not among this run's roles "
                                    f"{[r.name for r in registry.roles()]}")
        written.update(export_roles(registry, self.path("export"), list(cfg.export.roles), dtype=cfg.export.dtype))
        return written

    def summary_metrics(self) -> dict[str, Any]:
        times = [m["step_time_s"] for m in (self.step_metrics[1:] or self.step_metrics)]
        return {"first_loss": self.losses[0] if self.losses else None,
                "final_loss": self.losses[-1] if self.losses else None,
                "step_time_s_median": statistics.median(times) if times else None,
                **{f"heldout/{k}": v for k, v in self.heldout.items()}}

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


main = SDFinetune.main

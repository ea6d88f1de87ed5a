"""What the diffusion recipes share: the key sections of sd_finetune and controlnet (model folder, image data, DDPM
objective, validation, held-out loss), their checks and old names, the reading of them into the diffusion
pipelines' flat inputs; and the roles and checks of the RL recipes (diffusion_grpo, diffusion_dpo)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multiengine.engines.recipe_config import (
    Choice,
    Each,
    Key,
    Length,
    Range,
    Satisfies,
    config_problem,
    flatten,
    plain,
)
from multiengine.engines.role_schema import Role
from multiengine.pipelines.checks import check_rows_per_rank
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles
from multiengine.pipelines.diffusion.flow import SCHEMES
from multiengine.pipelines.diffusion.inputs import (
    ImageData,
    check_config_folder,
    check_resolution,
    model_folder_family,
)
from multiengine.pipelines.diffusion.math import PREDICTION_TYPES


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


def component_roles(*encoders: str, vae: str = "frozen: latents of the training images, validation decodes"
                    ) -> tuple[Role, ...]:
    """The frozen vae and text encoders, every one from its folder of model.pretrained; ``encoders``: the help of
    text_encoder_2, text_encoder_3, ... (each follows text_encoder's placement)."""
    return (Role("vae", vae, keys={**FROZEN, "model": component_model("vae")}),
            Role("text_encoder", "frozen: the first text encoder (CLIP-L)",
                 keys={**FROZEN, "model": component_model("text_encoder")}),
            *(Role(f"text_encoder_{i}", text, follows="text_encoder",
                   keys={"gather_forward": True, "model": component_model(f"text_encoder_{i}")})
              for i, text in enumerate(encoders, start=2)))


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
                          "eval.heldout_size",
                      Satisfies(lambda v: isinstance(v, str), "\"\", a fraction, a count or a split name")),
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
    "prediction_type": Key("", "SD/SDXL: \"\" = the scheduler's; epsilon | v_prediction | sample",
                           Choice("", *PREDICTION_TYPES)),
    "snr_gamma": Key(0.0, "SD/SDXL: > 0 = min-SNR-gamma weighting (5.0 recommended)", Range(0)),
    "noise_offset": Key(0.0, "SD/SDXL: offset-noise scale", Range(0)),
    "input_perturbation": Key(0.0, "SD/SDXL: input-perturbation scale", Range(0)),
}
FLOW_KEYS: dict[str, Any] = {
    "weighting_scheme": Key("", "SD3/FLUX: \"\" = the family's (SD3 logit_normal, FLUX none); or uniform, mode, "
                                "cosmap, ...", Choice("", *SCHEMES)),
    "logit_mean": Key(0.0, "SD3/FLUX: logit_normal density: mean"),
    "logit_std": Key(1.0, "SD3/FLUX: logit_normal density: standard deviation", Range(0, min_exclusive=True)),
    "mode_scale": Key(1.29, "SD3/FLUX: mode density: scale", Range(0)),
    "precondition_outputs": Key(None, "SD3/FLUX: null = the family's (SD3 true, FLUX false): x0 loss of noisy - "
                                      "sigma * pred", Choice(True, False, allow_none=True)),
    "guidance_scale": Key(3.5, "FLUX with a guidance embedding: the guidance input during training"),
    "max_sequence_length": Key(0, "SD3/FLUX: T5 tokens per caption; 0 = the family's (SD3 77, FLUX 512)"),
}
VALIDATION_KEYS: dict[str, Any] = {  # images generated before, after and every N steps
    "enabled": Key(True, "validation grids before and after training (and every `every` steps when > 0)"),
    "every": Key(100, "also every N steps (0 = only before and after)"),
    "prompts": Key([], "[] = the shapes prompts (built-in data) or captions of your held-out rows", Each(Length(1))),
    "num_prompts": Key(4, "how many held-out captions when validation.prompts is []", Range(1)),
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
    "tiny_family": Key("sd", "tiny model only: sd | sdxl | sd3 | flux", Choice(*FAMILIES)),
    "tiny_vae_steps": Key(300, "tiny model only: pretrain its random vae on the training images first (0 = no)"),
}


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


def check_family_options(cfg: Any, family: str, role_defaults: Mapping[str, Any], where: str = "") -> None:
    """The settings of what this family does not have are an error, never silently ignored: the other
    denoiser's role keys (set to other than ``role_defaults``, the recipe's defaults of the roles section), and the
    other objective's diffusion.* keys."""
    suffix = f" ({where})" if where else ""
    denoiser = family_roles(family).denoiser
    other = "transformer" if denoiser == "unet" else "unet"
    defaults = flatten(role_defaults[other])
    for key, value in flatten(cfg.roles[other]).items():
        if value != defaults[key]:
            raise config_problem(f"roles.{other}.{key}", value, f"is set, but this {family} model has no "
                                 f"{other}{suffix}: its denoiser is roles.{denoiser}", f"set roles.{denoiser}.{key} "
                                 "instead")
    ddpm = family_roles(family).objective != "flow"
    for key, default in (FLOW_KEYS if ddpm else DDPM_KEYS).items():
        if cfg.diffusion[key] != default.default:
            kind = "flow-matching families (sd3, flux)" if ddpm else "DDPM families (sd, sdxl)"
            raise config_problem(f"diffusion.{key}", cfg.diffusion[key], f"applies to the {kind}, not to this "
                                 f"{family} model{suffix}", f"drop diffusion.{key}")


def check_model(cfg: Any, components: tuple[str, ...], resolution_key: str = "data.resolution") -> str:
    """Every one of the ``components`` comes from model.pretrained (a role's own model or tokenizer folder is
    refused), and the image side at ``resolution_key`` suits the family of the pipeline folder (the tiny model's
    without one); returns that family, "" for a hub name (its family is known once downloaded). Before any rank
    starts."""
    from omegaconf import OmegaConf

    for name in components:
        for key in ("model", "tokenizer"):
            if cfg.roles[name][key]:
                raise config_problem(f"roles.{name}.{key}", cfg.roles[name][key], "is not supported: every component "
                                     "is loaded from the pipeline folder model.pretrained",
                                     f"set roles.{name}.{key}=\"\" and point model.pretrained at a diffusers folder "
                                     "holding this component")
    family = model_folder_family(str(cfg.model.pretrained), str(cfg.model.tiny_family))
    if family:
        resolution = int(OmegaConf.select(cfg, resolution_key))
        check_resolution(resolution, family, str(cfg.model.pretrained), resolution_key)
    return family


def image_data(cfg: Any, conditioning: bool = False) -> ImageData:
    """The data section (and eval.heldout_size) as the pipelines' flat ImageData."""
    d = cfg.data
    return ImageData(
        source=str(d.source), sources=plain(d.sources) or (), columns={k: str(v) for k, v in plain(d.columns).items()
                                                                      if v},
        image_column=str(d.image_column), caption_column=str(d.caption_column), train_split=str(d.train_split),
        eval_source=plain(d.eval_source) or None, eval_split=str(d.eval_split), heldout_size=int(cfg.eval.heldout_size),
        builtin_size=int(d.builtin_size), max_train_samples=int(d.max_train_samples), check_images=bool(d.check_images),
        cache_dir=str(d.cache_dir) or None, seed=int(cfg.seed), conditioning=conditioning)


def check_data(cfg: Any, world_size: int, trained: str, conditioning: bool = False) -> None:
    """The data (sources, columns, held-out split, images), then a micro batch of training images per rank on
    ``world_size`` ranks (ShardedEpochSampler drops each epoch's tail; rows counted as the run will have them)."""
    data = image_data(cfg, conditioning)
    data.check()
    train, held = data.training_rows()
    check_rows_per_rank(train, world_size, key=f"roles.{trained}.micro_batch_size",
                        value=int(cfg.roles[trained].micro_batch_size), unit="images", heldout=held,
                        heldout_key=data.split_key)


# --- the diffusion RL recipes (diffusion_grpo, diffusion_dpo) ----------------------------------------------
POLICY: dict[str, Any] = {
    "dtype": "fp32", "stage": 2, "lr": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0,
    "model": Key("", "a folder holding the denoiser (config.json + weights, e.g. an export's unet/); \"\" = the "
                     "unet/ or transformer/ of model.pretrained"),
    "micro_batch_size": Key(16, "images per rank per rollout (prompts x diffusion.group_size)"),
    "grad_accum": Key(1, "rollouts per optimizer step (each trains on its sampled steps; the engine accumulates "
                         "grad_accum x the trained steps)"),
    "lora": {"target_modules": Key([], "[] = diffusers' targets of the family")},
}
RL_MODEL_KEYS = Key({
    **MODEL_KEYS,
    "tiny_vae_steps": Key(100, "tiny model only: pretrain its random vae on the shapes images first (0 = no)"),
    "tiny_unet_steps": Key(400, "tiny SD only: pretrain its random unet on the shapes images first (0 = no)"),
}, "the diffusers pipeline whose denoiser is trained")
RL_EXPORT_KEYS = Key({
    "enabled": Key(True, "export/policy: a diffusers pipeline folder (and export/lora for LoRA)"),
    "dtype": Key("fp32", "dtype of the exported components"),
}, "what the run writes under output_dir/export")


def rl_roles(policy: Mapping[str, Any], ref: str, *extra: Role, vae: str) -> tuple[Role, ...]:
    """policy (trained), ref (frozen; a separate copy of the policy's starting weights, ZeRO-3 whatever the policy's
    stage, its dtype the policy's), ``extra`` roles, the vae and the text encoders."""
    stage = Key(3, "ZeRO stage 0-3 (a frozen role asked for stage 1 or 2 is built at 0: nothing to partition but "
                   "its weights)")
    return (Role("policy", "the denoiser trained (SD/SDXL unet, SD3/FLUX transformer)", trainable=True, keys=policy),
            Role("ref", ref, follows="policy", weights="policy", keys={"stage": stage, "gather_forward": True}),
            *extra, *component_roles("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5", vae=vae))


def check_rl_model(cfg: Any, resolution_key: str) -> None:
    """The vae and text encoders from model.pretrained, the policy and ref folders, the pipeline folder's family
    and the image side it allows, and model.tiny_unet_steps only for the tiny SD; before any rank starts."""
    for name in ("policy", "ref"):
        check_config_folder(f"roles.{name}.model", str(cfg.roles[name].model), "a denoiser folder",
                            f"give a unet/ or transformer/ folder, or set roles.{name}.model=\"\"")
    check_model(cfg, ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"), resolution_key)
    if cfg.model.tiny_unet_steps and (cfg.model.pretrained or cfg.model.tiny_family != "sd"):
        raise config_problem("model.tiny_unet_steps", cfg.model.tiny_unet_steps, "pretrains the tiny SD unet only "
                             f"(model.pretrained={str(cfg.model.pretrained)!r}, model.tiny_family="
                             f"{cfg.model.tiny_family})", "set model.tiny_unet_steps=0")

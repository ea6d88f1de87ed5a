"""What the diffusion recipes share: the key sections of sd_finetune and controlnet (model folder, image data, DDPM
objective, validation, held-out loss), their checks and old names, the reading of them into the diffusion
pipelines' flat inputs; and the roles, checks and building of the RL recipes (diffusion_grpo, diffusion_dpo)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from multiengine.engines.recipe_config import Choice, Each, Key, Length, Range, Satisfies, config_problem
from multiengine.engines.recipe_lifecycle import Recipe
from multiengine.engines.role_schema import Role, lora_spec, model_path, optim_spec, placement
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles, model_family
from multiengine.pipelines.diffusion.inputs import (
    ImageData,
    check_config_folder,
    check_resolution,
    model_folder_family,
)
from multiengine.pipelines.diffusion.math import PREDICTION_TYPES
from multiengine.pipelines.diffusion.models import MODES, resolve_model_path
from multiengine.pipelines.diffusion.rl_runs import PolicyModel, prepare_tiny_pipeline, rl_role_specs
from multiengine.pipelines.diffusion.runs import t5_length, text_tokenizers, token_lengths
from multiengine.recipes.common import check_rows_per_rank


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
DTYPE = Choice("fp32", "bf16", "fp16")


def diffusion_checks(trained: tuple[str, ...], tiny_families: tuple[str, ...]) -> dict[str, Any]:
    """The checks sd_finetune and controlnet share beyond the by-name ones (``trained``: the trainable roles)."""
    return {**{f"roles.{role}.lora.target_modules": Each(Length(1)) for role in trained},
        "mode": Choice(*MODES), "model.tiny_family": Choice(*tiny_families), "model.tiny_vae_steps": Range(0),
        "data.resolution": Range(8), "data.builtin_size": Range(2), "data.max_train_samples": Range(0),
        "data.num_workers": Range(0), "data.eval_split": Satisfies(lambda v: isinstance(v, str), "\"\", a fraction, "
                                                                   "a count or a split name"),
        "diffusion.adam_epsilon": Range(0, min_exclusive=True),
        "diffusion.prediction_type": Choice("", *PREDICTION_TYPES), "diffusion.snr_gamma": Range(0),
        "diffusion.noise_offset": Range(0), "diffusion.input_perturbation": Range(0),
        "validation.prompts": Each(Length(1)), "validation.num_prompts": Range(1),
        "validation.num_inference_steps": Range(1), "validation.guidance_scale": Range(0, allow_none=True),
        "eval.timesteps": Range(1), "export.dtype": DTYPE,
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


def plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested section as {dotted key: value}."""
    out: dict[str, Any] = {}
    for k, v in plain(tree).items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
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
RL_CHECKS: dict[str, Any] = {"model.tiny_family": Choice(*FAMILIES), "model.tiny_vae_steps": Range(0),
                             "export.dtype": DTYPE, "roles.policy.lora.target_modules": Each(Length(1))}


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
    from omegaconf import OmegaConf

    check_components(cfg, ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"))
    for name in ("policy", "ref"):
        check_config_folder(f"roles.{name}.model", str(cfg.roles[name].model), "a denoiser folder",
                            f"give a unet/ or transformer/ folder, or set roles.{name}.model=\"\"")
    family = model_folder_family(str(cfg.model.pretrained), str(cfg.model.tiny_family))
    if family:
        resolution = int(OmegaConf.select(cfg, resolution_key))
        check_resolution(resolution, family, str(cfg.model.pretrained), resolution_key)
    if cfg.model.tiny_unet_steps and (cfg.model.pretrained or cfg.model.tiny_family != "sd"):
        raise config_problem("model.tiny_unet_steps", cfg.model.tiny_unet_steps, "pretrains the tiny SD unet only "
                             f"(model.pretrained={str(cfg.model.pretrained)!r}, model.tiny_family="
                             f"{cfg.model.tiny_family})", "set model.tiny_unet_steps=0")


class DiffusionRoles(Recipe):
    """The model folder (the tiny one built, its vae and SD unet pretrained on the shapes images, when
    model.pretrained is empty) and the roles every diffusion RL recipe has: policy, ref (when ``uses_ref``), vae
    and the text encoders."""

    roles: tuple[Role, ...] = ()

    def add_denoisers(self, resolution: int, uses_ref: bool, total_steps: int, accum: int) -> None:
        cfg, registry = self.cfg, self.registry
        self.vae_pretrain = self.unet_pretrain = None
        if cfg.model.pretrained:
            self.model_path = resolve_model_path(str(cfg.model.pretrained), str(cfg.model.revision) or None,
                                                 str(cfg.model.variant) or None)
        else:
            family = str(cfg.model.tiny_family)
            self.model_path = self.path(f"tiny_{family}")
            done = prepare_tiny_pipeline(self.model_path, self.path("data", "shapes"), family, seed=cfg.seed,
                                         resolution=resolution, vae_steps=int(cfg.model.tiny_vae_steps),
                                         unet_steps=int(cfg.model.tiny_unet_steps), is_main=registry.is_main,
                                         device=registry.device)
            self.vae_pretrain, self.unet_pretrain = done["vae"], done["unet"]
        self.family = model_family(self.model_path)
        self.family_roles = family_roles(self.family)
        self.denoiser = self.family_roles.denoiser
        self.text_encoders = list(self.family_roles.text_encoders)
        default = {"policy": os.path.join(self.model_path, self.denoiser)}
        p = cfg.roles.policy
        for spec in rl_role_specs(
                self.model_path, self.denoiser, self.text_encoders,
                {r.name: placement(cfg, self.roles, r.name) for r in self.roles if r.name in cfg.roles},
                policy_folder=model_path(cfg, self.roles, "policy", default),
                ref_folder=model_path(cfg, self.roles, "ref", default) if uses_ref else None,
                optim=optim_spec(cfg, "policy", total_steps), micro_batch_size=int(p.micro_batch_size),
                grad_accum=accum, gradient_checkpointing=bool(p.gradient_checkpointing), seed=cfg.seed,
                # target_modules [] = diffusers' LoRA targets of the family
                lora=lora_spec(cfg, "policy", target_modules=tuple(p.lora.target_modules
                                                                   or self.family_roles.lora_targets)),
                variant=str(cfg.model.variant) or None):
            registry.add(spec)

    def policy_model(self, resolution: int, guidance_scale: float, t5_tokens: int = 0) -> PolicyModel:
        t5 = t5_length(self.family, t5_tokens)
        return PolicyModel(self.registry, self.model_path, self.family, self.text_encoders, resolution=resolution,
                           tokenizers=text_tokenizers(self.model_path, self.text_encoders),
                           token_lengths=token_lengths(self.model_path, self.text_encoders, t5),
                           guidance_scale=guidance_scale)

    def export(self) -> dict[str, Any]:
        """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy."""
        if not self.cfg.export.enabled:
            return {}
        lora = ("policy", self.denoiser, self.family_roles.pipeline) if self.cfg.roles.policy.lora.r else None
        return export_run(self.registry, self.path("export"), self.model_path,
                          {self.denoiser: "policy", "vae": "vae", **{n: n for n in self.text_encoders}},
                          dtype=str(self.cfg.export.dtype), lora=lora, pipeline="policy")

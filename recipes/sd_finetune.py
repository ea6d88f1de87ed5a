"""Text-to-image fine-tuning of every diffusers family with every model sharded: the denoiser trainable, vae and
text encoders frozen, each its own DeepSpeed engine, optional EMA and LoRA; ``mode=seed_baseline`` is diffusers'
layout for comparison. ``multiengine run sd_finetune --config tiny --nproc-per-node 2``; docs/diffusion.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiengine.engines.settings import Choice, Range, section, setting
from multiengine.pipelines.diffusion.export import RoleExportSettings
from multiengine.pipelines.diffusion.families import family_roles
from multiengine.pipelines.diffusion.inputs import HeldoutEval, ImageData
from multiengine.pipelines.diffusion.models import MODES, SEED_BASELINE, EMASettings, ModelSettings
from multiengine.pipelines.diffusion.runs import SHAPES_PROMPTS, build_tiny_model  # noqa: F401 (tests, benchmarks)
from multiengine.pipelines.diffusion.training import DiffusionSettings
from multiengine.pipelines.diffusion.validation import EMAValidation
from multiengine.recipes.diffusion_base import (
    TRAINED,
    ImageFinetune,
    component,
    component_loader,
    components,
    renamed,
    unset,
)
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class SDFinetuneConfig(RunConfig):
    output_dir: str = setting("outputs/sd_finetune", "everything the run writes goes under this folder")
    max_steps: int = setting(200, "optimizer steps", Range(1))
    mode: str = setting("zero3", "zero3 (every role as in roles.*) | seed_baseline (diffusers' layout: frozen roles "
                                 "and the EMA whole on every rank)", Choice(*MODES))
    model: ModelSettings = section(ModelSettings, "the diffusers pipeline folder to fine-tune")
    diffusion: DiffusionSettings = section(DiffusionSettings, "the objective: DDPM (SD, SDXL) or rectified flow "
                                           "matching (SD3, FLUX), as diffusers' training scripts")
    data: ImageData = section(ImageData, "image-caption rows (docs/data.md)")
    ema: EMASettings = section(EMASettings, "EMA of the denoiser (its placement: roles.ema), diffusers' EMAModel "
                                            "options")
    validation: EMAValidation = section(EMAValidation, "images generated before, after and every N steps")
    eval: HeldoutEval = section(HeldoutEval, "held-out loss at fixed noise and timesteps")
    export: RoleExportSettings = section(RoleExportSettings, "outputs under output_dir/export")


class SDFinetune(ImageFinetune):
    """diffusers' text-to-image fine-tunes (SD, SDXL) and SD3 / FLUX flow-matching fine-tunes on the image
    fine-tune lifecycle (data, held-out loss and validation grids: ImageFinetune), with an EMA of the denoiser."""

    name = "sd_finetune"
    roles = (
        component("unet", "SD 1.x/2.x and SDXL: the denoiser, trained (an SD3/FLUX model refuses these keys: use "
                  "roles.transformer)", trainable=True, defaults=TRAINED),
        component("transformer", "SD3 and FLUX: the denoiser, trained (an SD/SDXL model refuses these keys: use "
                  "roles.unet)", trainable=True, defaults=TRAINED),
        *components("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5"),
        Role("ema", "the EMA of the denoiser (ema.enabled), at the denoiser's ZeRO stage (seed_baseline: whole on "
             "every rank)", defaults={"dtype": Key("fp32", "EMA weights' dtype (bf16 would round away small "
                                                            "updates)")},
             omit=("model", "tokenizer", "stage", "gather_forward"),
             why="the EMA is a copy of the trained denoiser at its ZeRO stage: it has a dtype and offload_params only"),
    )
    Config = SDFinetuneConfig
    renamed = {**renamed("unet", " (roles.transformer.* for SD3/FLUX)"), "ema.dtype": "roles.ema.dtype",
               "ema.offload_params": "roles.ema.offload_params", "ema.max_decay": "ema.decay",
               "ema.warmup": "ema.use_ema_warmup"}

    @classmethod
    def validate(cls, cfg: SDFinetuneConfig, world_size: int = 1) -> None:
        """Before any rank starts, without building a model: the EMA's placement, the model folder and its family's
        keys, the data and a micro batch of training images per rank on ``world_size`` ranks."""
        family = cls.family_of(cfg)
        d = cls.denoiser_of(cfg, family)
        if cfg.ema.enabled and cfg.roles.ema.offload_params:
            baseline = cfg.mode == SEED_BASELINE
            stage = 0 if baseline else cfg.roles[d].effective_stage
            if stage != 3:
                why, fix = ("mode=seed_baseline keeps the EMA whole at stage 0", "mode=zero3") if baseline else \
                    (f"the EMA runs at roles.{d}'s stage {stage}", f"roles.{d}.stage=3")
                raise config_problem("roles.ema.offload_params", True, f"needs ZeRO-3 ({why}): only ZeRO-3 "
                                     "partitions parameters", f"set {fix}, or roles.ema.offload_params=false")
        if not cfg.ema.enabled and not cfg.validation.use_ema:
            raise config_problem("validation.use_ema", False, "applies only with an EMA (ema.enabled=false)",
                                 "drop validation.use_ema")
        cls.check_image_run(cfg, world_size, family)

    @classmethod
    def absent(cls, cfg: SDFinetuneConfig, family: str) -> dict[str, tuple[str, str]]:
        out = super().absent(cfg, family)
        if not cfg.ema.enabled:
            out["ema"] = ("ema.enabled=false builds no EMA role", "drop roles.ema.{key}, or set ema.enabled=true")
        return out

    @classmethod
    def unused(cls, cfg: SDFinetuneConfig, family: str) -> dict[str, tuple[Any, str]]:
        d, s = cfg.diffusion, DiffusionSettings
        if family_roles(family).objective != "flow":
            return unset(d, s.FLOW, "diffusion", f"applies to the flow-matching families (sd3, flux), not to this "
                                                 f"{family} model")
        out = unset(d, s.DDPM, "diffusion", f"applies to the DDPM families (sd, sdxl), not to this {family} model")
        scheme = d.flow_option(family, "weighting_scheme")
        if family != "flux":
            out.update(unset(d, ("guidance_scale",), "diffusion", f"is FLUX's guidance input; this {family} model "
                                                                  "has none"))
        if scheme != "logit_normal":
            out.update(unset(d, ("logit_mean", "logit_std"), "diffusion", "shapes the logit_normal timestep density; "
                                                                          f"the scheme is {scheme}"))
        if scheme != "mode":
            out.update(unset(d, ("mode_scale",), "diffusion", f"shapes the mode timestep density; the scheme is "
                                                              f"{scheme}"))
        return out

    @classmethod
    def role_specs(cls, cfg: SDFinetuneConfig, family: str, model_path: str) -> list[Any]:
        """The denoiser (trainable; LoRA on the family's targets), the vae and text encoders (frozen; whole at stage 0
        in seed_baseline), and the EMA: the denoiser's weights and adapters, at its stage (seed_baseline: 0)."""
        fr, r, load = family_roles(family), cfg.roles, component_loader(cfg, model_path)
        trained, baseline = r[fr.denoiser], cfg.mode == SEED_BASELINE
        specs = [trained.spec(load(fr.denoiser), total_steps=cfg.max_steps, seed=cfg.seed,
                              lora_targets=fr.lora_targets, lora_init="gaussian", eps=cfg.diffusion.adam_epsilon)]
        specs += [r[n].spec(load(n), stage=0 if baseline else None) for n in fr.frozen]
        if cfg.ema.enabled:  # the same weights as the denoiser at step 0 (same factory, same LoRA seed)
            specs.append(r.ema.spec(load(fr.denoiser), seed=cfg.seed, stage=0 if baseline else trained.effective_stage,
                                    stateful=True, lora=trained.lora_spec(fr.lora_targets, "gaussian")))
        return specs

    @classmethod
    def plan(cls, cfg: SDFinetuneConfig, assume: Any = None) -> list[plans.RecipePlan]:
        return cls.image_plan(cfg, assume, None)

    @classmethod
    def ema_enabled(cls, cfg: SDFinetuneConfig) -> bool:
        return cfg.ema.enabled

    @property
    def ema_on(self) -> bool:
        return self.cfg.ema.enabled

    def validation_role(self) -> str:
        return "ema" if self.ema_on and self.cfg.validation.use_ema else self.trained

    def export(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        role = "ema" if self.ema_on else self.trained
        lora = (role, self.denoiser, self.family_roles.pipeline) if cfg.roles[self.denoiser].lora.r else None
        return self.export_run({self.denoiser: role, "vae": "vae", **{n: n for n in self.text_encoders}}, lora=lora)

    def summary_extra(self) -> dict[str, Any]:
        extra = super().summary_extra()
        if self.family_roles.objective == "flow":
            o = self.objective
            extra["flow"] = {"weighting_scheme": o.weighting_scheme, "logit_mean": o.logit_mean,
                             "logit_std": o.logit_std, "mode_scale": o.mode_scale,
                             "precondition_outputs": o.precondition, "guidance_scale": o.guidance_scale,
                             "max_sequence_length": self.t5_length}
        return extra


RECIPE = SDFinetune

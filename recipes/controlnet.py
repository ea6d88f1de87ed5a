"""ControlNet training with every model sharded: a trainable ControlNetModel initialised from the unet, the frozen
unet beside it at ZeRO-3 (where diffusers keeps a whole copy per GPU), frozen vae and text encoder(s); the loss is
train_controlnet.py's. ``multiengine run controlnet --config tiny --nproc-per-node 2``; docs/diffusion.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiengine.engines import save_role
from multiengine.engines.settings import Choice, Range, section, setting
from multiengine.pipelines.diffusion.controlnet import (
    CONTROLNET_PIPELINES,
    ControlNetModelSettings,
    ControlNetSettings,
    controlnet_factory,
)
from multiengine.pipelines.diffusion.export import RoleExportSettings
from multiengine.pipelines.diffusion.families import family_roles
from multiengine.pipelines.diffusion.inputs import ConditionedImageData, HeldoutEval, check_config_folder
from multiengine.pipelines.diffusion.models import MODES, SEED_BASELINE
from multiengine.pipelines.diffusion.runs import conditioning_rows
from multiengine.pipelines.diffusion.training import DDPMSettings
from multiengine.pipelines.diffusion.validation import ValidationSettings, build_pipeline, image_grid
from multiengine.recipes.diffusion_base import TRAINED, ImageFinetune, component, component_loader, components, renamed
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class ControlNetConfig(RunConfig):
    output_dir: str = setting("outputs/controlnet", "everything the run writes goes under this folder")
    max_steps: int = setting(200, "optimizer steps", Range(1))
    mode: str = setting("zero3", "zero3 (every role as in roles.*) | seed_baseline (frozen unet, vae, text encoders "
                                 "whole)", Choice(*MODES))
    model: ControlNetModelSettings = section(ControlNetModelSettings, "the base SD or SDXL pipeline folder")
    diffusion: DDPMSettings = section(DDPMSettings, "the objective: diffusers' train_controlnet.py DDPM loss through "
                                                    "the frozen unet")
    data: ConditionedImageData = section(ConditionedImageData, "image-caption rows with a conditioning image each "
                                                               "(docs/data.md)")
    controlnet: ControlNetSettings = section(ControlNetSettings, "how the conditioning enters")
    validation: ValidationSettings = section(ValidationSettings, "generations from held-out conditioning images and "
                                                                 "captions")
    eval: HeldoutEval = section(HeldoutEval, "held-out loss at fixed noise and timesteps")
    export: RoleExportSettings = section(RoleExportSettings, "export/controlnet and export/pipeline, and further "
                                                             "per-role folders (export.roles, e.g. [unet])")


class ControlNetTraining(ImageFinetune):
    """The image fine-tune lifecycle with a trainable ``controlnet`` in front of a frozen ``unet``."""

    name = "controlnet"
    roles = (
        Role("controlnet", "the ControlNet, trained; model \"\" = initialised from the unet (diffusers' "
             "ControlNetModel.from_unet), or a ControlNetModel folder to continue training", trainable=True,
             defaults={**{k: v for k, v in TRAINED.items() if k != "lora"},
                       "model": Key("", "a ControlNetModel folder (save_pretrained); \"\" = initialised from the "
                                        "unet")},
             omit=("tokenizer", "lora"), why="the ControlNet trains in full (no LoRA) and reads no text"),
        component("unet", "frozen; its backward carries the gradient to the controlnet", defaults={"dtype": "fp32"}),
        *components("frozen: SDXL's CLIP-G"),
    )
    Config = ControlNetConfig
    renamed = {**renamed("controlnet"), "model.controlnet": "roles.controlnet.model"}
    trained_role = "controlnet"

    @classmethod
    def validate(cls, cfg: ControlNetConfig, world_size: int = 1) -> None:
        """Before any rank starts: an SD/SDXL base folder, a ControlNet folder holding one, data with conditioning
        images and a micro batch per rank, every image readable."""
        family = cls.family_of(cfg)
        if family and family not in CONTROLNET_PIPELINES:
            raise config_problem("model.pretrained", cfg.model.pretrained, f"is a {family} model; a ControlNet "
                                 f"conditions a unet ({', '.join(CONTROLNET_PIPELINES)})",
                                 "give an SD 1.x/2.x or SDXL folder")
        check_config_folder("roles.controlnet.model", cfg.roles.controlnet.model, "a ControlNetModel folder",
                            "give a folder saved with ControlNetModel.save_pretrained, or \"\"")
        if "controlnet" in cfg.export.roles:
            raise config_problem("export.roles", list(cfg.export.roles), "names controlnet, which is always exported "
                                 "(export/controlnet)", "drop controlnet from export.roles")
        cls.check_image_run(cfg, world_size, family)

    @classmethod
    def role_specs(cls, cfg: ControlNetConfig, family: str, model_path: str) -> list[Any]:
        """The trainable controlnet (from the unet, or its folder) and the frozen unet, vae and text encoders (whole
        at stage 0 in seed_baseline, as diffusers' train_controlnet.py, where only the trained model is sharded)."""
        r, load = cfg.roles, component_loader(cfg, model_path)
        variant = (cfg.model.variant or None) if cfg.model.pretrained else None
        control = controlnet_factory(model_path, cfg.seed, variant, r.controlnet.model or None)
        specs = [r.controlnet.spec(control, total_steps=cfg.max_steps, seed=cfg.seed, eps=cfg.diffusion.adam_epsilon)]
        stage = 0 if cfg.mode == SEED_BASELINE else None
        return specs + [r[n].spec(load(n), stage=stage) for n in ("unet", *family_roles(family).frozen)]

    @classmethod
    def plan(cls, cfg: ControlNetConfig, assume: Any = None) -> list[plans.RecipePlan]:
        return cls.image_plan(cfg, assume, "controlnet")

    def conditioning_scale(self) -> float:
        return self.cfg.controlnet.conditioning_scale

    def validation_prompts(self, rows: Any) -> list[str]:
        """The first ``validation.num_prompts`` held-out rows: their captions (or validation.prompts, one per row)
        and their conditioning images, resized and center-cropped like training images."""
        v = self.cfg.validation
        self.conditions, captions = conditioning_rows(rows, len(v.prompts) or v.num_prompts, self.cfg.data.resolution)
        return list(v.prompts)[:len(captions)] if v.prompts else captions

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, "unet", self.prediction_type,
                              denoiser="unet", components={"controlnet": role},
                              class_name=CONTROLNET_PIPELINES[self.family])

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"image": list(self.conditions),
                "controlnet_conditioning_scale": self.cfg.controlnet.conditioning_scale}

    def grid(self, images: list[Any]) -> Any:
        """Each conditioning image beside its generation, one row per prompt."""
        kind = self.cfg.data.conditioning_kind if self.builtin_data else "conditioning"
        cells, labels = [], []
        for cond, image, prompt in zip(self.conditions, images, self.prompts):
            cells += [cond, image]
            labels += [f"{kind} image", prompt]
        return image_grid(cells, cols=2, prompts=labels, step=self.step)

    def export(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        # The frozen components are unchanged: copied from the source folder (cast to export.dtype), not gathered.
        first = {"controlnet": save_role(self.registry, "controlnet", self.path("export", "controlnet"),
                                         dtype=cfg.export.dtype)["model"]}
        return {**first, **self.export_run({"controlnet": "controlnet"}, class_name=CONTROLNET_PIPELINES[self.family],
                                           cast_copied=True)}

    def summary_extra(self) -> dict[str, Any]:
        out = super().summary_extra()
        out.update({"conditioning_column": self.cfg.data.columns.conditioning_image or "conditioning_image",
                    "pipeline": CONTROLNET_PIPELINES[self.family]})
        if self.builtin_data:
            out["conditioning_kind"] = self.cfg.data.conditioning_kind
        return out


RECIPE = ControlNetTraining

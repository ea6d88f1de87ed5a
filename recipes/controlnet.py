"""ControlNet training with every model sharded: a trainable ControlNetModel initialised from the unet, the frozen
unet beside it at ZeRO-3 (where diffusers keeps a whole copy per GPU), frozen vae and text encoder(s); the loss is
train_controlnet.py's. ``multiengine run controlnet --config tiny --nproc-per-node 2``; docs/diffusion.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from multiengine.engines import save_role
from multiengine.engines.settings import Choice, Range, section, setting
from multiengine.pipelines.diffusion import runs
from multiengine.pipelines.diffusion.controlnet import (
    CONTROLNET_PIPELINES,
    ControlNetModelSettings,
    ControlNetSettings,
    controlnet_factory,
)
from multiengine.pipelines.diffusion.export import RoleExportSettings, export_run
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.inputs import ConditionedImageData, HeldoutEval, check_config_folder
from multiengine.pipelines.diffusion.models import MODES, SEED_BASELINE, component_loader
from multiengine.pipelines.diffusion.training import DDPMSettings, family_objective, heldout_loss, step_generator
from multiengine.pipelines.diffusion.validation import ValidationSettings, build_pipeline, image_grid
from multiengine.recipes import diffusion_parts as parts
from multiengine.recipes.diffusion_parts import TRAINED, component, components
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
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


class ControlNetTraining(Recipe):
    """A trainable ``controlnet`` in front of a frozen ``unet`` on image-caption rows with conditioning images:
    held-out loss before and after, validation grids of each conditioning image beside its generation."""

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
    renamed = {**parts.renamed("controlnet"), "model.controlnet": "roles.controlnet.model"}
    headline, plot_panels = parts.IMAGE_HEADLINE, parts.IMAGE_PANELS

    @classmethod
    def validate(cls, cfg: ControlNetConfig, world_size: int = 1) -> None:
        """Before any rank starts: an SD/SDXL base folder, a ControlNet folder holding one, data with conditioning
        images and a micro batch per rank, every image readable."""
        family = parts.family_of(cfg)
        if family and family not in CONTROLNET_PIPELINES:
            raise config_problem("model.pretrained", cfg.model.pretrained, f"is a {family} model; a ControlNet "
                                 f"conditions a unet ({', '.join(CONTROLNET_PIPELINES)})",
                                 "give an SD 1.x/2.x or SDXL folder")
        check_config_folder("roles.controlnet.model", cfg.roles.controlnet.model, "a ControlNetModel folder",
                            "give a folder saved with ControlNetModel.save_pretrained, or \"\"")
        if "controlnet" in cfg.export.roles:
            raise config_problem("export.roles", list(cfg.export.roles), "names controlnet, which is always exported "
                                 "(export/controlnet)", "drop controlnet from export.roles")
        parts.check_image_run(cls, cfg, world_size, family, "controlnet")

    @classmethod
    def check_family(cls, cfg: ControlNetConfig, family: str, where: str = "") -> None:
        """The keys of a text encoder this family has not are refused."""
        parts.check_family(cls, cfg, parts.absent_roles(cfg, family), {}, where)

    @classmethod
    def role_specs(cls, cfg: ControlNetConfig, family: str, model_path: str) -> list[Any]:
        """The trainable controlnet (from the unet, or its folder) and the frozen unet, vae and text encoders (whole
        at stage 0 in seed_baseline, as diffusers' train_controlnet.py, where only the trained model is sharded)."""
        r, load = cfg.roles, component_loader(cfg.model, model_path)
        variant = (cfg.model.variant or None) if cfg.model.pretrained else None
        control = controlnet_factory(model_path, cfg.seed, variant, r.controlnet.model or None)
        specs = [r.controlnet.spec(control, total_steps=cfg.max_steps, seed=cfg.seed, eps=cfg.diffusion.adam_epsilon)]
        stage = 0 if cfg.mode == SEED_BASELINE else None
        return specs + [r[n].spec(load(n), stage=stage) for n in ("unet", *family_roles(family).frozen)]

    describe = classmethod(parts.describe)

    @classmethod
    def plan(cls, cfg: ControlNetConfig, assume: Any = None) -> list[plans.RecipePlan]:
        return parts.image_plan(cfg, assume, cls.name, "controlnet")

    def __init__(self, cfg: ControlNetConfig) -> None:
        super().__init__(cfg)
        self.validations: list[dict[str, Any]] = []
        self.heldout: dict[str, float] = {}  # "<tag>/loss"

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.step_metrics]

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. data and model folder (the tiny model's vae pretrained on the training rows): rank 0 generates /
        #    builds / downloads while the others wait; the family's checks again (a hub name's is known only now)
        self.builtin_data = not cfg.data.spec
        source = runs.image_source(cfg, registry, self.path("data", "shapes"))
        rows = runs.rank0_first(registry.is_main, lambda: cfg.data.load(source, cfg.eval.heldout_size, cfg.seed))
        self.model_path, self.vae_pretrain = runs.image_model(cfg, registry, rows,
                                                              self.path(f"tiny_{cfg.model.tiny_family}"))
        self.family = model_family(self.model_path)
        self.check_family(cfg, self.family, self.model_path)
        self.text_encoders = list(family_roles(self.family).text_encoders)
        # 2. roles: each its own engine with its own placement
        for spec in self.role_specs(cfg, self.family, self.model_path):
            registry.add(spec)
        registry.build()
        # 3. the DDPM objective through the controlnet and the frozen unet, then the validation prompts and
        #    conditioning images and the data
        self.objective, self.prediction_type = family_objective(
            registry, self.model_path, self.family, self.text_encoders, cfg.diffusion, cfg.data.resolution,
            cfg.controlnet.conditioning_scale)
        train_rows, heldout_rows = runs.split_rows(rows, cfg.data, cfg.eval.heldout_size)
        self.eval_origin = rows.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        collate = runs.caption_collate(self.model_path, self.text_encoders, 0)
        self.images = runs.train_images(cfg, registry, train_rows, heldout_rows, collate, "controlnet")
        self.train_set, self.batches, self.heldout_batches = self.images.train_set, self.images.stream(), \
            self.images.heldout
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """The first ``validation.num_prompts`` held-out rows: their captions (or validation.prompts, one per row)
        and their conditioning images, resized and center-cropped like training images."""
        v = self.cfg.validation
        self.conditions, captions = runs.conditioning_rows(rows, len(v.prompts) or v.num_prompts,
                                                           self.cfg.data.resolution)
        return list(v.prompts)[:len(captions)] if v.prompts else captions

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.images.state_dict(), "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.images.sampler.load_state_dict(state["sampler"])
        self.heldout = dict(state.get("heldout", {}))
        self.validations = []

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        engine = registry["controlnet"]
        records = []
        for micro in range(engine.gradient_accumulation_steps()):
            # 1. this rank's next micro batch (sharded, resumable sampler) and all its randomness from (seed, step,
            #    micro, rank): stage-independent
            batch = next(self.batches)
            generator = step_generator(cfg.seed, self.step, micro, registry.rank)
            # 2. latents (vae), embeddings (text encoders), noise, timesteps; the controlnet's residuals into the
            #    frozen unet; the MSE to the target
            out = self.objective.loss(batch, generator)
            # 3. backward through the unet into the controlnet (the engine divides by the accumulation steps); its
            #    optimizer step, clipping and lr schedule at the accumulation boundary only
            engine.backward(out.loss)
            engine.step()
            records.append({"loss": out.loss.item()})
        # 4. the loss averaged over micro batches and ranks, lr, memory per role
        return runs.step_record(registry, records, "controlnet")

    def after_step(self, last: bool) -> None:
        v = self.cfg.validation
        if v.enabled and v.every > 0 and self.step % v.every == 0 and not last:
            self.validation_images(f"step_{self.step}")

    # --- evaluation ------------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps, and validation images before and after training; all
        ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            result["loss"] = heldout_loss(self.objective, self.heldout_batches, self.heldout_points,
                                          self.cfg.eval.seed)
            self.heldout[f"{tag}/loss"] = result["loss"]
        if tag in ("before", "after"):
            self.validation_images(tag)
        return result

    def validation_images(self, tag: str) -> None:
        """Images from the validation conditioning images and prompts on all ranks in lockstep; rank 0 saves the
        grid of each conditioning image beside its generation at validation/<step>_<tag>.png."""
        v, registry = self.cfg.validation, self.registry
        if not v.enabled or not self.prompts:
            return
        t0 = time.perf_counter()
        pipe = build_pipeline(registry, self.model_path, self.text_encoders, "unet", self.prediction_type,
                              denoiser="unet", components={"controlnet": "controlnet"},
                              class_name=CONTROLNET_PIPELINES[self.family])
        images = runs.run_validation(registry, pipe, "controlnet", self.prompts, v, self.cfg.data.resolution,
                                     image=list(self.conditions),
                                     controlnet_conditioning_scale=self.cfg.controlnet.conditioning_scale)
        del pipe
        entry = {"step": self.step, "tag": tag, "file": self.path("validation", f"{self.step:06d}_{tag}.png"),
                 "role": "controlnet", "prompts": list(self.prompts), "seconds": time.perf_counter() - t0}
        self.validations.append(runs.log_validation(registry, self.metrics, entry, images, self.grid))

    def grid(self, images: list[Any]) -> Any:
        """Each conditioning image beside its generation, one row per prompt."""
        kind = self.cfg.data.conditioning_kind if self.builtin_data else "conditioning"
        cells, labels = [], []
        for cond, image, prompt in zip(self.conditions, images, self.prompts):
            cells += [cond, image]
            labels += [f"{kind} image", prompt]
        return image_grid(cells, cols=2, prompts=labels, step=self.step)

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        # The frozen components are unchanged: copied from the source folder (cast to export.dtype), not gathered.
        first = {"controlnet": save_role(self.registry, "controlnet", self.path("export", "controlnet"),
                                         dtype=cfg.export.dtype)["model"]}
        return {**first, **export_run(self.registry, self.path("export"), self.model_path,
                                      {"controlnet": "controlnet"}, cfg.export, prediction_type=self.prediction_type,
                                      class_name=CONTROLNET_PIPELINES[self.family], cast_copied=True)}

    def summary_metrics(self) -> dict[str, Any]:
        return runs.image_figures(self.step_metrics, self.heldout)

    def summary_extra(self) -> dict[str, Any]:
        out = {"mode": self.cfg.mode, "family": self.family, "denoiser": "unet", "model_path": self.model_path,
               "text_encoders": self.text_encoders, "evaluation_rows": self.eval_origin,
               "validation": self.validations}
        if self.vae_pretrain is not None:
            out["tiny_vae_pretrain"] = self.vae_pretrain
        out.update({"conditioning_column": self.cfg.data.columns.conditioning_image or "conditioning_image",
                    "pipeline": CONTROLNET_PIPELINES[self.family]})
        if self.builtin_data:
            out["conditioning_kind"] = self.cfg.data.conditioning_kind
        return out

    def plot_title(self) -> str:
        return f"{self.name} ({self.family}, {self.registry.world_size} ranks)"

RECIPE = ControlNetTraining

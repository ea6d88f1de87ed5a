"""Text-to-image fine-tuning of every diffusers family with every model sharded: the denoiser trainable, vae and
text encoders frozen, each its own DeepSpeed engine, optional EMA and LoRA; ``mode=seed_baseline`` is diffusers'
layout for comparison. ``multiengine run sd_finetune --config tiny --nproc-per-node 2``; docs/diffusion.md."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from multiengine.engines.settings import Choice, Range, section, setting
from multiengine.pipelines.diffusion import runs
from multiengine.pipelines.diffusion.data import shapes_captions
from multiengine.pipelines.diffusion.export import RoleExportSettings, export_run
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.inputs import HeldoutEval, ImageData
from multiengine.pipelines.diffusion.models import (
    MODES,
    SEED_BASELINE,
    EMASettings,
    ModelSettings,
    component_loader,
    update_ema,
)
from multiengine.pipelines.diffusion.runs import SHAPES_PROMPTS, build_tiny_model  # noqa: F401 (tests, benchmarks)
from multiengine.pipelines.diffusion.training import DiffusionSettings, family_objective, heldout_loss, step_generator
from multiengine.pipelines.diffusion.validation import EMAValidation, build_pipeline, image_grid
from multiengine.recipes import diffusion_parts as parts
from multiengine.recipes.diffusion_parts import TRAINED, component, components, unset
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
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


class SDFinetune(Recipe):
    """diffusers' text-to-image fine-tunes (SD, SDXL) and SD3 / FLUX flow-matching fine-tunes on image-caption rows:
    held-out loss before and after, validation grids, an EMA of the denoiser."""

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
    renamed = {**parts.renamed("unet", " (roles.transformer.* for SD3/FLUX)"), "ema.dtype": "roles.ema.dtype",
               "ema.offload_params": "roles.ema.offload_params", "ema.max_decay": "ema.decay",
               "ema.warmup": "ema.use_ema_warmup"}
    headline, plot_panels = parts.IMAGE_HEADLINE, parts.IMAGE_PANELS

    @classmethod
    def validate(cls, cfg: SDFinetuneConfig, world_size: int = 1) -> None:
        """Before any rank starts, without building a model: the EMA's placement, the model folder and its family's
        keys, the data and a micro batch of training images per rank on ``world_size`` ranks."""
        family = parts.family_of(cfg)
        d = parts.denoiser_of(cls, cfg, family)
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
        parts.check_image_run(cls, cfg, world_size, family)

    @classmethod
    def check_family(cls, cfg: SDFinetuneConfig, family: str, where: str = "") -> None:
        """The keys of a role this family has not (the EMA's with ema.enabled=false) and the diffusion options of
        the other objective, scheme or family are refused."""
        absent = parts.absent_roles(cfg, family)
        if not cfg.ema.enabled:
            absent["ema"] = ("ema.enabled=false builds no EMA role", "drop roles.ema.{key}, or set ema.enabled=true")
        d, s = cfg.diffusion, DiffusionSettings
        if family_roles(family).objective != "flow":
            unused = unset(d, s.FLOW, "diffusion", f"applies to the flow-matching families (sd3, flux), not to this "
                                                   f"{family} model")
            return parts.check_family(cls, cfg, absent, unused, where)
        unused = unset(d, s.DDPM, "diffusion", f"applies to the DDPM families (sd, sdxl), not to this {family} model")
        scheme = d.flow_option(family, "weighting_scheme")
        if family != "flux":
            unused.update(unset(d, ("guidance_scale",), "diffusion", f"is FLUX's guidance input; this {family} "
                                                                     "model has none"))
        if scheme != "logit_normal":
            unused.update(unset(d, ("logit_mean", "logit_std"), "diffusion", "shapes the logit_normal timestep "
                                                                             f"density; the scheme is {scheme}"))
        if scheme != "mode":
            unused.update(unset(d, ("mode_scale",), "diffusion", f"shapes the mode timestep density; the scheme is "
                                                                 f"{scheme}"))
        return parts.check_family(cls, cfg, absent, unused, where)

    @classmethod
    def role_specs(cls, cfg: SDFinetuneConfig, family: str, model_path: str) -> list[Any]:
        """The denoiser (trainable; LoRA on the family's targets), the vae and text encoders (frozen; whole at stage 0
        in seed_baseline), and the EMA: the denoiser's weights and adapters, at its stage (seed_baseline: 0)."""
        fr, r, load = family_roles(family), cfg.roles, component_loader(cfg.model, model_path)
        trained, baseline = r[fr.denoiser], cfg.mode == SEED_BASELINE
        specs = [trained.spec(load(fr.denoiser), total_steps=cfg.max_steps, seed=cfg.seed,
                              lora_targets=fr.lora_targets, lora_init="gaussian", eps=cfg.diffusion.adam_epsilon)]
        specs += [r[n].spec(load(n), stage=0 if baseline else None) for n in fr.frozen]
        if cfg.ema.enabled:  # the same weights as the denoiser at step 0 (same factory, same LoRA seed)
            specs.append(r.ema.spec(load(fr.denoiser), seed=cfg.seed, stage=0 if baseline else trained.effective_stage,
                                    stateful=True, lora=trained.lora_spec(fr.lora_targets, "gaussian")))
        return specs

    describe = classmethod(parts.describe)

    @classmethod
    def plan(cls, cfg: SDFinetuneConfig, assume: Any = None) -> list[plans.RecipePlan]:
        return parts.image_plan(cfg, assume, cls.name, ema=cfg.ema.enabled)

    def __init__(self, cfg: SDFinetuneConfig) -> None:
        super().__init__(cfg)
        self.validations: list[dict[str, Any]] = []
        self.heldout: dict[str, float] = {}  # "<tag>/loss" (and "<tag>/loss_ema")

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.step_metrics]

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. data and model folder (the tiny model's vae pretrained on the training rows): rank 0 generates /
        #    builds / downloads while the others wait; the family's checks again (a hub name's is known only now)
        source = runs.image_source(cfg, registry, self.path("data", "shapes"))
        rows = runs.rank0_first(registry.is_main, lambda: cfg.data.load(source, cfg.eval.heldout_size, cfg.seed))
        self.model_path, self.vae_pretrain = runs.image_model(cfg, registry, rows,
                                                              self.path(f"tiny_{cfg.model.tiny_family}"))
        self.family = model_family(self.model_path)
        self.check_family(cfg, self.family, self.model_path)
        self.fr = family_roles(self.family)
        self.denoiser, self.text_encoders = self.fr.denoiser, list(self.fr.text_encoders)
        self.t5_length = runs.t5_length(self.family, cfg.diffusion.max_sequence_length)
        # 2. roles: each its own engine with its own placement
        for spec in self.role_specs(cfg, self.family, self.model_path):
            registry.add(spec)
        registry.build()
        # 3. the objective of the family (and its prediction type), then the validation prompts and the data
        self.objective, self.prediction_type = family_objective(
            registry, self.model_path, self.family, self.text_encoders, cfg.diffusion, cfg.data.resolution)
        train_rows, heldout_rows = runs.split_rows(rows, cfg.data, cfg.eval.heldout_size)
        self.eval_origin = rows.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        collate = runs.caption_collate(self.model_path, self.text_encoders, self.t5_length)
        self.images = runs.train_images(cfg, registry, train_rows, heldout_rows, collate, self.denoiser)
        self.train_set, self.batches, self.heldout_batches = self.images.train_set, self.images.stream(), \
            self.images.heldout
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """validation.prompts; else validation.num_prompts shapes prompts for the built-in data, or the first distinct
        captions of the held-out rows (of the training rows when nothing is held out)."""
        v = self.cfg.validation
        if v.prompts:
            return list(v.prompts)
        captions = [*SHAPES_PROMPTS, *shapes_captions()] if not self.cfg.data.spec else rows["caption"]
        return runs.validation_captions(captions, v.num_prompts)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.images.state_dict(), "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.images.sampler.load_state_dict(state["sampler"])
        self.heldout = dict(state.get("heldout", {}))
        self.validations = []

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        engine = registry[self.denoiser]
        records = []
        for micro in range(engine.gradient_accumulation_steps()):
            # 1. this rank's next micro batch (sharded, resumable sampler)
            batch = next(self.batches)
            # 2. all randomness of the micro batch from (seed, step, micro, rank): stage-independent
            generator = step_generator(cfg.seed, self.step, micro, registry.rank)
            # 3. latents via the vae engine, embeddings via the text-encoder engines, noise, timesteps (DDPM:
            #    uniform; flow: the density), the target and the weighted MSE
            out = self.objective.loss(batch, generator)
            # 4. backward through the trainable engine (it divides by the accumulation steps); its optimizer step,
            #    clipping and lr schedule at the accumulation boundary only
            engine.backward(out.loss)
            engine.step()
            records.append({"loss": out.loss.item()})
        # 5. the EMA, then the loss averaged over micro batches and ranks, lr, memory per role
        ema = {"ema_decay": update_ema(registry, self.step + 1, cfg.ema, self.denoiser)} if cfg.ema.enabled else {}
        return {**runs.step_record(registry, records, self.denoiser), **ema}

    def after_step(self, last: bool) -> None:
        v = self.cfg.validation
        if v.enabled and v.every > 0 and self.step % v.every == 0 and not last:
            self.validation_images(f"step_{self.step}")

    # --- evaluation ------------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps (the denoiser, and the EMA when on), and validation images
        before and after training; all ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            fixed = (self.objective, self.heldout_batches, self.heldout_points, self.cfg.eval.seed)
            result["loss"] = heldout_loss(*fixed)
            if self.cfg.ema.enabled:
                result["loss_ema"] = heldout_loss(*fixed, role="ema")
            self.heldout.update({f"{tag}/{key}": value for key, value in result.items()})
        if tag in ("before", "after"):
            self.validation_images(tag)
        return result

    def validation_images(self, tag: str) -> None:
        """Images for the validation prompts (by the EMA with validation.use_ema) on all ranks in lockstep; rank 0
        saves the labelled grid at validation/<step>_<tag>.png and logs it to TensorBoard."""
        v, registry = self.cfg.validation, self.registry
        if not v.enabled or not self.prompts:
            return
        role, t0 = "ema" if self.cfg.ema.enabled and v.use_ema else self.denoiser, time.perf_counter()
        pipe = build_pipeline(registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)
        images = runs.run_validation(registry, pipe, self.denoiser, self.prompts, v, self.cfg.data.resolution,
                                     **({"max_sequence_length": self.t5_length} if self.t5_length else {}))
        del pipe
        entry = {"step": self.step, "tag": tag, "file": self.path("validation", f"{self.step:06d}_{tag}.png"),
                 "role": role, "prompts": list(self.prompts), "seconds": time.perf_counter() - t0}
        self.validations.append(runs.log_validation(registry, self.metrics, entry, images, lambda cells: image_grid(
            cells, prompts=self.prompts, step=self.step)))

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        role = "ema" if cfg.ema.enabled else self.denoiser
        lora = (role, self.denoiser, self.fr.pipeline) if cfg.roles[self.denoiser].lora.r else None
        return export_run(self.registry, self.path("export"), self.model_path, {
            self.denoiser: role, "vae": "vae", **{n: n for n in self.text_encoders}}, cfg.export,
            lora=lora, prediction_type=self.prediction_type)

    def summary_metrics(self) -> dict[str, Any]:
        return runs.image_figures(self.step_metrics, self.heldout)

    def summary_extra(self) -> dict[str, Any]:
        extra = {"mode": self.cfg.mode, "family": self.family, "denoiser": self.denoiser,
                 "model_path": self.model_path, "text_encoders": self.text_encoders,
                 "evaluation_rows": self.eval_origin, "validation": self.validations}
        if self.vae_pretrain is not None:
            extra["tiny_vae_pretrain"] = self.vae_pretrain
        if self.fr.objective == "flow":
            o = self.objective
            extra["flow"] = {"weighting_scheme": o.weighting_scheme, "logit_mean": o.logit_mean,
                             "logit_std": o.logit_std, "mode_scale": o.mode_scale,
                             "precondition_outputs": o.precondition, "guidance_scale": o.guidance_scale,
                             "max_sequence_length": self.t5_length}
        return extra

    def plot_title(self) -> str:
        return f"{self.name} ({self.family}, {self.registry.world_size} ranks)"

RECIPE = SDFinetune

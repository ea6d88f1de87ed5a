"""The recipe classes the diffusion recipes share: :class:`ImageFinetune`, the image-caption fine-tune lifecycle of
sd_finetune and controlnet (model folder, data, held-out loss, validation grids, resumable state), and
:class:`DiffusionRoles`, the model folder and roles of the RL recipes (diffusion_grpo, diffusion_dpo)."""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

from multiengine.engines import barrier, mean_over_ranks
from multiengine.engines.recipe_config import RecipeConfigError
from multiengine.engines.recipe_lifecycle import Recipe
from multiengine.engines.role_schema import Role, lora_spec, model_path, optim_spec, placement
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion import models, runs
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.rl_runs import PolicyModel, prepare_tiny_pipeline, rl_role_specs
from multiengine.pipelines.diffusion.runs import SHAPES_PROMPTS
from multiengine.pipelines.diffusion.training import heldout_value
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes import diffusion_keys as shared

logger = logging.getLogger(__name__)


def first_last(step_metrics: list[dict[str, float]], key: str) -> dict[str, Any]:
    """first_<key> and final_<key>: the training metric of the first and the last step (None before any)."""
    values = [m[key] for m in step_metrics if key in m]
    return {f"first_{key}": values[0] if values else None, f"final_{key}": values[-1] if values else None}


def step_record(registry: Any, records: list[dict[str, float]], trained: str) -> dict[str, float]:
    """A step's metrics: each the mean over the micro batches that have it and over the ranks, the learning rate of
    the ``trained`` role and the memory per role."""
    out = {key: statistics.fmean(r[key] for r in records if key in r) for key in records[-1]}
    return {**mean_over_ranks(out), "lr": registry[trained].get_lr()[0], **runs.memory_metrics(registry)}


class ImageFinetune(Recipe):
    """A fine-tune on image-caption rows (sd_finetune; controlnet adds a conditioning image per row): the tiny
    model or model.pretrained, the training stream and held-out batches, the held-out loss before and after,
    validation grids before, after and every ``validation.every`` steps. The subclass builds the roles and the
    objective (``build``) and trains (``train_step``)."""

    headline = (("loss", "held-out diffusion loss", False), ("loss_ema", "held-out diffusion loss of the EMA", False))
    plot_panels = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]
    conditioning = False  # the controlnet recipe adds conditioning images to every batch
    trained_role = ""  # "" = the family's denoiser

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.data = shared.image_data(cfg, self.conditioning)
        self.validations: list[dict[str, Any]] = []
        self.heldout: dict[str, float] = {}  # "<tag>/loss" (and "<tag>/loss_ema")
        self.vae_pretrain: dict[str, Any] | None = None  # pretrain_tiny_vae's result when this run did it
        self._rows: Any = None

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.step_metrics]

    @property
    def builtin_data(self) -> bool:
        return not self.data.spec

    @property
    def ema_on(self) -> bool:
        return bool((self.cfg.get("ema") or {}).get("enabled", False))

    @property
    def trained(self) -> str:
        """The trainable role: the denoiser here, the controlnet in the controlnet recipe (``trained_role``)."""
        return self.trained_role or self.denoiser

    def _model_path(self) -> str:
        cfg, registry = self.cfg, self.registry
        if cfg.model.pretrained:
            variant = str(cfg.model.variant) or None
            path = models.resolve_model_path(cfg.model.pretrained, str(cfg.model.revision) or None, variant)
            if cfg.model.tiny_vae_steps and registry.is_main:
                logger.info("model.tiny_vae_steps=%s skipped: model.pretrained=%s brings its own vae",
                            cfg.model.tiny_vae_steps, cfg.model.pretrained)
            return path
        # the tiny model, its vae pretrained on the training images at data.resolution first
        path = self.path(f"tiny_{cfg.model.tiny_family}")
        images = runs.ImageColumn(self.data.first_rows(self.rows().train), "image")
        self.vae_pretrain = runs.prepare_tiny_model(
            path, str(cfg.model.tiny_family), images, seed=cfg.seed, resolution=int(cfg.data.resolution),
            vae_steps=int(cfg.model.tiny_vae_steps), is_main=registry.is_main, device=registry.device)
        return path

    def rows(self) -> Any:
        """The rows once per run (the vae pre-train and _setup_data share them); rank 0 first (it writes the
        datasets cache)."""
        if self._rows is None:
            self._rows = runs.rank0_first(self.registry.is_main, lambda: self.data.load(self.data_source))
        return self._rows

    def make_builtin_data(self, folder: str) -> None:
        cfg = self.cfg
        data_lib.make_shapes_dataset(folder, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed)

    def _data_source(self) -> Any:
        """data.sources / data.source, or the built-in shapes dataset that rank 0 generates under output_dir/data."""
        if not self.builtin_data:
            return self.data.spec
        source = self.path("data", "shapes")
        if self.registry.is_main:
            self.make_builtin_data(source)
        barrier()
        return source

    def make_dataset(self, rows: Any, transform: Any) -> Any:
        return data_lib.ImageCaptionDataset(rows, transform, "image", "caption", seed=self.cfg.seed)

    def _setup_data(self) -> None:
        cfg, registry, rows, d = self.cfg, self.registry, self.rows(), self.cfg.data
        train_rows, heldout_rows = self.data.first_rows(rows.train), self.data.first_heldout(rows.eval)
        self.eval_origin = rows.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        try:
            self.images = runs.caption_batches(
                train_rows, heldout_rows, self.make_dataset, model_path=self.model_path,
                text_encoders=self.text_encoders, t5_tokens=self.t5_length, resolution=d.resolution,
                center_crop=d.center_crop, random_flip=d.random_flip,
                micro_batch_size=int(cfg.roles[self.trained].micro_batch_size), world_size=registry.world_size,
                rank=registry.rank, seed=cfg.seed, num_workers=d.num_workers)
        except ValueError as exc:
            raise RecipeConfigError(f"{exc}: lower roles.{self.trained}.micro_batch_size or add data.") from None
        self.train_set, self.batches, self.heldout_batches = self.images.train_set, self.images.stream(), \
            self.images.heldout
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """validation.prompts; else the shapes prompts for the built-in data, or the first distinct captions of
        the held-out rows (of the training rows when nothing is held out)."""
        v = self.cfg.validation
        if v.prompts:
            return [str(p) for p in v.prompts]
        return list(SHAPES_PROMPTS) if self.builtin_data else runs.validation_captions(rows["caption"], v.num_prompts)

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

    def after_step(self, last: bool) -> None:
        every = self.cfg.validation.every
        if every > 0 and self.step % every == 0 and not last:
            self.validate(f"step_{self.step}")

    # --- evaluation ------------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps (raw denoiser, and the EMA when on), and validation
        images before and after training; all ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            fixed = (self.objective, self.heldout_batches, self.heldout_points, self.cfg.eval.seed)
            result["loss"] = heldout_value(*fixed)
            if self.ema_on:
                result["loss_ema"] = heldout_value(*fixed, role="ema")
            self.heldout.update({f"{tag}/{key}": value for key, value in result.items()})
        if tag in ("before", "after"):
            self.validate(tag)
        return result

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"max_sequence_length": self.t5_length} if self.t5_length else {}

    def validate(self, tag: str) -> None:
        """Images for the validation prompts, on all ranks in lockstep; rank 0 saves the labelled grid."""
        v = self.cfg.validation
        role = "ema" if self.ema_on and v.use_ema else self.trained  # the controlnet recipe has no EMA
        if not v.enabled or not self.prompts:
            return
        self.validations.append(runs.validation_round(
            self.registry, self.metrics, lambda: self.validation_pipeline(role), self.trained, self.prompts,
            self.grid, file=self.path("validation", f"{self.step:06d}_{tag}.png"), tag=tag, step=self.step,
            role=role, resolution=self.cfg.data.resolution, steps=v.num_inference_steps,
            guidance_scale=v.guidance_scale, seed=v.seed, **self.pipeline_kwargs()))

    def grid(self, images: list[Any]) -> Any:
        """The labelled grid of one validation: each image with its prompt and the step."""
        return image_grid(images, prompts=self.prompts, step=self.step)

    def summary_metrics(self) -> dict[str, Any]:
        times = [m["step_time_s"] for m in (self.step_metrics[1:] or self.step_metrics)]
        return {**first_last(self.step_metrics, "loss"),
                "step_time_s_median": statistics.median(times) if times else None,
                **{f"heldout/{k}": v for k, v in self.heldout.items()}}

    def plot_title(self) -> str:
        return f"{self.name} ({self.family}, {self.registry.world_size} ranks)"


class DiffusionRoles(Recipe):
    """The model folder (the tiny one built, its vae and SD unet pretrained on the shapes images, when
    model.pretrained is empty) and the roles every diffusion RL recipe has: policy, ref (when ``uses_ref``), vae
    and the text encoders."""

    roles: tuple[Role, ...] = ()

    def add_denoisers(self, resolution: int, uses_ref: bool, total_steps: int, accum: int) -> None:
        cfg, registry = self.cfg, self.registry
        self.vae_pretrain = self.unet_pretrain = None
        if cfg.model.pretrained:
            self.model_path = models.resolve_model_path(str(cfg.model.pretrained), str(cfg.model.revision) or None,
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
                lora=lora_spec(cfg, "policy", self.family_roles.lora_targets),  # [] = diffusers' targets
                variant=str(cfg.model.variant) or None):
            registry.add(spec)

    def policy_model(self, resolution: int, guidance_scale: float, t5_tokens: int = 0) -> PolicyModel:
        t5 = runs.t5_length(self.family, t5_tokens)
        return PolicyModel(self.registry, self.model_path, self.family, self.text_encoders, resolution=resolution,
                           tokenizers=runs.text_tokenizers(self.model_path, self.text_encoders),
                           token_lengths=runs.token_lengths(self.model_path, self.text_encoders, t5),
                           guidance_scale=guidance_scale)

    def export(self) -> dict[str, Any]:
        """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy."""
        if not self.cfg.export.enabled:
            return {}
        lora = ("policy", self.denoiser, self.family_roles.pipeline) if self.cfg.roles.policy.lora.r else None
        return export_run(self.registry, self.path("export"), self.model_path,
                          {self.denoiser: "policy", "vae": "vae", **{n: n for n in self.text_encoders}},
                          dtype=str(self.cfg.export.dtype), lora=lora, pipeline="policy")

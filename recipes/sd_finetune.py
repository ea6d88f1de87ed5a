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
import statistics
from typing import Any

from multiengine.engines import Placement, barrier, mean_over_ranks
from multiengine.engines.recipe_config import Choice, Each, Key, Range, RecipeConfigError, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, optim_spec, placement, role_keys
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion import models, runs
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles, model_family
from multiengine.pipelines.diffusion.flow import SCHEMES
from multiengine.pipelines.diffusion.inputs import check_resolution, model_folder_family
from multiengine.pipelines.diffusion.runs import SHAPES_PROMPTS, build_tiny_model
from multiengine.pipelines.diffusion.tiny import pretrain_tiny_vae
from multiengine.pipelines.diffusion.training import family_objective, heldout_value, step_generator
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes import diffusion_keys as shared
from multiengine.recipes import plans
from multiengine.recipes.common import recipe_checks

__all__ = ["SHAPES_PROMPTS", "build_tiny_model", "check_family_options", "main"]
logger = logging.getLogger(__name__)


ROLES = (
    Role("unet", "SD 1.x/2.x and SDXL: the denoiser, trained (an SD3/FLUX model refuses these keys: use "
         "roles.transformer)", trainable=True, keys={**shared.TRAINED, "model": shared.component_model("unet")}),
    Role("transformer", "SD3 and FLUX: the denoiser, trained (an SD/SDXL model refuses these keys: use "
         "roles.unet)", trainable=True, keys={**shared.TRAINED, "model": shared.component_model("transformer")}),
    *shared.component_roles("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5"),
)
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
    **shared.DDPM_KEYS, **FLOW_KEYS,
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
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/sd_finetune", "everything the run writes goes under this folder"),
    "max_steps": Key(200, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (diffusers' layout: frozen roles whole)"),
    "model": Key(shared.MODEL_KEYS, "the diffusers pipeline folder to fine-tune"),
    "roles": role_keys(ROLES),
    "diffusion": DIFFUSION_KEYS,
    "data": Key(shared.SD_DATA_KEYS, "image-caption rows (docs/data.md)"),
    "ema": EMA_KEYS,
    "validation": Key(shared.VALIDATION_KEYS, "images generated before, after and every N steps"),
    "eval": shared.EVAL_KEYS,
    "export": Key({
        "enabled": Key(True, "write export/pipeline (and export/lora for LoRA runs)"),
        "dtype": Key("fp32", "dtype of every exported component"),
        "roles": Key([], "per-role folders besides the pipeline, e.g. [unet, ema] ([] = none)"),
    }, "outputs under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = recipe_checks(DEFAULTS, {
    **shared.diffusion_checks(("unet", "transformer"), FAMILIES),
    "diffusion.weighting_scheme": Choice("", *SCHEMES), "diffusion.logit_std": Range(0, min_exclusive=True),
    "diffusion.mode_scale": Range(0), "diffusion.precondition_outputs": Choice(True, False, allow_none=True),
    "diffusion.guidance_scale": Range(0), "diffusion.max_sequence_length": Range(0),
    "ema.min_decay": Range(0, 1), "ema.update_after_step": Range(0), "ema.inv_gamma": Range(0, min_exclusive=True),
    "ema.power": Range(0, min_exclusive=True), "ema.dtype": shared.DTYPE,
    "export.roles": Each(Choice(*(r.name for r in ROLES), "ema")),
})


RENAMED = shared.renamed("unet", " (roles.transformer.* for SD3/FLUX)")


def _changed(cfg: Any, role: str) -> dict[str, Any]:
    """The keys of roles.<role> set to other than their defaults (dotted names below the role)."""
    given, defaults = shared.flat(cfg.roles[role]), shared.flat(DEFAULTS["roles"][role])
    return {key: value for key, value in given.items() if value != defaults[key]}


def check_family_options(cfg: Any, family: str, where: str = "") -> None:
    """The settings of what this family does not have are an error, never silently ignored: the other
    denoiser's role keys, and the other objective's diffusion.* keys."""
    suffix = f" ({where})" if where else ""
    denoiser = family_roles(family).denoiser
    other = "transformer" if denoiser == "unet" else "unet"
    for key, value in _changed(cfg, other).items():
        raise config_problem(f"roles.{other}.{key}", value, f"is set, but this {family} model has no "
                                 f"{other}{suffix}: its denoiser is roles.{denoiser}",
                                 f"set roles.{denoiser}.{key} instead")
    ddpm = family_roles(family).objective != "flow"
    for key, default in (FLOW_KEYS if ddpm else shared.DDPM_KEYS).items():
        if cfg.diffusion[key] != default.default:
            kind = "flow-matching families (sd3, flux)" if ddpm else "DDPM families (sd, sdxl)"
            raise config_problem(f"diffusion.{key}", cfg.diffusion[key], f"applies to the {kind}, not to this "
                                 f"{family} model{suffix}", f"drop diffusion.{key}")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts, without building a model: the model folder (and its family's options), the
    data sources, columns and rows, held-out size against the rows, every image readable, and a micro batch of
    training images per rank on ``world_size`` ranks."""
    shared.check_components(cfg, tuple(r.name for r in ROLES))
    family = model_folder_family(str(cfg.model.pretrained), str(cfg.model.tiny_family))
    if family:
        check_family_options(cfg, family)
        check_resolution(int(cfg.data.resolution), family, str(cfg.model.pretrained))
        denoiser = family_roles(family).denoiser
    else:  # a hub name: the family is known once downloaded; the denoiser the config sets, else the unet
        denoiser = "transformer" if _changed(cfg, "transformer") else "unet"
    shared.check_data(cfg, world_size, denoiser)


class SDFinetune(Recipe):
    """diffusers' text-to-image fine-tunes (SD, SDXL) and SD3 / FLUX flow-matching fine-tunes on the shared
    lifecycle; validation grids before, after and every ``validation.every`` steps."""

    name = "sd_finetune"
    headline = (("loss", "held-out diffusion loss", False), ("loss_ema", "held-out diffusion loss of the EMA", False))
    plot_panels = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]
    conditioning = False  # the controlnet recipe adds conditioning images to every batch

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
        """The trainable role: the denoiser here, the controlnet in the controlnet recipe."""
        return self.denoiser

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg = self.cfg
        # 1. data and model folder: rank 0 generates / builds / downloads while the others wait
        self.data_source = self._data_source()
        self.model_path = self._model_path()
        self.family = model_family(self.model_path)
        self.family_roles = family_roles(self.family)
        self.denoiser = self.family_roles.denoiser
        self.check_family(self.model_path)
        self.text_encoders = models.text_encoder_names(self.model_path)
        self.t5_length = runs.t5_length(self.family, cfg.diffusion.get("max_sequence_length", 0))
        # 2. roles: each its own engine with its own placement
        self.add_roles()
        self.registry.build()
        # 3. the objective of the family (and its prediction type), then the data
        self.objective, self.prediction_type = self.make_objective()
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
        for spec in models.diffusion_role_specs(
            self.model_path, mode=cfg.mode, unet=place, vae=placement(cfg, ROLES, "vae"),
            text_encoder={n: placement(cfg, ROLES, n) for n in self.text_encoders}, ema=ema,
            optim=optim_spec(cfg, d, cfg.max_steps, eps=float(cfg.diffusion.adam_epsilon)),
            micro_batch_size=cfg.roles[d].micro_batch_size, grad_accum=cfg.roles[d].grad_accum,
            gradient_checkpointing=cfg.roles[d].gradient_checkpointing, lora=lora,
            variant=str(cfg.model.variant) or None, seed=cfg.seed, denoiser=d,
        ):
            self.registry.add(spec)

    def flow_options(self) -> dict[str, Any]:
        names = [k for k in FLOW_KEYS if k != "max_sequence_length"]  # the objective's; the T5 length is the data's
        return runs.flow_options(self.family, **{k: self.cfg.diffusion[k] for k in names})

    def make_objective(self, **extra: Any) -> tuple[Any, str | None]:
        d = self.cfg.diffusion
        flow = self.flow_options() if self.family_roles.objective == "flow" else None
        return family_objective(self.registry, self.model_path, self.family, self.text_encoders,
                                resolution=self.cfg.data.resolution, prediction_type=d.prediction_type,
                                snr_gamma=d.snr_gamma, noise_offset=d.noise_offset,
                                input_perturbation=d.input_perturbation, flow_options=flow, **extra)

    def _model_path(self) -> str:
        cfg = self.cfg
        if cfg.model.pretrained:
            variant = str(cfg.model.variant) or None
            path = models.resolve_model_path(cfg.model.pretrained, str(cfg.model.revision) or None, variant)
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
        train = self.data.first_rows(self.rows().train)
        if registry.is_main:
            logger.info("model.tiny_vae_steps=%s: the random tiny vae learns the training images first (0 skips "
                        "it)", cfg.model.tiny_vae_steps)
        self.vae_pretrain = pretrain_tiny_vae(
            path, runs.ImageColumn(train, "image"), int(cfg.model.tiny_vae_steps), seed=cfg.seed,
            resolution=int(cfg.data.resolution), device=registry.device)
        barrier()

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
        e = cfg.ema if self.ema_on else None
        decay = None if e is None else models.update_ema(
            registry, self.step + 1, e.decay, e.use_ema_warmup, min_decay=e.min_decay,
            update_after_step=e.update_after_step, inv_gamma=e.inv_gamma, power=e.power, source=self.trained)
        # 7. the loss averaged over micro batches and ranks, lr, memory per role
        record = {**mean_over_ranks({"loss": statistics.fmean(micro_losses)}), "lr": engine.get_lr()[0],
                  **runs.memory_metrics(registry)}
        if decay is not None:
            record["ema_decay"] = decay
        return record

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

    def validation_role(self) -> str:
        return "ema" if self.ema_on and self.cfg.validation.use_ema else self.trained

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"max_sequence_length": self.t5_length} if self.t5_length else {}

    def validate(self, tag: str) -> None:
        """Images for the validation prompts, on all ranks in lockstep; rank 0 saves the labelled grid."""
        v, role = self.cfg.validation, self.validation_role()
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

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        role = "ema" if self.ema_on else self.trained
        lora = (role, self.denoiser, self.family_roles.pipeline) if cfg.roles[self.denoiser].lora.r else None
        return export_run(self.registry, self.path("export"), self.model_path,
                          {self.denoiser: role, "vae": "vae", **{name: name for name in self.text_encoders}},
                          dtype=cfg.export.dtype, prediction_type=self.prediction_type,
                          roles=list(cfg.export.roles), lora=lora)

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
plan = plans.sd_finetune  # what `multiengine plan` sees of this recipe

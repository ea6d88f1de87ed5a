"""What the diffusion recipes share: component roles, the checks of a folder's family against the keys, the
image-caption fine-tune (:class:`ImageFinetune`), the RL recipes' model and roles (:class:`DiffusionRL`), plans."""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Mapping
from typing import Any

from multiengine.engines import barrier, mean_over_ranks
from multiengine.engines import planner as P
from multiengine.pipelines.checks import check_rows_per_rank
from multiengine.pipelines.diffusion import planning as D
from multiengine.pipelines.diffusion import runs
from multiengine.pipelines.diffusion.data import make_shapes_dataset, shapes_captions
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.inputs import check_config_folder, check_resolution, model_folder_family
from multiengine.pipelines.diffusion.models import SEED_BASELINE, load_component, update_ema
from multiengine.pipelines.diffusion.rl_runs import PolicyModel, denoiser_factory, prepare_tiny_pipeline
from multiengine.pipelines.diffusion.training import family_objective, heldout_loss, step_generator
from multiengine.pipelines.diffusion.validation import build_pipeline, image_grid
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import (
    Key,
    RecipeConfigError,
    config_problem,
    defaults_of,
    flatten,
    recipe_schema,
)
from multiengine.recipes.language.lifecycle import Recipe
from multiengine.recipes.language.roles import Role

# What a trained denoiser (or controlnet) changes from the shared role defaults: the tiny run's optimisation,
# diffusers' AdamW weight decay, LoRA targets from the family.
TRAINED: dict[str, Any] = {
    "dtype": "fp32", "lr": 1e-3, "weight_decay": 1e-2, "scheduler": "constant_with_warmup", "warmup_steps": 5,
    "micro_batch_size": Key(8, "images per rank per forward (global batch = micro x grad_accum x ranks)"),
}
# Frozen components: fp32 on CPU, gathered whole once per call (one collective; 1/N between calls).
FROZEN: dict[str, Any] = {"dtype": "fp32", "gather_forward": True}
COMPONENT_WHY = ("a component comes from its folder of model.pretrained (a diffusers pipeline): it has no model or "
                 "tokenizer of its own")
PLACEMENT = ("stage", "offload_params", "gather_forward")  # what seed_baseline decides for a frozen role
SEED_BASELINE_NOTE = "seed_baseline: full copy"


def renamed(trained: str, hint: str = "") -> dict[str, str]:
    """The old keys of the image fine-tunes (train.*, lora.*, flow.*) -> their new names; ``hint`` follows a role
    key's new name."""
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
                "model.tiny_text_encoders": "model.tiny_family (sdxl: two text encoders)"})
    return out


def component(name: str, help: str, **declaration: Any) -> Role:
    """A role whose weights are the folder ``name`` of model.pretrained: no model or tokenizer key."""
    return Role(name, help, omit=("model", "tokenizer"), why=COMPONENT_WHY, **declaration)


def components(*encoders: str, vae: str = "frozen: latents of the training images, validation decodes"
               ) -> tuple[Role, ...]:
    """The frozen vae and text encoders; ``encoders``: the help of text_encoder_2, text_encoder_3, ... (each placed
    like text_encoder unless it says otherwise)."""
    return (component("vae", vae, defaults=FROZEN),
            component("text_encoder", "frozen: the first text encoder (CLIP-L)", defaults=FROZEN),
            *(component(f"text_encoder_{i}", text, follows="text_encoder", defaults={"gather_forward": True})
              for i, text in enumerate(encoders, start=2)))


def changed(recipe: Any, cfg: Any, role: str) -> dict[str, Any]:
    """The keys of ``roles.<role>`` set to other than the recipe's defaults."""
    default = flatten(defaults_of(recipe_schema(recipe))["roles"][role])
    return {k: v for k, v in flatten(cfg.roles[role]).items() if k in default and v != default[k]}


def unset(section: Any, names: tuple[str, ...], prefix: str, why: str) -> dict[str, tuple[Any, str]]:
    """{key: (value, why)} of the fields of ``section`` among ``names`` set to other than their defaults."""
    fields = type(section).__dataclass_fields__
    return {f"{prefix}.{n}": (getattr(section, n), why) for n in names
            if getattr(section, n) != (fields[n].default_factory() if callable(fields[n].default_factory)
                                       else fields[n].default)}


def refuse(unused: Mapping[str, tuple[Any, str]], where: str = "") -> None:
    """The first of ``unused`` ({key: (value, why)}, :func:`unset`) as the config error."""
    for key, (value, why) in unused.items():
        raise config_problem(key, value, f"{why}{where}", f"drop {key}")


def first_last(step_metrics: list[dict[str, float]], key: str) -> dict[str, Any]:
    """first_<key> and final_<key>: the training metric of the first and the last step (None before any)."""
    values = [m[key] for m in step_metrics if key in m]
    return {f"first_{key}": values[0] if values else None, f"final_{key}": values[-1] if values else None}


def step_record(registry: Any, records: list[dict[str, float]], trained: str) -> dict[str, float]:
    """A step's metrics: each the mean over the micro batches that have it and over the ranks, the learning rate of
    the ``trained`` role and the memory per role."""
    out = {key: statistics.fmean(r[key] for r in records if key in r) for key in records[-1]}
    return {**mean_over_ranks(out), "lr": registry[trained].get_lr()[0], **runs.memory_metrics(registry)}


class DiffusionRecipe(Recipe):
    """A recipe on a diffusers pipeline: its family (from the folder, or the tiny model's) decides which declared
    roles are built (:meth:`role_specs`) and which options apply (:meth:`unused`); the rest is refused."""

    resolution_key = "data.resolution"

    @classmethod
    def resolution(cls, cfg: Any) -> int:
        return int(cfg.data.resolution)

    @classmethod
    def family_of(cls, cfg: Any) -> str:
        """The family of model.pretrained (checked; its image side too), the tiny model's without one, "" for a
        hub name (known once downloaded)."""
        m = cfg.model
        if m.pretrained and m.revision and os.path.isdir(os.path.expanduser(m.pretrained)):
            raise config_problem("model.revision", m.revision, "applies to a hub name, and model.pretrained is a "
                                 "local folder", "drop model.revision")
        family = model_folder_family(m.pretrained, m.tiny_family)
        if family:
            check_resolution(cls.resolution(cfg), family, m.pretrained, cls.resolution_key)
        return family

    @classmethod
    def absent(cls, cfg: Any, family: str) -> dict[str, tuple[str, str]]:
        """{declared role the run does not build: (why, fix)}; the fix may name ``{key}``."""
        fr = family_roles(family)
        out = {n: (f"this {family} model has no {n}", "drop roles.{role}.{key}") for n in cfg.roles
               if n.startswith("text_encoder") and n not in fr.text_encoders}
        other = "transformer" if fr.denoiser == "unet" else "unet"
        if other in cfg.roles and cfg.roles.declaration(other).trainable:
            out[other] = (f"this {family} model has no {other}: its denoiser is roles.{fr.denoiser}",
                          f"set roles.{fr.denoiser}.{{key}} instead")
        return out

    @classmethod
    def unused(cls, cfg: Any, family: str) -> dict[str, tuple[Any, str]]:
        """{key: (value, why)} of the options set that this family has no use for."""
        return {}

    @classmethod
    def check_family(cls, cfg: Any, family: str, where: str = "") -> None:
        """What ``family`` (and the config) has no use for is refused: the keys of a role it does not build and its
        unused options (:meth:`unused`). (LoRA options without LoRA are refused by the roles' own `when`.)"""
        where = f" ({where})" if where else ""
        for name, (why, fix) in cls.absent(cfg, family).items():
            for key, value in changed(cls, cfg, name).items():
                raise config_problem(f"roles.{name}.{key}", value, f"is set, but {why}{where}",
                                     fix.format(role=name, key=key))
        refuse(cls.unused(cfg, family), where)

    @classmethod
    def role_specs(cls, cfg: Any, family: str, model_path: str) -> list[Any]:
        """The RoleSpecs the run builds on the folder ``model_path`` of ``family``."""
        raise NotImplementedError

    @classmethod
    def describe(cls, cfg: Any) -> dict[str, Any]:
        out = {k: v for k, v in cfg.to_dict().items() if k != "roles"}
        family = cls.family_of(cfg) or cfg.model.tiny_family
        folder = cfg.model.pretrained or os.path.join(cfg.output_dir, f"tiny_{family}")
        out["roles"] = {}
        for spec in cls.role_specs(cfg, family, folder):
            role = cfg.roles[spec.name]
            out["roles"][spec.name] = {**spec.describe(), "model": role.model_path()}
            if cfg.roles.declaration(spec.name).follows:  # its own stage and dtype stay when the leader's change
                out["roles"][spec.name]["follows"] = {"stage": role.stage, "dtype": role.dtype}
        return out

    def set_family(self, model_path: str) -> None:
        """The run's model folder and what its family makes of it; the family's checks again (a hub name's family
        is known only now)."""
        self.model_path, self.family = model_path, model_family(model_path)
        self.family_roles = family_roles(self.family)
        self.denoiser, self.text_encoders = self.family_roles.denoiser, list(self.family_roles.text_encoders)
        self.check_family(self.cfg, self.family, model_path)


def component_loader(cfg: Any, model_path: str) -> Any:
    """``load(name)``: a role factory of the component ``name`` of ``model_path`` (with model.variant)."""
    variant = (cfg.model.variant or None) if cfg.model.pretrained else None
    return lambda name: (lambda: load_component(model_path, name, variant))


# --- sd_finetune and controlnet -----------------------------------------------------------------------------------
class ImageFinetune(DiffusionRecipe):
    """A fine-tune on image-caption rows (sd_finetune, controlnet): data, held-out loss before and after, validation
    grids. ``trained_role``: "" = the denoiser."""

    headline = (("loss", "held-out diffusion loss", False), ("loss_ema", "held-out diffusion loss of the EMA", False))
    plot_panels = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]
    trained_role = ""
    ema_on = False

    @classmethod
    def frozen(cls, cfg: Any, family: str) -> list[str]:
        """The frozen roles built for ``family`` ("": every declared frozen component, a hub name's family is not
        known yet)."""
        if not family:
            return [n for n in cfg.roles if not cfg.roles.declaration(n).trainable and n != "ema"]
        fr = family_roles(family)
        return ["vae", *fr.text_encoders] if not cls.trained_role else [fr.denoiser, "vae", *fr.text_encoders]

    @classmethod
    def check_image_run(cls, cfg: Any, world_size: int, family: str) -> None:
        """The keys against the folder's ``family``, seed_baseline, export.roles, the data and a micro batch per
        rank on ``world_size`` ranks."""
        if family:
            cls.check_family(cfg, family)
        trained = cls.trained_role or cls.denoiser_of(cfg, family)
        if cfg.mode == SEED_BASELINE:
            for name in cls.frozen(cfg, family):
                for key in set(changed(cls, cfg, name)) & set(PLACEMENT):
                    raise config_problem(f"roles.{name}.{key}", getattr(cfg.roles[name], key), "is set, but mode="
                                         "seed_baseline builds every frozen role whole at stage 0 (diffusers' layout)",
                                         f"drop roles.{name}.{key}, or set mode=zero3")
        built = {s.name for s in cls.role_specs(cfg, family, "")} if family else set(cfg.roles)
        extra = [r for r in cfg.export.roles if r not in built]
        if extra:
            raise config_problem("export.roles", list(cfg.export.roles), f"names {extra}, not among the roles this "
                                 f"run builds {sorted(built)}", "name built roles only")
        d, micro = cfg.data, cfg.roles[trained].micro_batch_size
        d.check_rows(cfg.eval.heldout_size)
        train, held = d.training_rows(cfg.eval.heldout_size, cfg.seed)
        if d.max_train_samples and train == d.max_train_samples and train // world_size < micro:
            raise config_problem("data.max_train_samples", train, f"gives {train // world_size} training images per "
                                 f"rank on {world_size} ranks, fewer than roles.{trained}.micro_batch_size={micro}",
                                 f"set data.max_train_samples to {micro * world_size} or more (0 = all rows)")
        check_rows_per_rank(train, world_size, key=f"roles.{trained}.micro_batch_size",
                            value=micro, unit="images", heldout=held,
                            heldout_key=d.split_key())

    @classmethod
    def denoiser_of(cls, cfg: Any, family: str) -> str:
        """The family's denoiser; for a hub name (family "") the one the config sets, else the unet."""
        if family:
            return family_roles(family).denoiser
        return "transformer" if "transformer" in cfg.roles and changed(cls, cfg, "transformer") else "unet"

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
        return not self.cfg.data.spec

    @property
    def trained(self) -> str:
        return self.trained_role or self.denoiser

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg = self.cfg
        # 1. data and model folder: rank 0 generates / builds / downloads while the others wait
        self.data_source = self._data_source()
        self.set_family(self._model_path())
        self.t5_length = runs.t5_length(self.family, getattr(cfg.diffusion, "max_sequence_length", 0))
        # 2. roles: each its own engine with its own placement
        for spec in self.role_specs(cfg, self.family, self.model_path):
            self.registry.add(spec)
        self.registry.build()
        # 3. the objective of the family (and its prediction type), then the data
        self.objective, self.prediction_type = family_objective(
            self.registry, self.model_path, self.family, self.text_encoders, cfg.diffusion, cfg.data.resolution,
            self.conditioning_scale())
        self._setup_data()

    def conditioning_scale(self) -> float | None:
        return None

    def _model_path(self) -> str:
        cfg, registry = self.cfg, self.registry
        if cfg.model.pretrained:
            return cfg.model.path()
        # the tiny model, its vae pretrained on the training images at data.resolution first
        path = self.path(f"tiny_{cfg.model.tiny_family}")
        images = runs.ImageColumn(cfg.data.first_rows(self.rows().train), "image")
        self.vae_pretrain = runs.prepare_tiny_model(
            path, cfg.model.tiny_family, images, seed=cfg.seed, resolution=cfg.data.resolution,
            vae_steps=cfg.model.tiny_vae_steps, is_main=registry.is_main, device=registry.device)
        return path

    def rows(self) -> Any:
        """The rows once per run (the vae pre-train and the data share them); rank 0 first (it writes the datasets
        cache)."""
        if self._rows is None:
            load = functools.partial(self.cfg.data.load, self.data_source, self.cfg.eval.heldout_size, self.cfg.seed)
            self._rows = runs.rank0_first(self.registry.is_main, load)
        return self._rows

    def _data_source(self) -> Any:
        """data.sources / data.source, or the built-in shapes dataset that rank 0 generates under output_dir/data."""
        d = self.cfg.data
        if not self.builtin_data:
            return d.spec
        source = self.path("data", "shapes")
        if self.registry.is_main:
            make_shapes_dataset(source, d.builtin_size, d.resolution, seed=self.cfg.seed,
                                conditioning=d.conditioning_kind if d.conditioning else "")
        barrier()
        return source

    def make_dataset(self, rows: Any, train: bool) -> Any:
        from multiengine.pipelines.diffusion.data import ImageCaptionDataset

        return ImageCaptionDataset(rows, self.cfg.data.transform(train), "image", "caption", seed=self.cfg.seed,
                                   conditioning_column="conditioning_image" if self.cfg.data.conditioning else None)

    def _setup_data(self) -> None:
        cfg, registry, rows, held = self.cfg, self.registry, self.rows(), self.cfg.eval.heldout_size
        train_rows = cfg.data.first_rows(rows.train)
        heldout_rows = None if rows.eval is None or not held else rows.eval.select(range(min(held, len(rows.eval))))
        self.eval_origin = rows.eval_origin
        self.prompts = self.validation_prompts(heldout_rows if heldout_rows is not None else train_rows)
        collate = runs.caption_collate(self.model_path, self.text_encoders, self.t5_length)
        try:
            heldout = None if heldout_rows is None else self.make_dataset(heldout_rows, False)
            self.images = runs.TrainImages(
                self.make_dataset(train_rows, True), heldout, collate, micro_batch_size=cfg.roles[self.trained]
                .micro_batch_size, world_size=registry.world_size, rank=registry.rank, seed=cfg.seed,
                num_workers=cfg.data.num_workers)
        except ValueError as exc:
            raise RecipeConfigError(f"{exc}: lower roles.{self.trained}.micro_batch_size or add data.") from None
        self.train_set, self.batches, self.heldout_batches = self.images.train_set, self.images.stream(), \
            self.images.heldout
        self.heldout_points = self.objective.heldout_points(cfg.eval.timesteps)

    def validation_prompts(self, rows: Any) -> list[str]:
        """validation.prompts; else validation.num_prompts shapes prompts for the built-in data, or the first distinct
        captions of the held-out rows (of the training rows when nothing is held out)."""
        v = self.cfg.validation
        if v.prompts:
            return list(v.prompts)
        captions = [*runs.SHAPES_PROMPTS, *shapes_captions()] if self.builtin_data else rows["caption"]
        return runs.validation_captions(captions, v.num_prompts)

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
        # 5. the EMA (sd_finetune), then the loss averaged over micro batches and ranks, lr, memory per role
        extra = self.ema_step()
        return {**step_record(registry, records, self.trained), **extra}

    def ema_step(self) -> dict[str, float]:
        if not self.ema_on:
            return {}
        return {"ema_decay": update_ema(self.registry, self.step + 1, self.cfg.ema, self.trained)}

    def after_step(self, last: bool) -> None:
        v = self.cfg.validation
        if v.enabled and v.every > 0 and self.step % v.every == 0 and not last:
            self.validation_images(f"step_{self.step}")

    # --- evaluation ------------------------------------------------------------------------------
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps (the trained role, and the EMA when on), and validation images
        before and after training; all ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            fixed = (self.objective, self.heldout_batches, self.heldout_points, self.cfg.eval.seed)
            result["loss"] = heldout_loss(*fixed)
            if self.ema_on:
                result["loss_ema"] = heldout_loss(*fixed, role="ema")
            self.heldout.update({f"{tag}/{key}": value for key, value in result.items()})
        if tag in ("before", "after"):
            self.validation_images(tag)
        return result

    def validation_role(self) -> str:
        return self.trained

    def validation_pipeline(self, role: str) -> Any:
        return build_pipeline(self.registry, self.model_path, self.text_encoders, role, self.prediction_type,
                              denoiser=self.denoiser)

    def pipeline_kwargs(self) -> dict[str, Any]:
        return {"max_sequence_length": self.t5_length} if self.t5_length else {}

    def validation_images(self, tag: str) -> None:
        """Images for the validation prompts on all ranks in lockstep; rank 0 saves the labelled grid at
        validation/<step>_<tag>.png with its index.jsonl entry and logs it to TensorBoard."""
        import logging
        import time

        v, registry = self.cfg.validation, self.registry
        if not v.enabled or not self.prompts:
            return
        role, t0 = self.validation_role(), time.perf_counter()
        pipe = self.validation_pipeline(role)
        images = runs.run_validation(registry, pipe, self.trained, self.prompts, v, self.cfg.data.resolution,
                                     **self.pipeline_kwargs())
        del pipe
        file = self.path("validation", f"{self.step:06d}_{tag}.png")
        entry = {"step": self.step, "tag": tag, "file": file, "role": role, "prompts": list(self.prompts),
                 "seconds": time.perf_counter() - t0}
        if registry.is_main:
            grid = self.grid(images)
            runs.save_validation(file, entry, grid)
            # One tag for every validation, so TensorBoard's step slider walks through before/step_N/after.
            self.metrics.log_image(self.step, "validation/grid", grid)
            logging.getLogger(__name__).info("validation grid (%s, step %d, %s): %s", tag, self.step, role, file)
        self.metrics.log(self.step, {"images": len(images), "seconds": entry["seconds"]}, prefix="validation")
        self.validations.append(entry)

    def grid(self, images: list[Any]) -> Any:
        """The labelled grid of one validation: each image with its prompt and the step."""
        return image_grid(images, prompts=self.prompts, step=self.step)

    def summary_metrics(self) -> dict[str, Any]:
        times = [m["step_time_s"] for m in (self.step_metrics[1:] or self.step_metrics)]
        return {**first_last(self.step_metrics, "loss"),
                "step_time_s_median": statistics.median(times) if times else None,
                **{f"heldout/{k}": v for k, v in self.heldout.items()}}

    def summary_extra(self) -> dict[str, Any]:
        extra = {"mode": self.cfg.mode, "family": self.family, "denoiser": self.denoiser,
                 "model_path": self.model_path, "text_encoders": self.text_encoders,
                 "evaluation_rows": self.eval_origin, "validation": self.validations}
        if self.vae_pretrain is not None:
            extra["tiny_vae_pretrain"] = self.vae_pretrain
        return extra

    def plot_title(self) -> str:
        return f"{self.name} ({self.family}, {self.registry.world_size} ranks)"

    def export_run(self, components: dict[str, str], **options: Any) -> dict[str, Any]:
        return export_run(self.registry, self.path("export"), self.model_path, components, self.cfg.export,
                          prediction_type=self.prediction_type, **options)

    @classmethod
    def image_plan(cls, cfg: Any, assume: Any, trained: str | None) -> list[plans.RecipePlan]:
        """The trained role, the frozen denoiser it feeds (controlnet), vae, text encoders (whole at stage 0 in
        seed_baseline mode) and the trained role's EMA where on."""
        components_, source = plans.resolve_pipeline(
            cfg.model.pretrained, variant=cfg.model.variant or None, assume=assume,
            tiny=lambda: D.tiny_pipeline(cfg.output_dir, cfg.seed, cfg.data.resolution, cfg.model.tiny_family))
        denoiser = D.denoiser_name(components_, cls.name, source, controlnet=trained is not None)
        trained = trained or denoiser
        r, t = cfg.roles, cfg.roles[trained]
        baseline = cfg.mode == SEED_BASELINE
        res, batch = cfg.data.resolution, t.micro_batch_size
        vae, net = components_["vae"], components_[denoiser]
        scale = D.vae_scale(vae)
        lora = plans.lora_choice(t.lora, family_roles(D.pipeline_family(components_)).lora_targets)
        encoders = D.encoder_names(components_)
        infos = {denoiser: net, "vae": vae, **{n: components_[n] for n in encoders}}
        if trained != denoiser:
            infos[trained] = P.model_info(t.model, cfg.model.variant or None) if os.path.isdir(t.model) \
                else D.meta_controlnet(net, scale)
        tokens, text = D.text_tokens(components_, getattr(cfg.diffusion, "max_sequence_length", 0))
        v = cfg.validation
        prompts = (len(v.prompts) or v.num_prompts) if v.enabled else 0

        def denoiser_phases(dtype: str, trainable: bool, checkpointing: bool) -> list[tuple[str, int]]:
            act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=scale, dtype=dtype,
                                    text_tokens=text)
            train = act(batch=batch, trainable=trainable, checkpointing=checkpointing)
            val = act(batch=2 * prompts, trainable=False, checkpointing=False) if prompts else 0
            return [("train step", train)] + ([("validation", val)] if val else [])

        vae_act = functools.partial(D.vae_activation_bytes, vae, resolution=res, dtype=r.vae.effective_dtype)
        phases = {trained: denoiser_phases(t.effective_dtype, True, t.gradient_checkpointing),
                  "vae": [("encode", vae_act(batch=batch))]
                  + ([("validation decode", vae_act(batch=prompts))] if prompts else []),
                  **encode_phases(cfg, components_, batch, tokens)}
        options: dict[str, Any] = {"vae": plans.gather_options(r.vae, "encode", "validation decode"),
                                   **{n: plans.gather_options(r[n], "encode") for n in encoders}}
        options[trained] = {"lora": lora}
        if lora:
            options[trained]["note"] = "LoRA: activations estimated as for a full fine-tune (an upper bound)"
        if trained != denoiser:  # the frozen denoiser the trained role feeds (ControlNet); its backward runs too
            phases[denoiser] = denoiser_phases(r[denoiser].effective_dtype, True, False)
            options[denoiser] = {"note": "frozen; activations kept for the trained role's backward"}
        pinned = {n: P.Choice(0) for n in infos if n != trained} if baseline else {}
        for n in pinned:
            options.setdefault(n, {})["note"] = SEED_BASELINE_NOTE
        notes = [f"model: {source}", f"{res}x{res} px (latents {res // scale}x{res // scale}), micro batch {batch}"
                 + (", gradient checkpointing" if t.gradient_checkpointing else "")]
        plan = plans.declared_roles(cfg, infos, phases, title=cls.name, notes=notes, pinned=pinned, followers=True,
                                    **options)
        if cls.ema_enabled(cfg):  # the trained role's weights (and adapters), sharded like it
            e = cfg.roles.ema
            plan.roles.append(plans.role_plan(
                "ema", infos[trained], e.effective_dtype, trainable=False, lora=lora,
                current=plans.current_choice(0 if baseline else t.effective_stage, False, e.offload_params),
                choices=(P.Choice(0),) if baseline else (), follows=None if baseline else trained,
                note=SEED_BASELINE_NOTE if baseline else f"sharded like the {trained} (same stage)"))
            if not baseline:
                plan.keys["ema"] = plans.RoleKeys(None, "roles.ema.offload_params")
        return [plan]

    @classmethod
    def ema_enabled(cls, cfg: Any) -> bool:
        return False


def encode_phases(cfg: Any, components_: Mapping[str, P.ModelInfo], rows: int,
                  tokens: Mapping[str, int]) -> dict[str, list[tuple[str, int]]]:
    """Each text encoder's forward ("encode") over ``rows`` prompts of its ``tokens``."""
    return {n: plans.lm_role_phases(cfg.roles[n], components_[n], forward=(rows, tokens[n]), logits=False,
                                    label="encode") for n in D.encoder_names(components_)}


# --- diffusion_grpo and diffusion_dpo -------------------------------------------------------------------------------
POLICY: dict[str, Any] = {
    "dtype": "fp32", "stage": 2, "lr": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0,
    "model": Key("", "a folder holding the denoiser (config.json + weights, e.g. an export's unet/); \"\" = the "
                     "unet/ or transformer/ of model.pretrained"),
    "micro_batch_size": Key(16, "images per rank per rollout (prompts x diffusion.group_size)"),
    "grad_accum": Key(1, "rollouts per optimizer step (each trains on its sampled steps; the engine accumulates "
                         "grad_accum x the trained steps)"),
}
DENOISER_WHY = "the denoiser's tokenizers are model.pretrained's"


def rl_roles(policy: Mapping[str, Any], ref: str, *extra: Role, vae: str) -> tuple[Role, ...]:
    """policy (trained), ref (frozen; a separate copy of the policy's starting weights, ZeRO-3 whatever the policy's
    stage, its dtype the policy's), ``extra`` roles, the vae and the text encoders."""
    stage = Key(3, "ZeRO stage 0-3 (a frozen role asked for stage 1 or 2 is built at 0: nothing to partition but "
                   "its weights)")
    return (Role("policy", "the denoiser trained (SD/SDXL unet, SD3/FLUX transformer)", trainable=True,
                 defaults=policy, omit=("tokenizer",), why=DENOISER_WHY),
            Role("ref", ref, follows="policy", weights="policy", defaults={"stage": stage, "gather_forward": True},
                 omit=("tokenizer",), why=DENOISER_WHY),
            *extra, *components("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5", vae=vae))


class DiffusionRL(DiffusionRecipe):
    """The model folder (the tiny one built and pretrained when model.pretrained is empty) and the roles every
    diffusion RL recipe has: policy, ref (``uses_ref``), vae and text encoders."""

    @classmethod
    def uses_ref(cls, cfg: Any) -> bool:
        return True

    @classmethod
    def absent(cls, cfg: Any, family: str) -> dict[str, tuple[str, str]]:
        out = super().absent(cfg, family)
        if not cls.uses_ref(cfg):
            out["ref"] = ("diffusion.kl_coef=0 builds no ref role", "drop roles.ref.{key}, or set diffusion.kl_coef")
        return out

    @classmethod
    def check_rl_model(cls, cfg: Any) -> str:
        """The policy and ref folders, the pipeline folder's family and image side, and the family's keys; before
        any rank starts."""
        for name in ("policy", "ref"):
            check_config_folder(f"roles.{name}.model", cfg.roles[name].model, "a denoiser folder",
                                f"give a unet/ or transformer/ folder, or set roles.{name}.model=\"\"")
        family = cls.family_of(cfg)
        if family:
            cls.check_family(cfg, family)
        return family

    @classmethod
    def role_specs(cls, cfg: Any, family: str, model_path: str) -> list[Any]:
        fr, r = family_roles(family), cfg.roles
        load = component_loader(cfg, model_path)
        default = {"policy": os.path.join(model_path, fr.denoiser)}
        variant = (cfg.model.variant or None) if cfg.model.pretrained else None

        def denoiser(name: str) -> Any:
            return denoiser_factory(model_path, fr.denoiser, r[name].model_path(default), variant)

        specs = [r.policy.spec(denoiser("policy"), total_steps=cfg.max_steps, seed=cfg.seed, rows=cls.rows_per_item,
                               accum=cls.accum(cfg), lora_targets=fr.lora_targets)]
        if cls.uses_ref(cfg):
            specs.append(r.ref.spec(denoiser("ref")))
        return specs + [r[n].spec(load(n)) for n in ("vae", *fr.text_encoders)] + cls.extra_specs(cfg)

    rows_per_item = 1  # rows of one micro-batch item (a DPO pair is 2 images)

    @classmethod
    def accum(cls, cfg: Any) -> int:
        return 1

    @classmethod
    def extra_specs(cls, cfg: Any) -> list[Any]:
        return []

    def add_denoisers(self, resolution: int) -> None:
        """The model folder (the tiny pipeline built and pretrained here when model.pretrained is empty) and the
        roles of :meth:`role_specs`, added to the registry (not built)."""
        cfg, registry = self.cfg, self.registry
        self.vae_pretrain = self.unet_pretrain = None
        if cfg.model.pretrained:
            path = cfg.model.path()
        else:
            m = cfg.model
            path = self.path(f"tiny_{m.tiny_family}")
            done = prepare_tiny_pipeline(path, self.path("data", "shapes"), m.tiny_family, seed=cfg.seed,
                                         resolution=resolution, vae_steps=m.tiny_vae_steps,
                                         unet_steps=m.tiny_unet_steps, is_main=registry.is_main,
                                         device=registry.device)
            self.vae_pretrain, self.unet_pretrain = done["vae"], done["unet"]
        self.set_family(path)
        for spec in self.role_specs(cfg, self.family, self.model_path):
            registry.add(spec)

    def policy_model(self, resolution: int, guidance_scale: float, t5_tokens: int = 0) -> PolicyModel:
        return PolicyModel(self.registry, self.model_path, self.family, resolution=resolution,
                           guidance_scale=guidance_scale, t5_tokens=t5_tokens)

    def export(self) -> dict[str, Any]:
        """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy."""
        cfg = self.cfg
        if not cfg.export.enabled:
            return {}
        lora = ("policy", self.denoiser, self.family_roles.pipeline) if cfg.roles.policy.lora.r else None
        return export_run(self.registry, self.path("export"), self.model_path,
                          {self.denoiser: "policy", "vae": "vae", **{n: n for n in self.text_encoders}},
                          cfg.export, lora=lora, pipeline="policy")

    @classmethod
    def rl_plan(cls, cfg: Any, assume: Any, rows: int, note: str, **setup: Any) -> list[plans.RecipePlan]:
        """The roles for the planner: ``rows`` per forward, doubled by CFG where ``setup["guidance_scale"]`` > 1
        (not FLUX); ``setup``: ``extra``, ``guidance_scale``, ``t5_tokens``."""
        res = cls.resolution(cfg)
        components_, source = plans.resolve_pipeline(
            cfg.model.pretrained, variant=cfg.model.variant or None, assume=assume,
            tiny=lambda: D.tiny_pipeline_info(cfg.seed, res, cfg.model.tiny_family))
        denoiser = D.denoiser_name(components_, cls.name, source)
        net, vae = components_[denoiser], components_["vae"]
        tokens, text = D.text_tokens(components_, setup.get("t5_tokens", 0))
        encoders = D.encoder_names(components_)
        if setup.get("guidance_scale", 1.0) > 1 and D.pipeline_family(components_) != "flux":
            rows, note = 2 * rows, note + ", CFG doubles each denoiser batch"
        ref = cls.uses_ref(cfg)
        infos = {"policy": net, **({"ref": net} if ref else {}), "vae": vae, **{n: components_[n] for n in encoders},
                 **setup.get("extra", {})}
        r = cfg.roles
        pol = r.policy
        act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=D.vae_scale(vae),
                                batch=rows, checkpointing=pol.gradient_checkpointing, text_tokens=text)
        vae_act = D.vae_activation_bytes(vae, batch=rows, resolution=res, dtype=r.vae.effective_dtype)
        # the text encoders see at most one prompt per denoiser row (an upper bound: prompts repeat across a group)
        phases = {"policy": [("rollout", act(dtype=pol.effective_dtype, trainable=False)),
                             ("train step", act(dtype=pol.effective_dtype, trainable=True))],
                  "ref": [("forward", act(dtype=r.ref.effective_dtype, trainable=False))],
                  "vae": [("decode / encode", vae_act)], **encode_phases(cfg, components_, rows, tokens)}
        targets = family_roles(D.pipeline_family(components_)).lora_targets
        options = {"policy": {"lora": plans.lora_choice(pol.lora, targets)},
                   "vae": plans.gather_options(r.vae, "decode / encode"),
                   **({"ref": plans.gather_options(r.ref, "forward")} if ref else {}),
                   **{n: plans.gather_options(r[n], "encode") for n in encoders}}
        return [plans.declared_roles(cfg, infos, phases, title=cls.name, notes=[
            f"model: {source}", f"{res}x{res} px, policy micro batch {pol.micro_batch_size}", note], **options)]

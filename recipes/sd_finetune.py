"""Text-to-image fine-tuning of every diffusers family with every model sharded: the denoiser trainable
(``roles.unet`` for SD 1.x/2.x and SDXL, ``roles.transformer`` for SD3 and FLUX), the vae and each text encoder
frozen, each its own DeepSpeed engine (ZeRO-3 by default), optional EMA (sharded like the denoiser) and LoRA.

    multiengine run sd_finetune --config tiny --nproc-per-node 2                 # tiny SD, CPU
    multiengine run sd_finetune --config tiny_sdxl --nproc-per-node 2            # tiny SDXL / SD3 / FLUX
    multiengine run sd_finetune --config tiny --nproc-per-node 2 mode=seed_baseline
    multiengine run sd_finetune --config sdxl_full --nproc-per-node 8 data.source=/data/my_imagefolder

SD and SDXL train with the DDPM objective, SD3 and FLUX with rectified flow matching (both under
``diffusion.*``); ``mode=seed_baseline`` is diffusers' layout under ZeRO-3 (frozen roles and EMA whole on every
rank), for comparison. Writes metrics.jsonl, summary.json, validation grids, checkpoints and export/ (pipeline/,
per-role folders, lora/) under output_dir (docs/diffusion.md).
"""

from __future__ import annotations

from typing import Any

from multiengine.engines import Placement
from multiengine.engines.recipe_config import Choice, Each, Key, Range, flatten, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS
from multiengine.engines.role_schema import Role, lora_spec, optim_spec, placement, role_keys
from multiengine.pipelines.diffusion import models, runs
from multiengine.pipelines.diffusion.export import export_run
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.runs import SHAPES_PROMPTS, build_tiny_model
from multiengine.pipelines.diffusion.training import family_objective, step_generator
from multiengine.recipes import diffusion_keys as shared
from multiengine.recipes import plans
from multiengine.recipes.diffusion_base import ImageFinetune, step_record

__all__ = ["SHAPES_PROMPTS", "build_tiny_model", "check_family_options", "main"]


ROLES = (
    Role("unet", "SD 1.x/2.x and SDXL: the denoiser, trained (an SD3/FLUX model refuses these keys: use "
         "roles.transformer)", trainable=True, keys={**shared.TRAINED, "model": shared.component_model("unet")}),
    Role("transformer", "SD3 and FLUX: the denoiser, trained (an SD/SDXL model refuses these keys: use "
         "roles.unet)", trainable=True, keys={**shared.TRAINED, "model": shared.component_model("transformer")}),
    *shared.component_roles("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5"),
)
DIFFUSION_KEYS = Key({
    "adam_epsilon": Key(1e-8, "AdamW epsilon of the trained role (diffusers' scripts' --adam_epsilon)"),
    **shared.DDPM_KEYS, **shared.FLOW_KEYS,
}, "the objective: DDPM (SD, SDXL) or rectified flow matching (SD3, FLUX), as diffusers' training scripts")
EMA_KEYS = Key({
    "enabled": Key(True, "keep an EMA role (sharded like the denoiser; exported in the pipeline when on)"),
    "decay": Key(0.99, "the largest decay (diffusers' EMAModel default 0.9999 suits long runs)"),
    "use_ema_warmup": Key(False, "true: 1 - (1 + s/inv_gamma)^-power; false: (1 + s) / (10 + s)"),
    "min_decay": Key(0.0, "the smallest decay after the first update", Range(0, 1)),
    "update_after_step": Key(0, "copy the weights (decay 0) for this many steps first", Range(0)),
    "inv_gamma": Key(1.0, "warmup: inverse multiplicative factor", Range(0, min_exclusive=True)),
    "power": Key(2 / 3, "warmup: exponent (2/3 for long runs, 3/4 for short ones)", Range(0, min_exclusive=True)),
    "dtype": Key("fp32", "EMA weights' dtype (bf16 would round away small updates)"),
    "offload_params": Key(False, "ZeRO-3 parameter offload of the EMA to the host"),
}, "EMA of the denoiser, diffusers' EMAModel options")
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/sd_finetune", "everything the run writes goes under this folder"),
    "max_steps": Key(200, "optimizer steps"),
    "mode": Key("zero3", "zero3 (every role as in roles.*) | seed_baseline (diffusers' layout: frozen roles whole)",
                Choice(*models.MODES)),
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
        "roles": Key([], "per-role folders besides the pipeline, e.g. [unet, ema] ([] = none)",
                     Each(Choice(*(r.name for r in ROLES), "ema"))),
    }, "outputs under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)


RENAMED = shared.renamed("unet", " (roles.transformer.* for SD3/FLUX)")


def check_family_options(cfg: Any, family: str, where: str = "") -> None:
    shared.check_family_options(cfg, family, DEFAULTS["roles"], where)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts, without building a model: the model folder (and its family's options), the
    data sources, columns and rows, held-out size against the rows, every image readable, and a micro batch of
    training images per rank on ``world_size`` ranks."""
    family = shared.check_model(cfg, tuple(r.name for r in ROLES))
    if family:
        check_family_options(cfg, family)
        denoiser = family_roles(family).denoiser
    else:  # a hub name: the family is known once downloaded; the denoiser the config sets, else the unet
        changed = flatten(cfg.roles.transformer) != flatten(DEFAULTS["roles"]["transformer"])
        denoiser = "transformer" if changed else "unet"
    shared.check_data(cfg, world_size, denoiser)


class SDFinetune(ImageFinetune):
    """diffusers' text-to-image fine-tunes (SD, SDXL) and SD3 / FLUX flow-matching fine-tunes on the shared
    lifecycle (data, held-out loss and validation grids: ImageFinetune)."""

    name = "sd_finetune"

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
        lora = lora_spec(cfg, d, self.family_roles.lora_targets, init="gaussian")
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
        # the objective's options (the T5 length is the data's)
        names = [k for k in shared.FLOW_KEYS if k != "max_sequence_length"]
        return runs.flow_options(self.family, **{k: self.cfg.diffusion[k] for k in names})

    def make_objective(self, **extra: Any) -> tuple[Any, str | None]:
        d = self.cfg.diffusion
        flow = self.flow_options() if self.family_roles.objective == "flow" else None
        return family_objective(self.registry, self.model_path, self.family, self.text_encoders,
                                resolution=self.cfg.data.resolution, prediction_type=d.prediction_type,
                                snr_gamma=d.snr_gamma, noise_offset=d.noise_offset,
                                input_perturbation=d.input_perturbation, flow_options=flow, **extra)

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
            #    uniform; flow: the density), the target and the weighted MSE; the denoiser gathers its
            #    ZeRO-3 shards layer by layer
            out = self.objective.loss(batch, generator)
            # 4. backward through the trainable engine (it divides by the accumulation steps)
            engine.backward(out.loss)
            # 5. optimizer step, gradient clipping and lr schedule at the accumulation boundary only
            engine.step()
            records.append({"loss": out.loss.item()})
        # 6. EMA: on matching local partitions (zero3), or by gathering the denoiser (seed_baseline)
        e = cfg.ema if self.ema_on else None
        decay = None if e is None else models.update_ema(
            registry, self.step + 1, e.decay, e.use_ema_warmup, min_decay=e.min_decay,
            update_after_step=e.update_after_step, inv_gamma=e.inv_gamma, power=e.power, source=self.trained)
        # 7. the loss averaged over micro batches and ranks, lr, memory per role
        record = step_record(registry, records, self.trained)
        if decay is not None:
            record["ema_decay"] = decay
        return record

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

    def summary_extra(self) -> dict[str, Any]:
        extra = {"mode": self.cfg.mode, "family": self.family, "denoiser": self.denoiser,
                 "model_path": self.model_path, "text_encoders": self.text_encoders,
                 "evaluation_rows": self.eval_origin, "validation": self.validations}
        if self.family_roles.objective == "flow":
            extra["flow"] = {**self.flow_options(), "max_sequence_length": self.t5_length}
        if self.vae_pretrain is not None:
            extra["tiny_vae_pretrain"] = self.vae_pretrain
        return extra


main = SDFinetune.main
plan = plans.sd_finetune  # what `multiengine plan` sees of this recipe

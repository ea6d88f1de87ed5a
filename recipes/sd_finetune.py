"""Stable Diffusion fine-tuning with every model sharded: unet trainable, vae and text encoder(s) frozen,
each its own DeepSpeed engine (ZeRO-3 by default), optional EMA (sharded like the unet) and LoRA.

    multiengine run sd_finetune --config tiny --nproc-per-node 2                 # embedded default, CPU
    multiengine run sd_finetune --config tiny --nproc-per-node 2 mode=seed_baseline
    multiengine run sd_finetune --config sd15_full --nproc-per-node 8 data.source=/data/my_imagefolder

``mode=seed_baseline`` reproduces diffusers' train_text_to_image.py under ZeRO-3 (vae and text encoder
as full copies on every rank, EMA as a full copy) for comparison. Writes metrics.jsonl, summary.json,
validation grids, checkpoints and export/ (pipeline/, per-role folders, lora/) under output_dir.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from multiengine.engines import LoraSpec, OptimSpec, barrier, current_rss_bytes, mean_over_ranks, shard_batches
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.export import export_pipeline, export_roles, save_lora
from multiengine.pipelines.diffusion.models import (
    MODES,
    UNET_LORA_TARGETS,
    diffusion_role_specs,
    resolve_model_path,
    text_encoder_names,
    tokenizer_name,
    update_ema,
)
from multiengine.pipelines.diffusion.tiny import build_tiny_sd, pretrain_tiny_vae
from multiengine.pipelines.diffusion.training import DiffusionObjective, heldout_loss, step_generator
from multiengine.pipelines.diffusion.validation import build_pipeline, generate, image_grid
from multiengine.recipes.common import placement
from multiengine.recipes.lifecycle import Recipe, with_common

logger = logging.getLogger(__name__)

SHAPES_PROMPTS = [
    "a red square on a white background",
    "a blue circle on a black background",
    "a green triangle on a gray background",
    "a yellow circle on a white background",
]

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/sd_finetune",
    "max_steps": 100,  # optimizer steps
    "mode": "zero3",  # zero3 | seed_baseline
    "model": {
        "pretrained": "",  # diffusers folder or hub name; "" = build the tiny SD under output_dir/tiny_sd
        "revision": "",
        "variant": "",
        "tiny_text_encoders": 1,  # tiny model only: 2 adds an SDXL-style text_encoder_2
        "tiny_vae_steps": 0,  # tiny model only: pretrain its random vae on the training images first
    },
    "data": {
        "source": "",  # imagefolder (metadata.jsonl), data file or hub name; "" = built-in shapes dataset
        "image_column": "image",
        "caption_column": "text",
        "resolution": 512,
        "center_crop": True,
        "random_flip": False,
        "builtin_size": 128,  # images of the built-in dataset (generated under output_dir/data)
        "max_train_samples": 0,  # 0 = all
        "num_workers": 0,
        "cache_dir": "",
    },
    "train": {
        "micro_batch_size": 1,
        "grad_accum": 1,
        "lr": 1e-5,
        "lr_scheduler": "constant",  # diffusers.optimization.get_scheduler names
        "lr_warmup_steps": 0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_weight_decay": 1e-2,
        "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0,
        "gradient_checkpointing": False,
        "prediction_type": "",  # "" = the scheduler's; epsilon | v_prediction | sample
        "snr_gamma": 0.0,  # > 0: min-SNR-gamma weighting (5.0 recommended)
        "noise_offset": 0.0,
        "input_perturbation": 0.0,
    },
    "roles": {
        "unet": {"stage": 3, "dtype": "bf16", "offload_params": False, "offload_optimizer": False},
        # gather_forward: gather a frozen ZeRO-3 role whole for each call (one collective, 1/N between calls)
        "vae": {"stage": 3, "dtype": "bf16", "offload_params": False, "gather_forward": True},
        "text_encoder": {"stage": 3, "dtype": "bf16", "offload_params": False, "gather_forward": True},
    },
    "ema": {"enabled": False, "max_decay": 0.9999, "warmup": True, "dtype": "fp32", "offload_params": False},
    "lora": {"enabled": False, "rank": 4, "alpha": 0.0, "target_modules": ["to_k", "to_q", "to_v", "to_out.0"]},
    "validation": {
        "enabled": True,  # before and after training (and every `every` steps when > 0)
        "every": 0,
        "prompts": list(SHAPES_PROMPTS),
        "num_inference_steps": 25,
        "guidance_scale": 7.5,
        "seed": 0,
        "use_ema": True,  # generate with the EMA weights when EMA is on (as diffusers' example)
    },
    "eval": {
        "heldout_size": 8,  # the dataset's last rows, never trained on
        "timesteps": 8,  # evenly spaced timesteps per held-out image
        "every": 0,  # also every N steps when > 0 (always before and after)
        "seed": 1234,
    },
    "export": {"enabled": True, "dtype": "fp32", "roles": ["unet"]},
})


def _cfg_str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


class SDFinetune(Recipe):
    """The diffusers text-to-image fine-tune on the shared lifecycle; validation grids before, after and
    every ``validation.every`` steps."""

    name = "sd_finetune"
    plot_panels = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.validations: list[dict[str, Any]] = []
        self.heldout: dict[str, float] = {}  # "<tag>/loss" (and "<tag>/loss_ema")

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.step_metrics]

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        if cfg.mode not in MODES:
            raise ValueError(f"mode={cfg.mode!r}; use one of {list(MODES)}.")
        # rank 0 builds the tiny model / downloads while the others wait
        self.data_source = self._data_source()
        self.model_path = self._model_path()
        self.text_encoders = text_encoder_names(self.model_path)
        t = cfg.train
        lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha or None, target_modules=tuple(cfg.lora.target_modules),
                        init="gaussian") if cfg.lora.enabled else None
        optim = OptimSpec(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay,
                          eps=t.adam_epsilon, scheduler=t.lr_scheduler, warmup_steps=t.lr_warmup_steps,
                          total_steps=cfg.max_steps, max_grad_norm=t.max_grad_norm or None)
        for spec in diffusion_role_specs(
            self.model_path, mode=cfg.mode, unet=placement(cfg.roles.unet),
            vae=placement(cfg.roles.vae, trainable=False), text_encoder=placement(cfg.roles.text_encoder, trainable=False),
            ema=placement({"stage": cfg.roles.unet.stage, "dtype": cfg.ema.dtype,
                           "offload_params": cfg.ema.offload_params}, trainable=False) if cfg.ema.enabled else None,
            optim=optim, micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum,
            gradient_checkpointing=t.gradient_checkpointing, lora=lora, variant=_cfg_str(cfg.model.variant),
            seed=cfg.seed,
        ):
            registry.add(spec)
        registry.build()
        from diffusers import DDPMScheduler

        scheduler = DDPMScheduler.from_pretrained(self.model_path, subfolder="scheduler")
        self.prediction_type = t.prediction_type or scheduler.config.prediction_type
        self.objective = DiffusionObjective(
            registry, self.text_encoders, scheduler.alphas_cumprod, prediction_type=self.prediction_type,
            snr_gamma=t.snr_gamma, noise_offset=t.noise_offset, input_perturbation=t.input_perturbation,
            resolution=cfg.data.resolution,
        )
        self._setup_data()

    def _model_path(self) -> str:
        cfg = self.cfg
        if cfg.model.pretrained:
            return resolve_model_path(cfg.model.pretrained, _cfg_str(cfg.model.revision), _cfg_str(cfg.model.variant))
        path = self.path("tiny_sd")
        if self.registry.is_main:
            build_tiny_model(path, cfg.seed, cfg.data.resolution, cfg.model.tiny_text_encoders)
            if cfg.model.tiny_vae_steps:
                if os.path.isdir(self.data_source):
                    pretrain_tiny_vae(path, self.data_source, cfg.model.tiny_vae_steps, seed=cfg.seed)
                else:
                    logger.info("model.tiny_vae_steps: data.source is not a local image folder; vae left random")
        barrier()
        return path

    def _data_source(self) -> str:
        """data.source, or the built-in shapes dataset that rank 0 generates under output_dir/data."""
        cfg = self.cfg
        if cfg.data.source:
            return str(cfg.data.source)
        source = self.path("data", "shapes")
        if self.registry.is_main:
            data_lib.make_shapes_dataset(source, cfg.data.builtin_size, cfg.data.resolution, seed=cfg.seed)
        barrier()
        return source

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        load_kwargs = {"cache_dir": cfg.data.cache_dir} if cfg.data.cache_dir else {}
        # Rank 0 prepares the datasets cache first; the others then read it instead of racing to write it.
        if not registry.is_main:
            barrier()
        dataset = data_lib.load_image_caption_dataset(
            self.data_source, cfg.data.image_column, cfg.data.caption_column, **load_kwargs)
        if registry.is_main:
            barrier()
        n_heldout = cfg.eval.heldout_size
        if n_heldout >= len(dataset):
            raise ValueError(
                f"eval.heldout_size={n_heldout} leaves no training data (dataset has {len(dataset)} rows).")
        train_rows = dataset.select(range(len(dataset) - n_heldout))
        if cfg.data.max_train_samples:
            train_rows = train_rows.select(range(min(cfg.data.max_train_samples, len(train_rows))))
        from transformers import AutoTokenizer

        self.tokenizers = [AutoTokenizer.from_pretrained(self.model_path, subfolder=tokenizer_name(n))
                           for n in self.text_encoders]
        collate = functools.partial(_collate, tokenizers=self.tokenizers)
        transform = data_lib.ImageTransform(cfg.data.resolution, cfg.data.center_crop, cfg.data.random_flip)
        self.train_set = data_lib.ImageCaptionDataset(
            train_rows, transform, cfg.data.image_column, cfg.data.caption_column, seed=cfg.seed)
        self.sampler = data_lib.ShardedEpochSampler(len(self.train_set), registry.world_size, registry.rank,
                                                    seed=cfg.seed)
        micro = cfg.train.micro_batch_size
        if len(self.sampler) < micro:
            raise ValueError(f"{len(self.train_set)} training images give {len(self.sampler)} per rank, fewer than"
                             f" train.micro_batch_size={micro}.")
        self.loader = torch.utils.data.DataLoader(
            self.train_set, batch_size=micro, sampler=self.sampler, collate_fn=collate, drop_last=True,
            num_workers=cfg.data.num_workers)
        self.consumed = 0  # samples of the current epoch trained on by this rank (the sampler may run ahead)
        self.batches = self._batch_stream()

        # Held-out: deterministic transform, the same number of batches on every rank (lockstep forwards).
        self.heldout_batches: list[dict[str, Any]] = []
        if n_heldout:
            heldout = data_lib.ImageCaptionDataset(
                dataset.select(range(len(dataset) - n_heldout, len(dataset))),
                data_lib.ImageTransform(cfg.data.resolution, center_crop=True, random_flip=False),
                cfg.data.image_column, cfg.data.caption_column, seed=cfg.seed)
            self.heldout_batches = shard_batches(heldout, collate, micro, registry.world_size, registry.rank)
        T = self.objective.num_train_timesteps
        k = cfg.eval.timesteps
        self.heldout_timesteps = [int((i + 0.5) * T / k) for i in range(k)]

    def _batch_stream(self) -> Iterator[dict[str, Any]]:
        while True:
            if self.sampler.position >= len(self.sampler):
                self.sampler.set_epoch(self.sampler.epoch + 1)
            self.train_set.set_epoch(self.sampler.epoch)  # augmentation follows the sampler's epoch
            self.consumed = self.sampler.position
            for batch in self.loader:
                self.consumed += len(batch["captions"])
                yield batch
            self.consumed = len(self.sampler)  # the dropped tail counts as seen, like the sampler does

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(consumed=self.consumed), "heldout": self.heldout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.heldout = dict(state.get("heldout", {}))
        self.validations = []

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        unet = registry["unet"]
        micro_losses = []
        for micro in range(unet.gradient_accumulation_steps()):
            # 1. this rank's next micro batch (sharded, resumable sampler)
            batch = next(self.batches)
            # 2. all randomness of the micro batch from (seed, step, micro, rank): stage-independent
            generator = step_generator(cfg.seed, self.step, micro, registry.rank)
            # 3. latents via the vae engine, embeddings via the text-encoder engine(s), noise, timesteps,
            #    target and (min-SNR) MSE; the unet forward gathers its ZeRO-3 shards layer by layer
            out = self.objective.loss(batch, generator)
            # 4. backward through the unet engine (it divides by the accumulation steps)
            unet.backward(out.loss)
            # 5. optimizer step, gradient clipping and lr schedule at the accumulation boundary only
            unet.step()
            micro_losses.append(out.loss.item())
        # 6. EMA: on matching local partitions (zero3), or by gathering the unet (seed_baseline)
        decay = update_ema(registry, self.step + 1, cfg.ema.max_decay, cfg.ema.warmup) if cfg.ema.enabled else None
        # 7. the loss averaged over micro batches and ranks, lr, memory per role
        record = {**mean_over_ranks({"loss": statistics.fmean(micro_losses)}), "lr": unet.get_lr()[0],
                  **_memory_metrics(registry)}
        if decay is not None:
            record["ema_decay"] = decay
        return record

    def after_step(self, last: bool) -> None:
        every = self.cfg.validation.every
        if every and self.step % every == 0 and not last:
            self.validate(f"step_{self.step}")

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out loss at fixed noise and timesteps (raw unet, and the EMA when on), and validation
        images before and after training; all ranks."""
        result: dict[str, Any] = {}
        if self.heldout_batches:
            cfg = self.cfg
            result["loss"] = heldout_loss(self.objective, self.heldout_batches, self.heldout_timesteps, cfg.eval.seed)
            if cfg.ema.enabled:
                result["loss_ema"] = heldout_loss(self.objective, self.heldout_batches, self.heldout_timesteps,
                                                  cfg.eval.seed, unet_role="ema")
            for key, value in result.items():
                self.heldout[f"{tag}/{key}"] = value
        if tag in ("before", "after"):
            self.validate(tag)
        return result

    def validate(self, tag: str) -> None:
        """Images for the validation prompts, on all ranks in lockstep; rank 0 saves the grid."""
        cfg, registry = self.cfg, self.registry
        if not cfg.validation.enabled or not cfg.validation.prompts:
            return
        unet_role = "ema" if cfg.ema.enabled and cfg.validation.use_ema else "unet"
        t0 = time.perf_counter()
        pipe = build_pipeline(registry, self.model_path, self.text_encoders, unet_role, self.prediction_type)
        was_training = registry.role("unet").module.training
        registry.role("unet").module.eval()
        try:
            images = generate(pipe, registry, list(cfg.validation.prompts), cfg.data.resolution,
                              cfg.validation.num_inference_steps, cfg.validation.guidance_scale, cfg.validation.seed)
        finally:
            registry.role("unet").module.train(was_training)
        del pipe
        path = self.path("validation", f"{self.step:06d}_{tag}.png")
        entry = {"step": self.step, "tag": tag, "file": path, "unet": unet_role,
                 "prompts": list(cfg.validation.prompts), "seconds": time.perf_counter() - t0}
        if registry.is_main:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            image_grid(images).save(path)
            with open(self.path("validation", "index.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
            logger.info("validation grid (%s, step %d, unet=%s): %s", tag, self.step, unet_role, path)
        self.metrics.log(self.step, {"images": len(images), "seconds": entry["seconds"]}, prefix="validation")
        self.validations.append(entry)

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        unet_role = "ema" if cfg.ema.enabled else "unet"
        components = {"unet": unet_role, "vae": "vae", **{name: name for name in self.text_encoders}}
        written: dict[str, Any] = {"pipeline": export_pipeline(
            registry, self.model_path, self.path("export", "pipeline"), components, dtype=cfg.export.dtype,
            prediction_type=self.prediction_type)}
        if cfg.lora.enabled:
            written["lora"] = save_lora(registry, self.path("export", "lora"), role=unet_role)
        roles = [r for r in cfg.export.roles if r in registry]
        written.update(export_roles(registry, self.path("export"), roles, dtype=cfg.export.dtype))
        return written

    def summary_metrics(self) -> dict[str, Any]:
        times = [m["step_time_s"] for m in (self.step_metrics[1:] or self.step_metrics)]
        return {
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "step_time_s_median": statistics.median(times) if times else None,
            **{f"heldout/{k}": v for k, v in self.heldout.items()},
        }

    def summary_extra(self) -> dict[str, Any]:
        return {"mode": self.cfg.mode, "model_path": self.model_path, "text_encoders": self.text_encoders,
                "validation": self.validations}


def build_tiny_model(path: str, seed: int, resolution: int, text_encoders: int = 1) -> str:
    """The embedded default model: the tiny SD of tiny.py; with ``text_encoders=2`` an SDXL-style variant
    (``text_encoder`` + ``text_encoder_2`` with projection, unet with cross-attention width 64 and the
    text_time added conditioning), saved as a StableDiffusionXLPipeline folder."""
    if text_encoders == 1:
        return build_tiny_sd(path, seed=seed, resolution=resolution)
    if text_encoders != 2:
        raise ValueError(f"model.tiny_text_encoders={text_encoders}; the tiny model has 1 or 2 text encoders.")
    return build_tiny_sdxl(path, seed=seed, resolution=resolution)


def build_tiny_sdxl(path: str, seed: int = 0, resolution: int = 32) -> str:
    """A tiny SDXL-style folder: the tiny vae, tokenizer and ``text_encoder`` of tiny.py, a second CLIP
    encoder with projection (``text_encoder_2``, hidden 32, sharing the tokenizer) and a unet with
    cross-attention width 32 + 32 and ``addition_embed_type="text_time"``. Idempotent."""
    import shutil

    from diffusers import (
        AutoencoderKL,
        DDPMScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from multiengine.pipelines.diffusion.tiny import build_tiny_clip_text_encoder
    from transformers import CLIPTextModel, CLIPTokenizer

    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path
    base = path + ".sd"
    build_tiny_sd(base, seed=seed, resolution=resolution)
    tok = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text_encoder_2 = build_tiny_clip_text_encoder(
        None, hidden_size=32, seed=seed + 3, with_projection=True, vocab_size=len(tok),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        max_position_embeddings=tok.model_max_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 4)
        unet = UNet2DConditionModel(
            sample_size=resolution // 2, in_channels=4, out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=64, attention_head_dim=8,
            norm_num_groups=8, addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 32,  # six time ids x 8 + the pooled text (32)
        )
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL.from_pretrained(base, subfolder="vae"),
        text_encoder=CLIPTextModel.from_pretrained(base, subfolder="text_encoder"),
        text_encoder_2=text_encoder_2, tokenizer=tok, tokenizer_2=tok, unet=unet,
        scheduler=DDPMScheduler.from_pretrained(base, subfolder="scheduler"),
        force_zeros_for_empty_prompt=True, add_watermarker=False,
    )
    tmp = path + ".tmp"
    pipe.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, path)
    shutil.rmtree(base, ignore_errors=True)
    return path


def _collate(examples: list[dict[str, Any]], tokenizers: list[Any]) -> dict[str, Any]:
    """``data.collate`` with the first tokenizer, plus ``input_ids_2`` ... for further text encoders."""
    batch = data_lib.collate(examples, tokenizer=tokenizers[0])
    for i, tok in enumerate(tokenizers[1:], start=2):
        batch[f"input_ids_{i}"] = data_lib.tokenize_captions(tok, batch["captions"])
    return batch


def _memory_metrics(registry: Any) -> dict[str, float]:
    """This rank's bytes per role (params held, grads, optimizer state) and process memory."""
    out: dict[str, float] = {}
    for row in registry.memory_report():
        role = row["role"]
        out[f"mem/{role}/param_bytes"] = row["param_bytes"]
        out[f"mem/{role}/params_local"] = row["params_local"]
        if row["trainable"]:
            out[f"mem/{role}/grad_bytes"] = row["grad_bytes"]
            out[f"mem/{role}/optimizer_bytes"] = row["optimizer_bytes"]
    out["mem/rss_bytes"] = current_rss_bytes()
    if torch.cuda.is_available():
        out["mem/cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["mem/cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


main = SDFinetune.main

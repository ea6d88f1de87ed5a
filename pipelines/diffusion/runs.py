"""What a diffusion fine-tuning run needs around its objective: the T5 length and image side of a family, held-out
splits, the tiny model, the training image stream (sharded, resumable) collated with every text encoder's ids,
validation prompts and images, and per-role memory figures."""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from multiengine.engines import barrier, current_rss_bytes, mean_over_ranks, shard_batches
from multiengine.engines.settings import SettingsError
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.families import family_roles
from multiengine.pipelines.diffusion.models import read_model_index, tokenizer_name
from multiengine.pipelines.diffusion.tiny import build_tiny, pretrain_tiny_vae
from multiengine.pipelines.diffusion.training import FLOW_FAMILY_DEFAULTS, prompt_input_ids
from multiengine.pipelines.diffusion.validation import generate

logger = logging.getLogger(__name__)

__all__ = ["SHAPES_PROMPTS", "ImageColumn", "TrainImages", "build_tiny_model", "caption_collate", "conditioning_rows",
           "eval_split_value", "first_last", "held_out_of", "image_figures", "image_model", "image_source",
           "log_validation", "memory_metrics", "prepare_tiny_model", "rank0_first", "resolution_multiple",
           "run_validation", "split_rows", "step_record", "t5_length", "text_tokenizers", "token_lengths",
           "train_images", "validation_captions"]

SHAPES_PROMPTS = [
    "a red square on a white background",
    "a blue circle on a black background",
    "a green triangle on a gray background",
    "a yellow circle on a white background",
]


def t5_length(family: str, asked: int) -> int:
    """T5 tokens per caption: ``asked``, else the family's (SD3 77, FLUX 512); 0 for the DDPM families."""
    if family_roles(family).objective != "flow":
        return 0
    return int(asked) or FLOW_FAMILY_DEFAULTS[family]["max_sequence_length"]


def resolution_multiple(family: str, model_path: str | None) -> int:
    """What the image side must be a multiple of: the vae's downsampling times the denoiser's (2x2 patches
    for SD3/FLUX, one 2x per unet level below the top). From the configs only; the tiny models when no folder."""
    if model_path is None:
        return 4
    with open(os.path.join(model_path, "vae", "config.json"), encoding="utf-8") as f:
        vae = json.load(f)
    factor = 2 ** (len(vae.get("block_out_channels", [1])) - 1)
    denoiser = family_roles(family).denoiser
    with open(os.path.join(model_path, denoiser, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if denoiser == "unet":
        return factor * 2 ** (len(config.get("block_out_channels", [1])) - 1)
    return factor * 2 if family == "flux" else factor * int(config.get("patch_size", 2))


def eval_split_value(text: str, heldout_size: int) -> float | int | str:
    """A held-out split as load_image_caption_data takes it: a fraction, a count, a split name; "" =
    ``heldout_size`` rows held out of the training data."""
    text = str(text).strip()
    if not text:
        return int(heldout_size)
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if number >= 1 and number.is_integer() else number


def held_out_of(n: int, split: Any) -> int:
    """Rows a fraction or count takes out of ``n`` (0 for a split name or none)."""
    if isinstance(split, bool) or not isinstance(split, (int, float)) or split <= 0:
        return 0
    return max(1, round(split * n)) if isinstance(split, float) and split < 1 else int(split)


class ImageColumn(Sequence):
    """One column of a datasets.Dataset as a sequence, each item decoded when indexed (not all at once)."""

    def __init__(self, rows: Any, column: str) -> None:
        self.rows, self.column = rows, column

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[int(index)][self.column]


def build_tiny_model(path: str, seed: int, resolution: int, family: str = "sd") -> str:
    """The embedded default model of ``family`` (``sd``, ``sdxl``, ``sd3``, ``flux``), built by tiny.py."""
    return build_tiny(family, path, seed=seed, resolution=resolution)


def prepare_tiny_model(path: str, family: str, images: Sequence[Any], *, seed: int, resolution: int, vae_steps: int,
                       is_main: bool, device: Any) -> dict[str, Any] | None:
    """The tiny ``family`` model at ``path`` (built by rank 0) and its vae pretrained on ``images`` by every rank when
    ``vae_steps`` > 0. Collective; returns pretrain_tiny_vae's result or None."""
    if is_main:
        build_tiny_model(path, seed, resolution, family)
    barrier()
    if not vae_steps:
        return None
    if is_main:
        logger.info("model.tiny_vae_steps=%s: the random tiny vae learns the training images first (0 skips it)",
                    vae_steps)
    done = pretrain_tiny_vae(path, images, vae_steps, seed=seed, resolution=resolution, device=device)
    barrier()
    return done


def image_source(cfg: Any, registry: Any, folder: str) -> Any:
    """data.sources / data.source, or the built-in shapes dataset that rank 0 generates at ``folder``."""
    d = cfg.data
    if d.spec:
        return d.spec
    if registry.is_main:
        data_lib.make_shapes_dataset(folder, d.builtin_size, d.resolution, seed=cfg.seed,
                                     conditioning=d.conditioning_kind if d.conditioning else "")
    barrier()
    return folder


def image_model(cfg: Any, registry: Any, rows: Any, folder: str) -> tuple[str, dict[str, Any] | None]:
    """The model folder: model.pretrained's, or the tiny model built at ``folder``, its vae pretrained on the
    training ``rows`` at data.resolution first (with pretrain_tiny_vae's result). Collective."""
    if cfg.model.pretrained:
        return cfg.model.path(), None
    images = ImageColumn(cfg.data.first_rows(rows.train), "image")
    return folder, prepare_tiny_model(folder, cfg.model.tiny_family, images, seed=cfg.seed,
                                      resolution=cfg.data.resolution, vae_steps=cfg.model.tiny_vae_steps,
                                      is_main=registry.is_main, device=registry.device)


def text_tokenizers(model_path: str, encoders: Sequence[str]) -> list[Any]:
    from transformers import AutoTokenizer

    return [AutoTokenizer.from_pretrained(model_path, subfolder=tokenizer_name(n)) for n in encoders]


def token_lengths(model_path: str, encoders: Sequence[str], t5_tokens: int) -> list[int | None]:
    """Padded length per text encoder: CLIP its tokenizer's (77), T5 ``t5_tokens``."""
    index = read_model_index(model_path)
    return [t5_tokens if str(index[n][1]).startswith("T5") else None for n in encoders]


def collate_captions(examples: list[dict[str, Any]], tokenizers: list[Any], lengths: list[int | None]
                     ) -> dict[str, Any]:
    """``data.collate`` with ``input_ids`` (``input_ids_2`` ...) per text encoder, each padded to its length."""
    batch = data_lib.collate(examples, tokenizer=tokenizers[0])
    batch.update(prompt_input_ids(tokenizers, batch["captions"], lengths))
    if all("conditioning_pixel_values" in e for e in examples):
        batch["conditioning_pixel_values"] = torch.stack([e["conditioning_pixel_values"] for e in examples])
    return batch


class TrainImages:
    """This rank's endless, resumable stream of training micro batches (ShardedEpochSampler, tails dropped) and the
    held-out batches, the same number on every rank."""

    def __init__(self, train_set: Any, heldout_set: Any | None, collate: Any, *, micro_batch_size: int,
                 world_size: int, rank: int, seed: int, num_workers: int = 0) -> None:
        self.train_set = train_set
        self.sampler = data_lib.ShardedEpochSampler(len(train_set), world_size, rank, seed=seed)
        if len(self.sampler) < micro_batch_size:
            raise ValueError(f"{len(train_set)} training images give {len(self.sampler)} per rank, fewer than a "
                             f"micro batch of {micro_batch_size}")
        self.loader = torch.utils.data.DataLoader(train_set, batch_size=micro_batch_size, sampler=self.sampler,
                                                  collate_fn=collate, drop_last=True, num_workers=num_workers)
        self.consumed = 0  # samples of the current epoch trained on by this rank (the sampler may run ahead)
        self.heldout: list[dict[str, Any]] = []
        if heldout_set is not None:
            self.heldout = shard_batches(heldout_set, collate, micro_batch_size, world_size, rank)
            if not self.heldout:
                logger.warning("%d held-out rows are fewer than the %d ranks: no held-out loss", len(heldout_set),
                               world_size)

    def stream(self) -> Iterator[dict[str, Any]]:
        while True:
            if self.sampler.position >= len(self.sampler):
                self.sampler.set_epoch(self.sampler.epoch + 1)
            self.train_set.set_epoch(self.sampler.epoch)
            self.consumed = self.sampler.position
            for batch in self.loader:
                self.consumed += len(batch["captions"])
                yield batch
            self.consumed = len(self.sampler)  # the dropped tail counts as seen, like the sampler does

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(consumed=self.consumed)


def split_rows(rows: Any, data: Any, heldout_size: int) -> tuple[Any, Any | None]:
    """The training rows (data.max_train_samples of them) and the first ``heldout_size`` held-out rows (None)."""
    held = None if rows.eval is None or not heldout_size else rows.eval.select(range(min(heldout_size,
                                                                                          len(rows.eval))))
    return data.first_rows(rows.train), held


def train_images(cfg: Any, registry: Any, train_rows: Any, heldout_rows: Any | None, collate: Any, trained: str
                 ) -> TrainImages:
    """The training stream and held-out batches of ``trained``'s micro batch (conditioning images where
    data.conditioning); too few rows for a micro batch per rank is a config error."""
    def dataset(rows: Any, train: bool) -> Any:
        return data_lib.ImageCaptionDataset(rows, cfg.data.transform(train), "image", "caption", seed=cfg.seed,
                                            conditioning_column="conditioning_image" if cfg.data.conditioning else None)
    try:
        return TrainImages(dataset(train_rows, True), None if heldout_rows is None else dataset(heldout_rows, False),
                           collate, micro_batch_size=cfg.roles[trained].micro_batch_size,
                           world_size=registry.world_size, rank=registry.rank, seed=cfg.seed,
                           num_workers=cfg.data.num_workers)
    except ValueError as exc:
        raise SettingsError(f"{exc}: lower roles.{trained}.micro_batch_size or add data.") from None


def caption_collate(model_path: str, text_encoders: Sequence[str], t5_tokens: int) -> Callable[[list[Any]], Any]:
    """The collate function of an image-caption run: ``data.collate`` with every text encoder's ids."""
    return partial(collate_captions, tokenizers=text_tokenizers(model_path, text_encoders),
                   lengths=token_lengths(model_path, text_encoders, t5_tokens))


def rank0_first(is_main: bool, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 first, then on the other ranks: rank 0 writes what the others then read (a datasets
    cache) instead of every rank racing to write it."""
    if not is_main:
        barrier()
    out = fn()
    if is_main:
        barrier()
    return out


def validation_captions(captions: Sequence[Any], n: int) -> list[str]:
    """The first ``n`` distinct captions (the first of an image's several)."""
    out: list[str] = []
    for caption in captions:
        text = caption[0] if isinstance(caption, (list, tuple)) else caption
        if isinstance(text, str) and text not in out:
            out.append(text)
        if len(out) >= n:
            break
    return out


def conditioning_rows(rows: Any, n: int, resolution: int) -> tuple[list[Any], list[str]]:
    """The conditioning images (resized and center-cropped like the training images) and captions of the
    first ``n`` rows."""
    from PIL import Image

    transform = data_lib.ImageTransform(resolution, center_crop=True, random_flip=False)
    images, captions = [], []
    for i in range(min(n, len(rows))):
        row = rows[i]
        _, params = transform.apply(row["image"])
        pixels = transform.replay(row["conditioning_image"].convert("RGB"), params, params["original_size"])
        images.append(Image.fromarray((pixels.permute(1, 2, 0).numpy() * 255).round().astype("uint8")))
        caption = row["caption"][0] if isinstance(row["caption"], (list, tuple)) else row["caption"]
        captions.append(str(caption))
    return images, captions


def run_validation(registry: Any, pipe: Any, trained: str, prompts: Sequence[str], settings: Any, resolution: int,
                   **pipeline_kwargs: Any) -> list[Any]:
    """Images for ``prompts`` on all ranks in lockstep (``settings``: the validation section's sampler steps,
    guidance and seed), the trained role in eval mode meanwhile."""
    module = registry.role(trained).module
    was_training = module.training
    module.eval()
    try:
        return generate(pipe, registry, list(prompts), resolution, settings.num_inference_steps,
                        settings.guidance_scale, settings.seed, **pipeline_kwargs)
    finally:
        module.train(was_training)


def log_validation(registry: Any, metrics: Any, entry: dict[str, Any], images: list[Any],
                   grid: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """Rank 0 saves ``grid(images)`` at entry["file"] with ``entry`` as a line of ``index.jsonl`` beside it and logs
    it to TensorBoard; every rank logs the image count and seconds. Returns ``entry``."""
    if registry.is_main:
        image = grid(images)
        folder = os.path.dirname(entry["file"])
        os.makedirs(folder, exist_ok=True)
        image.save(entry["file"])
        with open(os.path.join(folder, "index.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        # One tag for every validation, so TensorBoard's step slider walks through before/step_N/after.
        metrics.log_image(entry["step"], "validation/grid", image)
        logger.info("validation grid (%s, step %d, %s): %s", entry["tag"], entry["step"], entry["role"], entry["file"])
    metrics.log(entry["step"], {"images": len(images), "seconds": entry["seconds"]}, prefix="validation")
    return entry


def first_last(step_metrics: list[dict[str, float]], key: str) -> dict[str, Any]:
    """first_<key> and final_<key>: the training metric of the first and the last step (None before any)."""
    values = [m[key] for m in step_metrics if key in m]
    return {f"first_{key}": values[0] if values else None, f"final_{key}": values[-1] if values else None}


def image_figures(step_metrics: list[dict[str, float]], heldout: Mapping[str, float]) -> dict[str, Any]:
    """An image fine-tune's summary figures: the first and last training loss, the median step time (the first step,
    its warm-up, left out) and the ``heldout`` losses of each evaluation."""
    times = [m["step_time_s"] for m in (step_metrics[1:] or step_metrics)]
    return {**first_last(step_metrics, "loss"), "step_time_s_median": statistics.median(times) if times else None,
            **{f"heldout/{k}": v for k, v in heldout.items()}}


def step_record(registry: Any, records: list[dict[str, float]], trained: str) -> dict[str, float]:
    """A step's metrics: each the mean over the micro batches that have it and over the ranks, the learning rate of
    the ``trained`` role and the memory per role."""
    out = {key: statistics.fmean(r[key] for r in records if key in r) for key in records[-1]}
    return {**mean_over_ranks(out), "lr": registry[trained].get_lr()[0], **memory_metrics(registry)}


def memory_metrics(registry: Any) -> dict[str, float]:
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


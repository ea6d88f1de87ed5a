"""Image-caption data of diffusion fine-tuning: the shapes dataset, loading and checking sources, transforms (PIL +
torch only), collation; randomness only from seeded generators, so a resumed run sees the same samples."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from multiengine.engines.sampler import ShardedEpochSampler
from multiengine.pipelines.sources import (
    DataSource,
    DataSourceError,
    TrainEval,
    as_sources,
    load_source,
    source_kind,
    split_train_eval,
)
from PIL import Image, ImageDraw

logger = logging.getLogger(__name__)

__all__ = ["CONDITIONING_KINDS", "IMAGE_FIELDS", "SHAPES_BACKGROUNDS", "SHAPES_COLORS", "SHAPES_KINDS",
           "ImageCaptionDataset", "ImageTransform", "ShardedEpochSampler", "check_image_caption_data", "collate",
           "conditioning_pixels", "describe_shapes_image", "image_caption_columns", "load_image_caption_data",
           "load_image_caption_dataset", "make_shapes_dataset", "sample_generator", "shapes_captions",
           "shapes_conditioning_image", "tokenize_captions"]

# Saturated, mutually distant colours so the attribute can be read back from pixels.
SHAPES_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
SHAPES_KINDS: tuple[str, ...] = ("square", "circle", "triangle")
SHAPES_BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
}
_METADATA = "metadata.jsonl"


def _caption(color: str, shape: str, background: str) -> str:
    return f"a {color} {shape} on a {background} background"


def shapes_captions() -> list[str]:
    """Every caption the shapes dataset can produce (54 strings); also the tokenizer's training text."""
    return [
        _caption(c, s, b) for c, s, b in itertools.product(SHAPES_COLORS, SHAPES_KINDS, SHAPES_BACKGROUNDS)
    ]


def _shapes_rows(n: int, resolution: int, seed: int) -> list[dict[str, Any]]:
    """Deterministic per-image attributes and geometry (no pixels yet)."""
    rng = random.Random(seed)
    combos = list(itertools.product(SHAPES_COLORS, SHAPES_KINDS, SHAPES_BACKGROUNDS))
    rows: list[dict[str, Any]] = []
    order: list[tuple[str, str, str]] = []
    for i in range(n):
        # Cycle through shuffled copies of all combinations so every attribute is balanced.
        if not order:
            order = combos[:]
            rng.shuffle(order)
        color, shape, background = order.pop()
        size = max(4, round(resolution * rng.uniform(0.4, 0.7)))
        left = rng.randint(1, max(1, resolution - size - 1))
        top = rng.randint(1, max(1, resolution - size - 1))
        rows.append(
            {
                "file_name": f"{i:05d}.png",
                "text": _caption(color, shape, background),
                "color": color,
                "shape": shape,
                "background": background,
                "_box": (left, top, size),
            }
        )
    return rows


def _draw_shape(row: Mapping[str, Any], resolution: int, mask: bool = False) -> Image.Image:
    """The row's image, or (``mask``) its shape white on black, one channel."""
    image = Image.new("L", (resolution, resolution), 0) if mask else \
        Image.new("RGB", (resolution, resolution), SHAPES_BACKGROUNDS[row["background"]])
    draw = ImageDraw.Draw(image)
    left, top, size = row["_box"]
    right, bottom = left + size - 1, top + size - 1
    fill = 255 if mask else SHAPES_COLORS[row["color"]]
    if row["shape"] == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    elif row["shape"] == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    else:
        draw.polygon(((left + right) / 2, top, left, bottom, right, bottom), fill=fill)
    return image


def _shapes_complete(out_dir: str, entries: list[dict[str, Any]], resolution: int) -> bool:
    meta = os.path.join(out_dir, _METADATA)
    if not os.path.isfile(meta):
        return False
    with open(meta, encoding="utf-8") as f:
        if [json.loads(line) for line in f if line.strip()] != entries:
            return False
    if not all(os.path.isfile(os.path.join(out_dir, e["file_name"])) for e in entries):
        return False
    with Image.open(os.path.join(out_dir, entries[0]["file_name"])) as im:
        return im.size == (resolution, resolution)


def make_shapes_dataset(out_dir: str, n: int, resolution: int = 32, seed: int = 0, conditioning: str = "") -> str:
    """Write an ``imagefolder`` of ``n`` solid shapes on plain backgrounds (``metadata.jsonl``: ``file_name``,
    ``text`` and the attributes) and returns ``out_dir``; ``conditioning`` (``edge`` | ``mask``) adds a ControlNet
    image per row. Byte-identical for the same arguments; a complete folder is left as is; process-safe."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if resolution < 8:
        raise ValueError(f"resolution must be >= 8, got {resolution}")
    if conditioning and conditioning not in CONDITIONING_KINDS:
        raise ValueError(f"kind={conditioning!r}; use one of {list(CONDITIONING_KINDS)}.")
    rows = _shapes_rows(n, resolution, seed)
    entries = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    if conditioning:
        entries = [{"file_name": e.pop("file_name"), "conditioning_image_file_name": f"conditioning/{r['file_name']}",
                    "conditioning_kind": conditioning, **e} for r, e in zip(rows, entries)]
    if _shapes_complete(out_dir, entries, resolution):
        logger.info("shapes dataset already complete at %s", out_dir)
        return out_dir
    os.makedirs(os.path.join(out_dir, "conditioning") if conditioning else out_dir, exist_ok=True)
    # Write-then-rename per file, metadata last: concurrent ranks never see a torn file, and the
    # folder only counts as complete once metadata.jsonl is in place.
    tag = f".tmp{os.getpid()}"
    for row, entry in zip(rows, entries):
        images = [(entry["file_name"], _draw_shape(row, resolution))]
        if conditioning:
            images.append((entry["conditioning_image_file_name"],
                           shapes_conditioning_image(row, resolution, conditioning)))
        for name, image in images:
            path = os.path.join(out_dir, name)
            image.save(path + tag, format="PNG")
            os.replace(path + tag, path)
    meta = os.path.join(out_dir, _METADATA)
    with open(meta + tag, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    os.replace(meta + tag, meta)
    logger.info("wrote %d shapes images to %s", n, out_dir)
    return out_dir


def _nearest(rgb: np.ndarray, palette: Mapping[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    dist = [float(np.sum((rgb - np.asarray(palette[k], dtype=np.float64)) ** 2)) for k in names]
    return names[int(np.argmin(dist))]


def describe_shapes_image(image: Image.Image) -> dict[str, str]:
    """``color``, ``shape`` and ``background`` read back from a shapes image: palette colours nearest the corners
    and the other pixels' median, the shape from how much of its box it fills."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float64)
    corners = np.stack([arr[0, 0], arr[0, -1], arr[-1, 0], arr[-1, -1]]).mean(axis=0)
    background = _nearest(corners, SHAPES_BACKGROUNDS)
    bg = np.asarray(SHAPES_BACKGROUNDS[background], dtype=np.float64)
    mask = np.sqrt(((arr - bg) ** 2).sum(axis=-1)) > 60.0
    if not mask.any():
        return {"color": "none", "shape": "none", "background": background}
    color = _nearest(np.median(arr[mask], axis=0), SHAPES_COLORS)
    ys, xs = np.nonzero(mask)
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = mask.sum() / box
    shape = "square" if fill > 0.9 else "circle" if fill > 0.66 else "triangle"
    return {"color": color, "shape": shape, "background": background}


# --- loading -----------------------------------------------------------------------------------------------------

IMAGE_FIELDS: tuple[str, ...] = ("image", "caption")


def image_caption_columns(columns: Mapping[str, str] | None = None, image_column: str = "image",
                          caption_column: str = "text", extra_fields: Sequence[str] = ()) -> tuple[str, str]:
    """The image and caption column names: ``columns`` wins over the older ``image_column`` / ``caption_column``;
    ``extra_fields``: further fields ``columns`` may name."""
    columns = dict(columns or {})
    unknown = [k for k in columns if k not in IMAGE_FIELDS and k not in extra_fields]
    if unknown:
        raise DataSourceError(f"data.columns maps unknown field(s) {unknown}; image-caption data has the fields "
                              f"{list(IMAGE_FIELDS) + list(extra_fields)} (e.g. data.columns.caption=prompt)")
    return columns.get("image", image_column), columns.get("caption", caption_column)


def load_image_caption_dataset(source: str, image_column: str = "image", caption_column: str = "text",
                               split: str = "train", columns: Mapping[str, str] | None = None,
                               key: str = "data.source", split_required: bool = False,
                               extra_image_columns: Sequence[str] = (), **load_kwargs: Any):
    """An image-caption ``datasets.Dataset`` from a ``save_to_disk`` folder, an imagefolder, a data file (string
    image paths relative to it) or a hub name (offline). ValueError for a missing source, column or rows."""
    image_column, caption_column = image_caption_columns(columns, image_column, caption_column)
    kind = source_kind(str(source), (split,), images=True, key=key)
    ds = load_source(str(source), names=(split,), split=split, images=True, key=key, split_required=split_required,
                     **load_kwargs)
    if len(ds) == 0:
        raise DataSourceError(f"{key}={source!r} has no rows (split {split!r})")
    for role, column in (("image_column", image_column), ("caption_column", caption_column)):
        if column not in ds.column_names:
            field_name = "image" if role == "image_column" else "caption"
            raise ValueError(f"{role}={column!r} not found in dataset {source!r}; available columns: "
                             f"{ds.column_names} (name yours with data.columns.{field_name}=<column>)")
    for column in extra_image_columns:
        if column not in ds.column_names:
            raise ValueError(f"column {column!r} not found in dataset {source!r}; available columns: "
                             f"{ds.column_names} (name yours with data.columns.conditioning_image=<column>)")
    for column in (image_column, *extra_image_columns):
        ds = _as_image_column(ds, column, source, kind)
    return ds


def _as_image_column(ds: Any, column: str, source: str, kind: str) -> Any:
    """``column`` cast to ``datasets.Image``: paths in a data file are resolved against that file's folder."""
    import datasets

    feature = ds.features[column]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        # Paths in a data file are relative to that file, not to the current directory.
        base = None
        if kind == "file":
            base = os.path.dirname(os.path.abspath(source))
        elif kind == "split_files":
            base = os.path.abspath(source)

        def _resolve(example: dict[str, Any]) -> dict[str, Any]:
            path = example[column]
            if base is not None and not os.path.isabs(path) and "://" not in path:
                path = os.path.join(base, path)
            return {column: path}

        ds = ds.map(_resolve)
        ds = ds.cast_column(column, datasets.Image())
    elif isinstance(feature, dict) and "bytes" in feature:
        ds = ds.cast_column(column, datasets.Image())
    return ds


def load_image_caption_data(source: Any, *, columns: Mapping[str, str] | None = None, train_split: str = "train",
                            eval_source: Any = None, eval_split: float | int | str = 0.0, seed: int = 0,
                            size: int | None = None, cache_dir: str | None = None,
                            extra_images: Mapping[str, str] | None = None) -> TrainEval:
    """Training and held-out image-caption rows (columns ``image``, ``caption`` and one per ``extra_images`` field)
    from one source or a weighted blend; ``eval_split`` as :func:`multiengine.pipelines.sources.split_train_eval`."""
    several = isinstance(source, (list, tuple)) and len(source) > 1
    base_key = "data.sources" if several else "data.source"
    extra = dict(extra_images or {})

    def load(src: DataSource, split: str | None, key: str = base_key) -> Any:
        image, caption, others = _columns(src, columns, extra)
        ds = load_image_caption_dataset(src.path, image, caption, split=split or src.split or train_split, key=key,
                                        split_required=split is not None, cache_dir=cache_dir,
                                        extra_image_columns=tuple(others.values()))
        ds = ds.select_columns([image, caption, *others.values()])
        pairs = ((image, "image"), (caption, "caption"), *((c, f) for f, c in others.items()))
        renames = {c: f for c, f in pairs if c != f}
        return ds.rename_columns(renames) if renames else ds

    result = split_train_eval(load, as_sources(source, base_key), eval_source=as_sources(eval_source,
                              "data.eval_source"), load_eval=lambda s, _: load(s, None, "data.eval_source"),
                              eval_split=eval_split, seed=seed, size=size, source_key=base_key)
    logger.info("image-caption rows: %d for training; evaluation: %s%s", len(result.train), result.eval_origin,
                f" ({len(result.eval)} rows)" if result.eval is not None else "")
    return result


def _columns(src: DataSource, columns: Mapping[str, str] | None, extra: Mapping[str, str]
             ) -> tuple[str, str, dict[str, str]]:
    """The image, caption and extra image columns of a source: its own ``columns`` over the run's."""
    mapping = {**(columns or {}), **dict(src.columns)}
    image, caption = image_caption_columns(mapping, extra_fields=tuple(extra))
    return image, caption, {field: mapping.get(field) or default for field, default in extra.items()}


def check_image_caption_data(source: Any, *, columns: Mapping[str, str] | None = None, split: str = "train",
                             key: str = "data.source", cache_dir: str | None = None,
                             extra_image_columns: Mapping[str, str] | None = None,
                             verify_images: bool = False) -> dict[str, Any]:
    """Check image-caption sources before any rank starts (exist, columns, rows, first image and caption;
    ``verify_images``: every image). Returns ``{"rows", "sources", "unreadable"}``."""
    report, bad = [], []
    extra = dict(extra_image_columns or {})
    for src in as_sources(source, key):
        image, caption, others = _columns(src, columns, extra)
        ds = load_image_caption_dataset(src.path, image, caption, split=src.split or split, key=key,
                                        cache_dir=cache_dir, extra_image_columns=tuple(others.values()))
        try:
            first = ds[0]
        except OSError as err:  # PIL cannot decode it
            raise DataSourceError(f"{key}={src.path!r}: the first row's image does not decode ({err})") from None
        for column in (image, *others.values()):
            if not isinstance(first[column], Image.Image):
                raise DataSourceError(f"{key}={src.path!r}: column {column!r} holds {type(first[column]).__name__}, "
                                      f"not images; name the image column with data.columns.image=<column>")
        text = first[caption]
        if not (isinstance(text, str) or (isinstance(text, (list, tuple)) and text and isinstance(text[0], str))):
            raise DataSourceError(f"{key}={src.path!r}: column {caption!r} holds {type(text).__name__}, not text; "
                                  f"name the caption column with data.columns.caption=<column>")
        report.append({"path": src.path, "rows": len(ds), "image_column": image, "caption_column": caption})
        if verify_images:
            bad += _unreadable(ds, src.path, (image, *others.values()))
    if not report:
        raise DataSourceError(f"{key} is empty: give an image folder, a data file, a save_to_disk folder or a hub name")
    return {"rows": sum(r["rows"] for r in report), "sources": report, "unreadable": bad}


def _unreadable(ds: Any, path: str, columns: Sequence[str]) -> list[str]:
    """Every image of ``columns`` that PIL cannot open and verify, as ``"<file or row> (<error>)"``."""
    import io

    import datasets

    bad = []
    for column in columns:
        raw = ds.select_columns([column]).cast_column(column, datasets.Image(decode=False))
        for i, cell in enumerate(raw[column]):
            where = (cell or {}).get("path") or f"{path} row {i} ({column})"
            try:
                if not cell or (cell.get("bytes") is None and not cell.get("path")):
                    raise ValueError("no image")
                handle = io.BytesIO(cell["bytes"]) if cell.get("bytes") is not None else cell["path"]
                with Image.open(handle) as im:
                    im.verify()
            except Exception as err:  # any failure to open is what this pass reports
                bad.append(f"{where} ({type(err).__name__}: {err})")
    return bad


# --- transforms -----------------------------------------------------------------------------------------------
def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator determined only by ``(seed, epoch, index)`` (hashed: neighbouring samples' streams are
    uncorrelated, and a sample's augmentation does not depend on the worker, the rank or a resumption)."""
    digest = hashlib.sha256(f"{seed}:{epoch}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class ImageTransform:
    """diffusers' scripts' torchvision transform in PIL + torch: resize, center or random crop, optional flip,
    ``[3, R, R]`` in ``[-1, 1]``; randomness from the per-call ``generator``, else one seeded ``seed``."""

    def __init__(self, resolution: int, center_crop: bool = True, random_flip: bool = False, seed: int = 0):
        if resolution < 1:
            raise ValueError(f"resolution must be >= 1, got {resolution}")
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip
        self._generator = torch.Generator().manual_seed(seed)

    def __repr__(self) -> str:
        return (f"ImageTransform(resolution={self.resolution}, center_crop={self.center_crop}, "
                f"random_flip={self.random_flip})")

    def _resize(self, image: Image.Image, w: int, h: int) -> Image.Image:
        """``image`` resized as an image of ``w`` x ``h`` is: the shorter side to R, the long side truncated (not
        rounded), as torchvision's Resize(int)."""
        r = self.resolution
        size = (r, max(r, int(r * h / w))) if w <= h else (max(r, int(r * w / h)), r)
        return image if image.size == size else image.resize(size, resample=Image.BILINEAR)

    def apply(self, image: Image.Image, generator: torch.Generator | None = None
              ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(pixels [3, R, R], params)``: ``original_size`` (h, w) before resizing, ``crop_top_left`` (top, left) in
        the resized image and ``flipped``, what SDXL's micro-conditioning (and :meth:`replay`) needs."""
        g = generator if generator is not None else self._generator
        image = image.convert("RGB")
        original_size = (image.height, image.width)
        image = self._resize(image, image.width, image.height)
        r = self.resolution
        w, h = image.size
        if self.center_crop:
            top = round((h - r) / 2.0)
            left = round((w - r) / 2.0)
        else:
            top = int(torch.randint(0, h - r + 1, (1,), generator=g))
            left = int(torch.randint(0, w - r + 1, (1,), generator=g))
        image = image.crop((left, top, left + r, top + r))
        flipped = bool(self.random_flip and float(torch.rand(1, generator=g)) < 0.5)
        if flipped:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1)
        pixels = pixels.float().div(127.5).sub(1.0)
        return pixels, {"original_size": original_size, "crop_top_left": (top, left), "flipped": flipped}

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        """Returns ``[3, R, R]`` float32 in ``[-1, 1]``."""
        return self.apply(image, generator)[0]

    def replay(self, image: Image.Image, params: Mapping[str, Any], size: tuple[int, int]) -> torch.Tensor:
        """A second image of the row (ControlNet conditioning, original ``size``) with the crop and flip
        :meth:`apply` drew for the first; ``[3, R, R]`` in ``[0, 1]`` (no normalisation)."""
        h, w = size
        r = self.resolution
        image = self._resize(image.convert("RGB"), w, h)
        top, left = params["crop_top_left"]
        image = image.crop((left, top, left + r, top + r))
        if params["flipped"]:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True)).permute(2, 0, 1)
        return pixels.float().div(255.0)


class ImageCaptionDataset(torch.utils.data.Dataset):
    """Map-style dataset: ``pixel_values``, ``caption``, SDXL's ``original_size`` / ``crop_top_left`` and a
    ControlNet's ``conditioning_pixel_values``. Item ``i``'s augmentation uses :func:`sample_generator` ``(seed,
    epoch, i)``, independent of workers and resumption; call :meth:`set_epoch` before each epoch."""

    def __init__(self, dataset: Any, transform: ImageTransform, image_column: str = "image",
                 caption_column: str = "text", seed: int = 0, conditioning_column: str | None = None):
        for column in (image_column, caption_column, conditioning_column):
            if column is not None and column not in dataset.column_names:
                raise ValueError(f"column {column!r} not found; available columns: {dataset.column_names}")
        self.dataset, self.transform, self.seed, self.epoch = dataset, transform, seed, 0
        self.image_column, self.caption_column, self.conditioning_column = image_column, caption_column, \
            conditioning_column

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.dataset[int(index)]
        g = sample_generator(self.seed, self.epoch, int(index))
        pixels, params = self.transform.apply(row[self.image_column], generator=g)
        caption = row[self.caption_column]
        if isinstance(caption, (list, tuple)):
            if not caption:
                raise ValueError(f"empty caption list at index {index}")
            caption = caption[int(torch.randint(0, len(caption), (1,), generator=g))]
        if not isinstance(caption, str):
            raise TypeError(f"caption at index {index} is {type(caption).__name__}, expected str or list of str")
        out = {"pixel_values": pixels, "caption": caption, "original_size": params["original_size"],
               "crop_top_left": params["crop_top_left"]}
        if self.conditioning_column:
            out["conditioning_pixel_values"] = self.transform.replay(row[self.conditioning_column], params,
                                                                     params["original_size"])
        return out


# --- tokenization and collation -------------------------------------------------------------------------------
def tokenize_captions(tokenizer: Any, captions: Sequence[str]) -> torch.Tensor:
    """``LongTensor [B, tokenizer.model_max_length]``: padded and truncated (CLIP encoders train on 77 tokens)."""
    if isinstance(captions, str):
        raise TypeError("captions must be a sequence of strings, not a single string")
    for i, c in enumerate(captions):
        if not isinstance(c, str):
            raise TypeError(f"caption {i} is {type(c).__name__}, expected str")
    out = tokenizer(list(captions), max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
                    return_tensors="pt")
    return out.input_ids.long()


def collate(examples: Sequence[Mapping[str, Any]], tokenizer: Any = None) -> dict[str, Any]:
    """Batch examples: ``pixel_values`` ``[B, 3, R, R]``, ``input_ids`` ``[B, L]`` (stacked or tokenized),
    ``captions``, and ``original_sizes`` / ``crop_top_lefts`` when every example has them."""
    if not examples:
        raise ValueError("cannot collate an empty batch")
    pixel_values = torch.stack([e["pixel_values"] for e in examples]).float().contiguous()
    captions = [e["caption"] for e in examples]
    extra: dict[str, torch.Tensor] = {}
    for key, out_key in (("original_size", "original_sizes"), ("crop_top_left", "crop_top_lefts")):
        if all(key in e for e in examples):
            extra[out_key] = torch.tensor([list(e[key]) for e in examples], dtype=torch.long)
    if all("input_ids" in e for e in examples):
        input_ids = torch.stack([torch.as_tensor(e["input_ids"]) for e in examples]).long()
    elif tokenizer is not None:
        input_ids = tokenize_captions(tokenizer, captions)
    else:
        raise ValueError("examples have no 'input_ids' and no tokenizer was given to collate")
    return {"pixel_values": pixel_values, "input_ids": input_ids, "captions": captions, **extra}


# --- ControlNet conditioning of the shapes dataset ----------------------------------------------------------------

CONDITIONING_KINDS: tuple[str, ...] = ("edge", "mask")


def shapes_conditioning_image(row: Mapping[str, Any], resolution: int, kind: str = "edge") -> Image.Image:
    """A shapes row's ControlNet conditioning image: ``mask`` the shape white on black, ``edge`` its one-pixel
    boundary."""
    if kind not in CONDITIONING_KINDS:
        raise ValueError(f"kind={kind!r}; use one of {list(CONDITIONING_KINDS)}.")
    mask = np.asarray(_draw_shape(row, resolution, mask=True)) > 0
    if kind == "edge":
        padded = np.pad(mask, 1)
        inner = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
        mask = mask & ~inner
    return Image.fromarray(np.repeat(mask[..., None] * np.uint8(255), 3, axis=-1), mode="RGB")


def conditioning_pixels(image: Image.Image, resolution: int, center_crop: bool = True) -> torch.Tensor:
    """A conditioning image as the ControlNet takes it, float32 ``[3, R, R]``: resized and cropped like a training
    image (no flip), in ``[0, 1]`` (diffusers' conditioning transform has no normalisation)."""
    return ImageTransform(resolution, center_crop=center_crop, random_flip=False)(image).add(1.0).div(2.0)

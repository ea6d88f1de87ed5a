"""What a diffusion fine-tune reads before it trains, checked before any rank starts: the pipeline folder (its
family, the image side it allows) and the image-caption rows (the ``data`` section: sources, columns, held-out
split, unreadable images, training rows per rank)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from multiengine.engines.settings import (
    Choice,
    FieldError,
    Range,
    Settings,
    SettingsError,
    config_problem,
    section,
    setting,
)
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.families import model_family
from multiengine.pipelines.diffusion.runs import eval_split_value, held_out_of, resolution_multiple

__all__ = ["ConditionedImageData", "HeldoutEval", "ImageData", "check_config_folder", "check_resolution",
           "input_problem", "model_folder_family"]


def input_problem(key: str, value: Any, problem: str, exc: Exception, named: Sequence[str]) -> SettingsError:
    """A data or model-folder error as the config error: as it is when it already names its key."""
    text = str(exc)
    return SettingsError(text) if text.startswith(tuple(named)) else config_problem(key, value, problem, text)


def model_folder_family(pretrained: str, tiny_family: str, key: str = "model.pretrained") -> str:
    """The family of the pipeline folder ``pretrained`` (a local folder, checked), ``tiny_family`` when it is
    empty, "" for a hub name (its family is known once downloaded)."""
    from multiengine.pipelines.checks import check_diffusers_folder, check_model_folder

    if not pretrained:
        return tiny_family
    try:
        if check_model_folder(pretrained, key, kind="diffusers") != "local":
            return ""
        check_diffusers_folder(pretrained, key)
        return model_family(os.path.expanduser(pretrained))
    except (ValueError, FileNotFoundError) as exc:
        raise input_problem(key, pretrained, "is not a usable diffusers folder", exc, named=(key,)) from None


def check_resolution(resolution: int, family: str, path: str, key: str) -> None:
    """The image side must be a multiple of what the family's vae and denoiser need: from the folder's configs,
    the tiny models' when ``path`` is no local folder."""
    folder = os.path.expanduser(path) if path and os.path.isdir(os.path.expanduser(path)) else None
    multiple = resolution_multiple(family, folder)
    if resolution % multiple:
        raise config_problem(key, resolution, f"is not a multiple of {multiple}, which this {family} model needs "
                             "(vae downsampling x the denoiser's patches / levels)",
                             f"use {key}={max(multiple, resolution // multiple * multiple)}")


def check_config_folder(key: str, folder: str, what: str, fix: str) -> None:
    """A model folder given for ``key`` (a denoiser, a ControlNet, a reward model) holds its config.json."""
    if folder and not os.path.isfile(os.path.join(os.path.expanduser(folder), "config.json")):
        raise config_problem(key, folder, f"has no config.json (not {what})", fix)


def _default(obj: Any, name: str) -> Any:
    f = obj.__dataclass_fields__[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


@dataclass(frozen=True)
class HeldoutEval(Settings):
    heldout_size: int = setting(8, "held-out rows for the loss (taken from the data unless data.eval_source/"
                                   "eval_split); 0 = none", Range(0))
    timesteps: int = setting(8, "evenly spaced timesteps (schedule positions) per held-out image", Range(1),
                             when="heldout_size")
    every: int = setting(0, "also every N steps when > 0 (always before and after)", Range(0), when="heldout_size")
    seed: int = setting(1234, "the held-out noise's seed", Range(0), when="heldout_size")


@dataclass(frozen=True)
class ImageColumns(Settings):
    image: str = setting("", "your image column (\"\" = data.image_column)")
    caption: str = setting("", "your caption column (\"\" = data.caption_column)")


@dataclass(frozen=True)
class ImageData(Settings):
    """A run's image-caption rows (docs/data.md): ``sources`` or ``source`` (both empty: the shapes data), held out
    from ``eval_source``, else ``eval_split``, else ``eval.heldout_size`` training rows."""

    source: str = setting("", "imagefolder (metadata.jsonl), data file, save_to_disk folder or hub name; \"\" = "
                              "shapes")
    sources: list[Any] = setting([], "several sources with weights: [{path, weight, columns, split}] (instead of "
                                     "data.source)", example=[{"path": "/no/such/folder", "weight": 1}])
    columns: ImageColumns = section(ImageColumns, "your column names per field")
    image_column: str = setting("image", "the image column (alias of data.columns.image)")
    caption_column: str = setting("text", "the caption column (alias of data.columns.caption)")
    train_split: str = setting("train", "the split of a hub dataset or DatasetDict folder to train on")
    eval_source: str = setting("", "separate evaluation rows (same forms as data.source); wins over data.eval_split")
    eval_split: str = setting("", "held-out rows: a fraction (0.05), a count (16), a split name (test); \"\" = "
                                  "eval.heldout_size")
    check_images: bool = setting(True, "your data: before any rank starts, open every image and list the unreadable "
                                       "ones")
    resolution: int = setting(32, "training (and validation) size in pixels, square", Range(8))
    center_crop: bool = setting(True, "center crop after resizing the shorter side (false: random crop)")
    random_flip: bool = setting(False, "random horizontal flip")
    builtin_size: int = setting(136, "images of the built-in shapes dataset (generated under output_dir/data)",
                                Range(1))
    max_train_samples: int = setting(0, "use only the first N training rows (0 = all)", Range(0))
    num_workers: int = setting(0, "DataLoader workers per rank", Range(0))
    cache_dir: str = setting("", "datasets cache folder (\"\" = the default)")

    conditioning = False  # every row also has a conditioning image (ConditionedImageData)
    builtin_only = ("builtin_size",)  # what applies to the built-in shapes data only

    def check(self) -> None:
        if self.source and self.sources:
            raise FieldError("sources", self.sources, "and data.source are both given", "give one of the two")
        for name in self.builtin_only if self.spec else ("check_images",):
            if getattr(self, name) != _default(self, name):
                where = "the built-in shapes data only (data.source and data.sources empty)" if self.spec else \
                    "your data (data.source or data.sources), not the built-in shapes data"
                raise FieldError(name, getattr(self, name), f"applies to {where}", f"drop data.{name}")

    @property
    def spec(self) -> Any:
        """The training source(s): ``sources`` when given, else ``source`` ("" = the built-in data)."""
        return list(self.sources) or self.source

    @property
    def spec_key(self) -> str:
        return "data.sources" if self.sources else "data.source"

    def split_key(self) -> str:
        """The key that sets the held-out split: ``eval_split`` when given, else ``heldout_size``."""
        return "data.eval_split" if self.eval_split.strip() else "eval.heldout_size"

    def _columns(self) -> tuple[dict[str, str], dict[str, str] | None]:
        """The column of each field and (conditioning) the extra image column's field and default."""
        c = self.columns
        columns = {"image": c.image or self.image_column, "caption": c.caption or self.caption_column}
        if not self.conditioning:
            return columns, None
        return columns, {"conditioning_image": c.conditioning_image or "conditioning_image"}

    def load(self, source: Any, heldout_size: int, seed: int) -> Any:
        """The training and held-out rows of ``source`` (``spec``, or the built-in data's folder)."""
        columns, extra = self._columns()
        return data_lib.load_image_caption_data(
            source, columns=columns, train_split=self.train_split, eval_source=self.eval_source or None,
            eval_split=eval_split_value(self.eval_split, heldout_size), seed=seed, cache_dir=self.cache_dir or None,
            extra_images=extra)

    def first_rows(self, rows: Any) -> Any:
        """The first ``max_train_samples`` training rows (all when 0)."""
        return rows.select(range(min(self.max_train_samples, len(rows)))) if self.max_train_samples else rows

    def transform(self, train: bool) -> data_lib.ImageTransform:
        """The training rows' augmentation, or the held-out rows' (center crop, no flip)."""
        if train:
            return data_lib.ImageTransform(self.resolution, self.center_crop, self.random_flip)
        return data_lib.ImageTransform(self.resolution, center_crop=True, random_flip=False)

    def check_rows(self, heldout_size: int) -> dict[str, Any] | None:
        """Each source exists, has the columns and rows, enough rows for the held-out split, and (``check_images``)
        every image opens; the built-in data needs only its sizes. Returns the sources' report (None: built-in)."""
        from multiengine.pipelines.sources import DataSourceError

        spec, key = self.spec, self.spec_key
        if not spec:
            if not self.eval_split.strip() and not self.eval_source and heldout_size >= self.builtin_size:
                raise config_problem("eval.heldout_size", heldout_size, f"leaves no training rows of the built-in "
                                     f"data ({self.builtin_size} images)", f"set eval.heldout_size below "
                                     f"{self.builtin_size} or raise data.builtin_size")
            return None
        columns, extra = self._columns()
        try:
            report = data_lib.check_image_caption_data(spec, columns=columns, split=self.train_split, key=key,
                                                       cache_dir=self.cache_dir or None, extra_image_columns=extra,
                                                       verify_images=self.check_images)
        except (DataSourceError, ValueError, FileNotFoundError) as exc:
            raise self._problem(key, "cannot be used as image-caption data", exc) from None
        held = eval_split_value(self.eval_split, heldout_size)
        if not self.eval_source and isinstance(held, int) and held >= report["rows"]:
            raise config_problem(self.split_key(), held, f"holds out every row of the data ({report['rows']} rows)",
                                 f"set {self.split_key()} below {report['rows']}")
        bad = report["unreadable"]
        if bad:
            shown = "; ".join(bad[:10]) + (f"; ... ({len(bad)} in all)" if len(bad) > 10 else "")
            raise config_problem(key, spec, f"has {len(bad)} unreadable image(s): {shown}", "remove or replace those "
                                 "files (or set data.check_images=false to find them only when training reads them)")
        return report

    def _problem(self, key: str, problem: str, exc: Exception) -> SettingsError:
        return input_problem(key, self.spec, problem, exc, named=("data.source", "data.eval_source"))

    def training_rows(self, heldout_size: int, seed: int) -> tuple[int, int]:
        """(training rows, rows the held-out split took out of them) as the run will have them: each rank's share
        of the first must fill a micro batch."""
        spec, split = self.spec, eval_split_value(self.eval_split, heldout_size)
        if not spec:
            train = self.builtin_size
            held = 0 if self.eval_source else held_out_of(train, split)
            train -= held
        else:
            try:
                data = self.load(spec, heldout_size, seed)
            except (ValueError, FileNotFoundError) as exc:
                raise self._problem(self.spec_key, "cannot be split into training and evaluation rows", exc) from None
            train = len(data.train)
            held = len(data.eval) if data.eval is not None and "held out" in str(data.eval_origin) else 0
        return (min(train, self.max_train_samples) if self.max_train_samples else train), held


@dataclass(frozen=True)
class ConditionedColumns(ImageColumns):
    conditioning_image: str = setting("", "your conditioning image column (\"\" = conditioning_image)")


@dataclass(frozen=True)
class ConditionedImageData(ImageData):
    """:class:`ImageData` whose rows also have a conditioning image (a ControlNet's)."""

    columns: ConditionedColumns = section(ConditionedColumns, "your column names per field")
    conditioning_kind: str = setting("edge", "built-in shapes data: edge (outline) or mask (filled shape) images",
                                     Choice(*data_lib.CONDITIONING_KINDS))

    conditioning = True
    builtin_only = ("builtin_size", "conditioning_kind")

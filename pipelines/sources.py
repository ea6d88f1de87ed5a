"""Where a pipeline's rows come from: data files, ``save_to_disk`` folders, folders of split files, imagefolders and
hub names (the kind decided from the path, never from a file's contents; a missing local path is an error, never a
hub lookup), column mapping, weighted blends and held-out evaluation splits."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multiengine.engines.settings import SettingsError

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

__all__ = ["DATA_FILE_BUILDERS", "DEFAULT_EVAL_FRACTION", "EVAL_SPLIT_NAMES", "DataSource", "DataSourceError",
           "TrainEval", "as_sources", "blend", "heldout_split", "is_hub_name", "load_source", "map_columns",
           "named_eval_split", "parse_eval_split", "source_kind", "split_train_eval"]

DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# ``eval_split="auto"``: the split a source already keeps apart for evaluation (a folder's ``eval.jsonl``,
# a DatasetDict's or hub dataset's ``test`` split), else this fraction of its rows, held out
EVAL_SPLIT_NAMES = ("eval", "test", "validation")
DEFAULT_EVAL_FRACTION = 0.05
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


class DataSourceError(SettingsError):
    """A data source that cannot be used as given; the message names the key, the value and the fix."""


@dataclass(frozen=True)
class DataSource:
    """One source of rows: a file, folder or hub name, its relative ``weight`` in a blend, its own ``{field:
    column}`` mapping and the split to read (``None``: the caller's, usually ``train``)."""

    path: str
    weight: float = 1.0
    columns: Mapping[str, str] = field(default_factory=dict)
    split: str | None = None


def as_sources(spec: Any, key: str = "data.sources") -> list[DataSource]:
    """``spec`` as a list of :class:`DataSource`: a path or name, a ``DataSource``, a ``{path, weight, columns,
    split}`` mapping (the YAML form), or a list of those."""
    if spec is None or spec == "":
        return []
    if isinstance(spec, (str, os.PathLike, DataSource)) or isinstance(spec, Mapping):
        spec = [spec]
    out: list[DataSource] = []
    for i, item in enumerate(spec):
        where = f"{key}[{i}]" if len(spec) > 1 or key.endswith("sources") else key
        if isinstance(item, DataSource):
            out.append(item)
        elif isinstance(item, (str, os.PathLike)):
            out.append(DataSource(str(item)))
        elif isinstance(item, Mapping):
            unknown = set(item) - {"path", "weight", "columns", "split"}
            if unknown:
                raise DataSourceError(f"{where} has unknown key(s) {sorted(unknown)}; a source takes path, weight, "
                                      f"columns and split, e.g. {{path: data/a.jsonl, weight: 2}}")
            if not item.get("path"):
                raise DataSourceError(f"{where} has no path; write it as {{path: data/a.jsonl, weight: 1}}")
            out.append(DataSource(str(item["path"]), float(item.get("weight", 1.0)),
                                  dict(item.get("columns") or {}), item.get("split") or None))
        else:
            raise DataSourceError(f"{where}={item!r} is not a path or a {{path, weight}} mapping")
    for i, s in enumerate(out):
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise DataSourceError(f"{key}[{i}].weight={s.weight!r} ({s.path}): weights must be positive numbers")
    return out


# --- what a source is ----------------------------------------------------------------------------------------------


def is_hub_name(path: str) -> bool:
    """True for strings shaped like a hub repo id (``name`` or ``org/name``) that are not local paths."""
    if os.path.exists(path) or path.startswith(("/", ".", "~")) or "\\" in path:
        return False
    if Path(path).suffix.lower() in DATA_FILE_BUILDERS or "--" in path or ".." in path:
        return False
    return bool(_HUB_NAME.match(path))


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _split_file(folder: Path, names: Sequence[str]) -> Path | None:
    for name in names:
        for ext in DATA_FILE_BUILDERS:
            candidate = folder / f"{name}{ext}"
            if candidate.is_file():
                return candidate
    return None


def source_kind(path: str, names: Sequence[str] = ("train",), images: bool = False,
                key: str = "data.source") -> str:
    """``file``, ``disk``, ``split_files``, ``imagefolder`` (with ``images``) or ``hub``; ``names``: split file stems
    by preference. DataSourceError for a missing local path, an unsupported file or a folder with none of ``names``."""
    p = Path(os.path.expanduser(path))
    if p.is_file():
        if p.suffix.lower() not in DATA_FILE_BUILDERS:
            raise DataSourceError(f"Unsupported data file type {p.suffix!r} ({key}={path!r}); use one of "
                                  f"{sorted(DATA_FILE_BUILDERS)}, a save_to_disk folder or a folder of split files")
        return "file"
    if p.is_dir():
        if _is_saved_dataset(p):
            return "disk"
        if _split_file(p, names) is not None:
            return "split_files"
        if images:
            return "imagefolder"
        present = sorted(f.name for f in p.iterdir() if f.suffix.lower() in DATA_FILE_BUILDERS)
        raise DataSourceError(
            f"{key}={path!r} is a folder with no {'/'.join(names)} file ({'/'.join(DATA_FILE_BUILDERS)}) and is not "
            f"a save_to_disk folder (it has {present or 'no data files'}); point {key} at a file, or name the "
            f"files {names[0]}.jsonl, ...")
    if is_hub_name(path):
        return "hub"
    raise DataSourceError(f"no such file or folder: {path} ({key}); check the path (relative paths are read from "
                          f"{os.getcwd()})")


# --- loading -------------------------------------------------------------------------------------------------------
def load_source(path: str, *, names: Sequence[str] = ("train",), split: str = "train", images: bool = False,
                key: str = "data.source", split_required: bool = False, cache_dir: str | None = None,
                **load_kwargs: Any) -> Dataset:
    """One source as a ``datasets.Dataset``: ``split`` of a hub dataset or ``DatasetDict`` (a single other split is
    used, logged, unless ``split_required``); ``key`` names the config key in errors."""
    try:
        return _load_source(path, names, split, images, key, split_required, cache_dir, load_kwargs)
    except ValueError as err:
        if "corresponds to no data" in str(err):  # datasets' words for an empty file or split
            raise DataSourceError(f"{key}={path!r} has no rows (split {split!r})") from err
        raise
    except StopIteration as err:  # datasets' json builder on a file with no lines
        raise DataSourceError(f"{key}={path!r} has no rows; add data to it or point {key} at another "
                              f"source") from err


def _load_source(path: str, names: Sequence[str], split: str, images: bool, key: str, split_required: bool,
                 cache_dir: str | None, load_kwargs: dict[str, Any]) -> Dataset:
    import datasets

    kind = source_kind(path, names, images, key)
    kwargs = dict(load_kwargs)
    if cache_dir:
        kwargs["cache_dir"] = cache_dir
    p = os.path.expanduser(path)
    no_split = (f"{key}={path!r} is a single {'file' if kind == 'file' else 'dataset'} with no {split!r} split; use "
                f"data.eval_split=0.05 (hold out 5% of its rows) or data.eval_source=<other rows>")
    if split_required and kind == "file":
        raise DataSourceError(no_split)
    if kind == "file":
        builder = DATA_FILE_BUILDERS[Path(p).suffix.lower()]
        return datasets.load_dataset(builder, data_files=p, split="train", **kwargs)
    if kind == "split_files":
        file = _split_file(Path(p), names)
        return datasets.load_dataset(DATA_FILE_BUILDERS[file.suffix.lower()], data_files=str(file), split="train",
                                     **kwargs)
    if kind == "disk":
        loaded = datasets.load_from_disk(p)
        if isinstance(loaded, datasets.DatasetDict):
            if split in loaded:
                return loaded[split]
            if len(loaded) == 1 and not split_required:
                only = next(iter(loaded))
                logger.info("%s=%s has the single split %r (asked for %r): using it", key, path, only, split)
                return loaded[only]
            raise DataSourceError(f"{key}={path!r} has splits {sorted(loaded)}, not {split!r}; choose one of them "
                                  f"(the split setting of this source)")
        if split_required:
            raise DataSourceError(no_split)
        return loaded
    if kind == "imagefolder":
        _check_image_folder(p, path, key)
        return datasets.load_dataset("imagefolder", data_dir=p, split=split, **kwargs)
    try:
        return datasets.load_dataset(path, split=split, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError) as err:
        offline = os.environ.get("HF_DATASETS_OFFLINE") or os.environ.get("HF_HUB_OFFLINE")
        hint = ("it is not in the local datasets cache" if offline else
                "no network? set HF_DATASETS_OFFLINE=1 to read it from the local cache")
        raise DataSourceError(f"{key}={path!r}: not a local file or folder, and the hub dataset could not be loaded "
                              f"({hint}): {err}") from err


def _image_extensions() -> frozenset[str]:
    try:
        from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

        return frozenset(e.lower() for e in ImageFolder.EXTENSIONS)
    except (ImportError, AttributeError):
        from PIL import Image

        return frozenset(Image.registered_extensions())


def _rowless(file: str, header: bool) -> bool:
    """A metadata file with no data line (a csv's first line is its header)."""
    with open(file, encoding="utf-8", errors="replace") as f:
        lines = (line for line in f if line.strip())
        return next(lines, None) is None or (header and next(lines, None) is None)


def _check_image_folder(folder: str, path: str, key: str) -> None:
    """An imagefolder must hold at least one image (hidden files and folders do not count, as for ``datasets``):
    without one, ``datasets`` fails with an IndexError or "doesn't contain any data files"."""
    extensions = _image_extensions()
    others: list[str] = []
    images = False
    rowless = None
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(files):
            if name.startswith((".", "__")):
                continue
            file = os.path.join(root, name)
            if os.path.splitext(name)[1].lower() in extensions:
                images = True
                continue
            others.append(os.path.relpath(file, folder))
            if rowless is None and name in ("metadata.jsonl", "metadata.csv") and _rowless(file, name.endswith("csv")):
                rowless = others[-1]
    if images and rowless:
        raise DataSourceError(f"{key}={path!r}: its {rowless} has no rows; write one line per image with its file_name "
                              f"and caption, or point {key} at another source")
    if images:
        return
    found = f"it holds only {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}" if others else "it is empty"
    raise DataSourceError(f"{key}={path!r} is an image folder with no images ({found}); put the images (.png, .jpg, "
                          f".webp, ...) in it beside a metadata.jsonl with file_name and caption columns, or point "
                          f"{key} at a data file or a save_to_disk folder")


def map_columns(ds: Dataset, columns: Mapping[str, str] | None, fields: Sequence[str], source: str,
                key: str = "data.columns") -> Dataset:
    """The user's columns renamed to the pipeline's fields (``columns = {field: column}``); a column already named
    like a mapped field, but not the one mapped to it, is dropped. DataSourceError for an unknown field or column."""
    if not columns:
        return ds
    unknown = [f for f in columns if f not in fields]
    if unknown:
        raise DataSourceError(f"{key} maps unknown field(s) {unknown}; the fields are {list(fields)} "
                              f"(e.g. {key}.{fields[0]}=<your column>)")
    have = set(ds.column_names)
    missing = {f: c for f, c in columns.items() if c not in have}
    if missing:
        raise DataSourceError(
            f"{key}: column(s) {sorted(missing.values())} (for {sorted(missing)}) not in {source}; it has "
            f"{sorted(have)}")
    renames = {c: f for f, c in columns.items() if c != f}
    clash = [f for c, f in renames.items() if f in have and f not in renames]
    if clash:
        ds = ds.remove_columns(clash)
    return ds.rename_columns(renames) if renames else ds


# --- blends and held-out splits ------------------------------------------------------------------------------------


def _generator(seed: int, *salt: int):
    import torch

    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + sum((i + 1) * 7919 * s for i, s in enumerate(salt))) & ((1 << 63) - 1))
    return g


def _counts(weights: Sequence[float], total: int) -> list[int]:
    """Largest-remainder rounding of ``total * w / sum(w)`` (sums to ``total`` exactly)."""
    s = float(sum(weights))
    raw = [total * w / s for w in weights]
    counts = [int(math.floor(r)) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def blend(datasets_: Sequence[Dataset], weights: Sequence[float], seed: int = 0, size: int | None = None) -> Dataset:
    """A deterministic weighted mixture: ``round(size * w_i / sum(w))`` rows of source ``i`` in whole seeded passes,
    shuffled with ``seed``; a single source with no ``size`` is returned unchanged."""
    import datasets
    import torch

    if len(datasets_) != len(weights):
        raise ValueError(f"{len(datasets_)} datasets but {len(weights)} weights")
    if not datasets_:
        raise ValueError("nothing to blend")
    if len(datasets_) == 1 and size is None:
        return datasets_[0]
    for i, ds in enumerate(datasets_):
        if len(ds) == 0:
            raise DataSourceError(f"source {i} of the blend has no rows")
    total = int(size) if size is not None else sum(len(d) for d in datasets_)
    parts = []
    first = datasets_[0]
    for i, (ds, n) in enumerate(zip(datasets_, _counts(weights, total), strict=True)):
        index: list[int] = []
        passes = 0
        while len(index) < n:
            index.extend(torch.randperm(len(ds), generator=_generator(seed, i, passes)).tolist())
            passes += 1
        part = ds.select(index[:n])
        if set(part.column_names) != set(first.column_names):
            raise DataSourceError(f"source {i} of the blend has columns {sorted(part.column_names)}, source 0 has "
                                  f"{sorted(first.column_names)}; map them to the same fields (columns)")
        if part.features != first.features:
            try:
                part = part.cast(first.features)
            except (ValueError, TypeError) as err:
                raise DataSourceError(f"source {i} of the blend has column types {part.features}, source 0 "
                                      f"{first.features}; they cannot be mixed: {err}") from err
        parts.append(part)
    mixed = datasets.concatenate_datasets(parts)
    return mixed.select(torch.randperm(len(mixed), generator=_generator(seed, 10_007)).tolist())


def heldout_split(ds: Dataset, eval_split: float | int, seed: int = 0,
                  key: str = "data.eval_split") -> tuple[Dataset, Dataset]:
    """``(train, heldout)``: a seeded random ``eval_split`` fraction (``0 < f < 1``) or count (``>= 1``) of the rows
    held out, both in the original order; DataSourceError for another value or one that leaves no training rows."""
    import torch

    n_rows = len(ds)
    if isinstance(eval_split, bool) or not isinstance(eval_split, (int, float)) or eval_split <= 0:
        raise DataSourceError(f"{key}={eval_split!r}: use a fraction in (0, 1) (e.g. 0.05) or a row count >= 1")
    if isinstance(eval_split, float) and eval_split < 1:
        n = max(1, round(eval_split * n_rows))
    elif float(eval_split).is_integer():
        n = int(eval_split)
    else:
        raise DataSourceError(f"{key}={eval_split!r}: use a fraction in (0, 1) (e.g. 0.05) or a row count >= 1")
    if n >= n_rows:
        raise DataSourceError(f"{key}={eval_split!r} holds out {n} of {n_rows} rows and leaves none to train on; "
                              f"use a smaller fraction or more data")
    perm = torch.randperm(n_rows, generator=_generator(seed, 20_011)).tolist()
    held = sorted(perm[:n])
    held_set = set(held)
    return ds.select([i for i in range(n_rows) if i not in held_set]), ds.select(held)


def parse_eval_split(value: Any, key: str = "data.eval_split") -> str | float | int | None:
    """``eval_split`` as the pipelines take it: ``"auto"``; None (``"none"``, ``""``, ``0``); a fraction in (0, 1)
    or a whole row count; else a split name. DataSourceError for a negative or fractional count."""
    if value is None or isinstance(value, bool):
        if value is True:
            raise DataSourceError(f"{key}=true: use auto, none, a fraction (0.05), a row count (200) or a split name")
        return None
    text = str(value).strip()
    if text.lower() in ("", "none", "null", "0", "0.0"):
        return None
    if text.lower() == "auto":
        return "auto"
    try:
        number = float(text)
    except ValueError:
        return text  # a split name
    if not math.isfinite(number) or number <= 0 or (number >= 1 and not number.is_integer()):
        raise DataSourceError(f"{key}={value!r}: use a fraction in (0, 1) (e.g. 0.05), a row count >= 1 (e.g. 200), "
                              f"a split name (test), auto or none")
    return int(number) if number >= 1 else number


def named_eval_split(source: DataSource) -> str | None:
    """The ``eval``/``test``/``validation`` split ``source`` already has (split files, ``DatasetDict`` or hub
    dataset), else ``None``; nothing is loaded."""
    import json

    p = Path(os.path.expanduser(source.path))
    own = {source.split or "train"}
    if p.is_file():
        return None
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            try:
                splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
            except (OSError, ValueError):
                return None
            return next((n for n in EVAL_SPLIT_NAMES if n in splits and n not in own), None)
        if _is_saved_dataset(p):
            return None
        found = _split_file(p, [n for n in EVAL_SPLIT_NAMES if n not in own])
        return found.stem if found is not None else None
    if is_hub_name(source.path):
        try:
            import datasets

            splits = datasets.get_dataset_split_names(source.path)
        except Exception:  # noqa: BLE001 - no metadata offline or a gated repo: fall back to held-out rows
            return None
        return next((n for n in EVAL_SPLIT_NAMES if n in splits and n not in own), None)
    return None


@dataclass
class TrainEval:
    """Training rows, evaluation rows (or ``None``) and where the evaluation rows came from."""

    train: Dataset
    eval: Dataset | None
    eval_origin: str


def split_train_eval(load: Callable[[DataSource, str | None], Dataset], sources: Sequence[DataSource], *,
                     eval_source: Sequence[DataSource] = (),
                     load_eval: Callable[[DataSource, str | None], Dataset] | None = None,
                     eval_split: float | int | str | None = 0.0, seed: int = 0, size: int | None = None,
                     source_key: str = "data.source", evaluate: bool = True) -> TrainEval:
    """Training and evaluation rows, never silently the same: ``eval_source`` rows, else ``eval_split`` (a fraction
    or count held out of each source before the blend, a split name, or ``"auto"``), blended into ``size`` rows."""
    import datasets

    if not sources:
        raise DataSourceError(f"{source_key} is empty: give a data file, folder or hub dataset name")
    train_parts = [load(s, None) for s in sources]
    eval_ds: Dataset | None = None
    if not evaluate:
        origin = "not needed"
    elif eval_source:
        train_ids = {(os.path.abspath(s.path), s.split) for s in sources}
        for e in eval_source:
            if (os.path.abspath(e.path), e.split) in train_ids:
                raise DataSourceError(
                    f"data.eval_source={e.path!r} is also a training source: that evaluates on training rows; "
                    f"use a separate file, another split of it (split: test), or data.eval_split=0.05")
        parts = [(load_eval or load)(e, None) for e in eval_source]
        eval_ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        origin = "data.eval_source=" + ",".join(e.path for e in eval_source)
    elif eval_split:
        # per source: ("split", name) or ("heldout", fraction or count)
        plans: list[tuple[str, Any]] = []
        for s in sources:
            if eval_split == "auto":
                name = named_eval_split(s)
                plans.append(("split", name) if name else ("heldout", DEFAULT_EVAL_FRACTION))
            elif isinstance(eval_split, str):
                plans.append(("split", eval_split))
            else:
                plans.append(("heldout", eval_split))
        held, described = [], []
        for i, (s, (how, what)) in enumerate(zip(sources, plans, strict=True)):
            if how == "split":
                try:
                    held.append(load(s, what))
                except DataSourceError as err:
                    if eval_split != "auto":
                        raise
                    raise DataSourceError(f"the evaluation rows of {s.path} (its split {what!r}, picked by "
                                          f"data.eval_split=auto) cannot be used: {err}. Set data.eval_split=0.05 to "
                                          f"hold out training rows instead, or data.eval_source") from err
                described.append(f"split {what!r} of {s.path}")
            else:
                train_parts[i], h = heldout_split(train_parts[i], what, seed + i)
                held.append(h)
                described.append(f"{len(h)} rows held out of {s.path} ({what:g}, seed {seed + i})")
                if eval_split == "auto":
                    logger.warning(
                        "data.eval_split=auto: %s has no evaluation split (eval/test file or split), so %d of its %d "
                        "rows (%g, seeded) are held out for evaluation and never trained on; set data.eval_source or "
                        "data.eval_split to choose", s.path, len(h), len(h) + len(train_parts[i]), what)
        eval_ds = held[0] if len(held) == 1 else datasets.concatenate_datasets(held)
        origin = "; ".join(described)
    else:
        origin = "none"
        logger.warning("no evaluation rows: set data.eval_split (e.g. 0.05) or data.eval_source to evaluate on rows "
                       "that are not trained on")
    train = blend(train_parts, [s.weight for s in sources], seed=seed, size=size)
    if eval_ds is not None and len(eval_ds) == 0:
        raise DataSourceError(f"the evaluation rows ({origin}) are empty")
    return TrainEval(train, eval_ds, origin)

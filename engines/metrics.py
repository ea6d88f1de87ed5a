"""Metrics (JSON lines, optional TensorBoard and wandb), logging setup and the run summary file. Imports neither
torch nor numpy (duck typing: `.item()` / `.tolist()`), so the CLI imports it cheaply."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
# Marks the handler that setup_logging installed, so a second call replaces it instead of
# stacking a duplicate, and leaves other handlers (pytest's caplog, the user's) alone.
_HANDLER_FLAG = "_multiengine_handler"


def setup_logging(rank: int, stream: Any = None) -> None:
    """Root logging: INFO on rank 0, WARNING on the others (N ranks repeating each line is noise)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_FLAG, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    setattr(handler, _HANDLER_FLAG, True)
    root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def _to_number(key: str, value: Any) -> float | int | None:
    """A metric as a plain number: tensors / numpy scalars via .item(); bools and ints stay exact."""
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    if hasattr(value, "item"):
        try:
            item = value.item()  # raises for multi-element tensors/arrays: a metric must be a scalar
        except (ValueError, RuntimeError) as e:
            raise TypeError(f"metric {key!r} is not a scalar: {e}") from None
        return int(item) if isinstance(item, bool) else item
    raise TypeError(f"metric {key!r} has non-numeric value {value!r} ({type(value).__name__})")


def to_plain(value: Any) -> Any:
    """Recursively turn tensors/numpy values, tuples and paths into JSON-serialisable Python values."""
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Infinity
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist"):  # tensors and numpy arrays/scalars; 0-d gives a scalar
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return to_plain(value.tolist())
    if hasattr(value, "item"):
        return to_plain(value.item())
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to JSON")


class MetricsLogger:
    """One JSON line per `log` call, mirrored to TensorBoard when installed and to wandb when `wandb` (``wandb.init``
    kwargs) is given. Disabled (`enabled=(rank == 0)`) it is a no-op, so call sites need no rank checks."""

    def __init__(self, path_jsonl: str, enabled: bool, tensorboard_dir: str | None = None,
                 wandb: dict[str, Any] | None = None) -> None:
        self.path = path_jsonl
        self.enabled = enabled
        self._file = None
        self._tb = None
        self._wandb = None  # the wandb module
        self._wandb_run = None
        if not enabled:
            return
        Path(path_jsonl).parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered append: every line reaches the file as it is logged, so a crashed or
        # killed run keeps its curve, and a resumed run continues the same file.
        self._file = open(path_jsonl, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            # Broad: a broken tensorboard/protobuf install fails with more than ImportError. The package
            # installs tensorboard, but engines/ is usable without it: the JSONL file always exists.
            except Exception:  # noqa: BLE001
                logger.info("tensorboard is not installed; writing metrics to %s only", path_jsonl)
            else:
                self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb is not None:
            self._wandb = import_wandb()
            self._wandb_run = self._wandb.init(**wandb)

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "") -> None:
        """Write `{"step": step, "<prefix>/<key>": value, ...}` (non-finite values as null); a non-scalar
        value is a TypeError."""
        if not self.enabled or self._file is None:
            return
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            name = f"{prefix}/{key}" if prefix else str(key)
            record[name] = _to_number(name, value)
        # JSON has no NaN/Infinity: a non-finite value is written as null (the file stays valid JSON).
        plain = {k: (v if v is None or math.isfinite(v) else None) for k, v in record.items()}
        self._file.write(json.dumps(plain, allow_nan=False) + "\n")
        if self._tb is not None:
            for name, value in plain.items():
                if name != "step" and value is not None:
                    self._tb.add_scalar(name, value, int(step))
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in plain.items() if k != "step" and v is not None}, step=int(step))

    def log_image(self, step: int, tag: str, image: Any) -> None:
        """Write one image to TensorBoard (and wandb) under `tag` at `step`: a PNG/JPEG path, a PIL image, or
        an HxW / HxWxC uint8 array. A no-op when disabled or when neither TensorBoard nor wandb is on."""
        if not self.enabled or (self._tb is None and self._wandb_run is None):
            return
        import numpy as np
        from PIL import Image

        if isinstance(image, (str, os.PathLike)):
            with Image.open(image) as opened:
                image = opened.convert("RGB")
        array = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
        if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (1, 3, 4)):
            raise ValueError(f"image {tag!r}: expected HxW or HxWxC (C = 1, 3 or 4), got shape {array.shape}")
        if self._tb is not None:
            self._tb.add_image(tag, array, int(step), dataformats="HW" if array.ndim == 2 else "HWC")
        if self._wandb_run is not None:
            self._wandb_run.log({tag: self._wandb.Image(array)}, step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


WANDB_MISSING = "wandb is not installed"
WANDB_FIX = "pip install wandb, or set report_to=none"


def import_wandb() -> Any:
    """The wandb module, imported on demand (it is optional); ImportError naming the fix when it is missing."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError(f"report_to=wandb: {WANDB_MISSING} ({e}); fix: {WANDB_FIX}") from e
    return wandb


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics file; a torn last line (the run was killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return records


def write_summary(path: str | os.PathLike, summary: dict[str, Any]) -> None:
    """Write `summary` as indented JSON atomically: readers never see a half-written file."""
    plain = to_plain(summary)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(plain, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a summary is meant to be read by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot_curves(records: list[dict[str, Any]], out_png: str | os.PathLike,
                panels: list[tuple[str, list[str]]], title: str = "", xlabel: str = "step") -> str | None:
    """One panel per ``(ylabel, metric keys)`` against ``step``, written atomically; returns the PNG path,
    or None (with a log line) when matplotlib is missing or no panel has a point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: skipping the plot %s (pip install matplotlib)", out_png)
        return None
    panels = [(label, keys) for label, keys in panels
              if any(r.get(k) is not None for r in records for k in keys)]
    if not panels:
        logger.info("no metric of the plot's panels was logged: skipping %s", out_png)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (label, keys) in zip(axes[0], panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 15 else None, markersize=3, label=key)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(out_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return str(path)

"""MetricsLogger (JSON lines), read_jsonl, write_summary and setup_logging."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import stat
import sys
import types

import numpy as np
import pytest
import torch
from multiengine.engines.metrics import MetricsLogger, read_jsonl, setup_logging, to_plain, write_summary

_find_spec = importlib.util.find_spec


def test_log_writes_one_json_line_per_call(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    with MetricsLogger(str(path), enabled=True) as metrics:
        metrics.log(1, {"loss": torch.tensor(0.5), "lr": 1e-3}, prefix="train")
        metrics.log(2, {"reward": np.float32(1.25), "kl": torch.tensor([0.125]), "tokens": 7, "ok": True})
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {"step": 1, "train/loss": 0.5, "train/lr": 1e-3}
    assert isinstance(first["train/loss"], float)
    assert second == {"step": 2, "reward": 1.25, "kl": 0.125, "tokens": 7, "ok": 1}
    assert read_jsonl(path) == [first, second]


def test_disabled_logger_writes_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsLogger(str(path), enabled=False, tensorboard_dir=str(tmp_path / "tb"))
    metrics.log(1, {"loss": 1.0})
    metrics.close()
    assert not path.exists() and not (tmp_path / "tb").exists()


def test_lines_are_flushed_and_a_resumed_run_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = MetricsLogger(str(path), enabled=True)
    first.log(1, {"loss": 2.0})
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}]  # visible before close: a crash keeps it
    first.close()
    with MetricsLogger(str(path), enabled=True) as second:
        second.log(2, {"loss": 1.0})
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_non_scalar_metric_is_rejected(tmp_path):
    with MetricsLogger(str(tmp_path / "m.jsonl"), enabled=True) as metrics:
        with pytest.raises(TypeError, match="loss"):
            metrics.log(1, {"loss": torch.ones(3)})
        with pytest.raises(TypeError, match="name"):
            metrics.log(1, {"name": "x"})


def test_read_jsonl_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 1.0}]
    path.write_text('{"step": 1, "lo\n{"step": 2}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_tensorboard_is_optional(tmp_path):
    tb = tmp_path / "tb"
    with MetricsLogger(str(tmp_path / "m.jsonl"), enabled=True, tensorboard_dir=str(tb)) as metrics:
        metrics.log(1, {"loss": 1.0, "bad": float("nan")}, prefix="train")
    assert read_jsonl(tmp_path / "m.jsonl")[0]["train/loss"] == 1.0
    try:
        import torch.utils.tensorboard  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed: the JSONL alone is the record
        assert not tb.exists()
    else:
        assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


def test_write_summary_is_atomic_and_plain(tmp_path):
    path = tmp_path / "run" / "summary.json"
    summary = {"loss": torch.tensor(0.25), "per_rank": torch.tensor([1, 2]), "mean": np.float64(1.5),
               "shape": (2, 3), "arr": np.arange(2), "path": tmp_path, "nested": {"ok": True, "n": None}}
    write_summary(path, summary)
    loaded = json.loads(path.read_text())
    assert loaded == {"loss": 0.25, "per_rank": [1, 2], "mean": 1.5, "shape": [2, 3], "arr": [0, 1],
                      "path": str(tmp_path), "nested": {"ok": True, "n": None}}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    write_summary(path, {"loss": 0.1})  # replaces, leaves no temporary files behind
    assert json.loads(path.read_text()) == {"loss": 0.1}
    assert os.listdir(path.parent) == ["summary.json"]
    with pytest.raises(TypeError):
        write_summary(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"loss": 0.1}  # a failed write keeps the old file
    assert os.listdir(path.parent) == ["summary.json"]
    assert to_plain({"t": torch.tensor(True)}) == {"t": True}


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_root_logging")
def test_setup_logging_levels_and_no_duplicate_handlers():
    stream = io.StringIO()
    setup_logging(0, stream=stream)
    setup_logging(0, stream=stream)  # a second call replaces its handler instead of adding one
    log = logging.getLogger("multiengine.test")
    log.info("hello")
    assert stream.getvalue().count("hello") == 1
    assert "[rank 0] INFO multiengine.test: hello" in stream.getvalue()

    stream = io.StringIO()
    setup_logging(1, stream=stream)
    log.info("quiet")
    log.warning("loud")
    assert "quiet" not in stream.getvalue() and "[rank 1] WARNING" in stream.getvalue()


def _tb_images(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"images": 0})
    acc.Reload()
    return {tag: acc.Images(tag) for tag in acc.Tags()["images"]}


def test_log_image_writes_a_tensorboard_image(tmp_path):
    from PIL import Image

    tb = tmp_path / "tb"
    picture = Image.new("RGB", (6, 4), (250, 10, 20))
    picture.save(tmp_path / "grid.png")
    gray = np.full((5, 3), 7, dtype=np.uint8)
    with MetricsLogger(str(tmp_path / "m.jsonl"), enabled=True, tensorboard_dir=str(tb)) as metrics:
        metrics.log_image(0, "validation/grid", tmp_path / "grid.png")  # a path ...
        metrics.log_image(3, "validation/grid", picture)  # ... a PIL image ...
        metrics.log_image(3, "gray", gray)  # ... an HxW array
        with pytest.raises(ValueError, match="shape"):
            metrics.log_image(3, "bad", np.zeros((2, 3, 5), dtype=np.uint8))
    images = _tb_images(tb)
    assert sorted(images) == ["gray", "validation/grid"]
    assert [e.step for e in images["validation/grid"]] == [0, 3]
    for event in images["validation/grid"]:
        assert (event.width, event.height) == (6, 4)
        decoded = Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB")
        assert decoded.getpixel((2, 2)) == (250, 10, 20)
    assert (images["gray"][0].width, images["gray"][0].height) == (3, 5)
    assert read_jsonl(tmp_path / "m.jsonl") == []  # images go to TensorBoard only, not to the JSONL


def test_log_image_is_a_no_op_when_disabled_or_without_tensorboard(tmp_path):
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    off = MetricsLogger(str(tmp_path / "a.jsonl"), enabled=False, tensorboard_dir=str(tmp_path / "tb_a"))
    off.log_image(1, "x", image)
    off.close()
    assert not (tmp_path / "tb_a").exists()
    with MetricsLogger(str(tmp_path / "b.jsonl"), enabled=True) as plain:  # tensorboard=false
        plain.log_image(1, "x", image)
        plain.log_image(1, "x", tmp_path / "missing.png")  # not even opened
    assert read_jsonl(tmp_path / "b.jsonl") == []


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without wandb looks like
    with pytest.raises(ImportError, match=r"report_to=wandb: wandb is not installed.*pip install wandb, or set "
                                          r"report_to=none"):
        MetricsLogger(str(tmp_path / "m.jsonl"), enabled=True, wandb={"project": "p"})
    off = MetricsLogger(str(tmp_path / "n.jsonl"), enabled=False, wandb={"project": "p"})  # other ranks: no import
    off.close()


def test_wandb_mirrors_scalars_and_images(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    fake.Image = lambda array: ("Image", array.shape)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with MetricsLogger(str(tmp_path / "m.jsonl"), enabled=True, wandb={"project": "p", "dir": "d"}) as metrics:
        metrics.log(2, {"loss": 0.5, "bad": float("inf")}, prefix="train")
        metrics.log_image(2, "validation/grid", np.zeros((4, 6, 3), dtype=np.uint8))
    assert calls == [("init", {"project": "p", "dir": "d"}), ("log", {"train/loss": 0.5}, 2),
                     ("log", {"validation/grid": ("Image", (4, 6, 3))}, 2), ("finish",)]


def test_report_to_wandb_without_wandb_fails_before_any_rank_starts(monkeypatch):
    from multiengine.engines.settings import SettingsError
    from multiengine.recipes.language.config import checked_config

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else _find_spec(name, *a))
    with pytest.raises(SettingsError) as info:
        checked_config("registry_demo", "tiny", ["report_to=wandb"])
    text = str(info.value)
    assert "config key 'report_to'" in text and "wandb is not installed" in text
    assert "pip install wandb, or set report_to=none" in text
    assert checked_config("registry_demo", "tiny", ["report_to=none"]).report_to == "none"
    with pytest.raises(SettingsError, match="report_to"):
        checked_config("registry_demo", "tiny", ["report_to=mlflow"])

"""How a checkpoint is committed (one process, torch backend): every file and folder is fsynced
before the rename that makes it visible, and re-saving the tag `latest` names never leaves
`latest` without a complete checkpoint behind it."""

from __future__ import annotations

import os

import pytest
import torch
from multiengine.engines import EngineRegistry, RoleSpec, train_ds_config
from multiengine.engines import checkpoint as ckpt


@pytest.fixture(scope="module")
def registry():
    reg = EngineRegistry(backend="torch")
    torch.manual_seed(0)
    reg.add(RoleSpec("actor", lambda: torch.nn.Linear(4, 1), train_ds_config(stage=0, dtype="fp32", micro_batch_size=2),
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    return reg.build()


def _step(registry):
    actor = registry["actor"]
    actor.backward(actor(torch.randn(2, 4)).pow(2).mean())
    actor.step()


def test_files_are_fsynced_before_the_rename(registry, tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync, real_open = os.fsync, os.open
    fd_paths: dict[int, str] = {}

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        fd_paths[fd] = os.path.realpath(path)
        return fd

    def tracking_fsync(fd):
        synced.append(fd_paths.get(fd, f"fd:{fd}"))
        return real_fsync(fd)

    renamed: list[tuple[str, list[str]]] = []
    real_replace = os.replace

    def tracking_replace(src, dst):
        if os.path.isdir(src):  # the commit: what had been fsynced by then
            renamed.append((os.path.realpath(src), list(synced)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "fsync", tracking_fsync)
    monkeypatch.setattr(os, "replace", tracking_replace)
    _step(registry)
    path = registry.save_checkpoint(str(tmp_path), client_state={"step": 1})
    assert len(renamed) == 1
    tmp, synced_before = renamed[0]
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    assert len(files) >= 6  # manifest, client state and rng (json + safetensors), the engine's two files
    for f in files:
        assert os.path.join(tmp, os.path.relpath(f, path)) in synced_before, f"{f} not fsynced before the rename"
    assert tmp in synced_before  # the folder itself (its entries)


def test_resaving_the_latest_tag(registry, tmp_path, monkeypatch):
    _step(registry)
    registry.save_checkpoint(str(tmp_path), client_state={"step": 1}, tag="same")
    seen: list[str] = []
    real_point = ckpt._point_latest

    def watch(save_dir, name):
        # At every change of `latest`, what it names is a complete checkpoint.
        real_point(save_dir, name)
        assert os.path.isfile(os.path.join(save_dir, name, "manifest.json"))
        seen.append(name)

    real_remove = ckpt._remove_tree

    def remove(path):
        real_remove(path)
        named = ckpt.latest_tag(str(tmp_path))
        assert named is None or os.path.isfile(os.path.join(tmp_path, named, "manifest.json")), (path, named)

    monkeypatch.setattr(ckpt, "_point_latest", watch)
    monkeypatch.setattr(ckpt, "_remove_tree", remove)
    _step(registry)
    registry.save_checkpoint(str(tmp_path), client_state={"step": 2}, tag="same")
    assert seen == [".old-same", "same"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "same"]
    assert registry.load_checkpoint(str(tmp_path)) == {"step": 2}
    # A folder of that name that `latest` does not name is simply replaced (no aside copy needed).
    registry.save_checkpoint(str(tmp_path), client_state={"step": 3}, tag="other")
    seen.clear()
    registry.save_checkpoint(str(tmp_path), client_state={"step": 4}, tag="same")
    assert seen == ["same"]
    assert registry.load_checkpoint(str(tmp_path)) == {"step": 4}

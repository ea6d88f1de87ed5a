"""Stale JIT build locks: a lock no process holds is removed (with a log line); a held or brand-new
one is left alone. Always on a temporary extensions folder, never the machine's cache."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from multiengine.engines import jit_locks


def _plant(root, name="deepspeed_shm_comm", age_s=60.0):
    folder = root / name
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.write_text("")
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock


def test_stale_lock_is_removed_with_a_log_line(tmp_path, caplog):
    stale = _plant(tmp_path)
    (tmp_path / "cpu_adam").mkdir()  # a finished build: no lock, nothing to do
    with caplog.at_level(logging.WARNING, logger="multiengine.engines.jit_locks"):
        removed = jit_locks.remove_stale_locks([str(tmp_path)])
    assert removed == [str(stale)] and not stale.exists()
    assert "removed a stale JIT build lock" in caplog.text and str(stale) in caplog.text
    assert jit_locks.remove_stale_locks([str(tmp_path)]) == []


def test_lock_held_by_a_live_builder_is_kept(tmp_path):
    lock = _plant(tmp_path)
    # A builder keeps its lock file open until it is done (torch's FileBaton).
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); import time; time.sleep(60)"])
    try:
        for _ in range(100):  # until the child has the file open
            if str(lock) in (jit_locks._open_paths() or set()):
                break
            time.sleep(0.1)
        assert jit_locks.remove_stale_locks([str(tmp_path)]) == []
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert jit_locks.remove_stale_locks([str(tmp_path)]) == [str(lock)]  # its holder is gone now


def test_a_lock_created_a_moment_ago_is_kept(tmp_path):
    lock = _plant(tmp_path, age_s=0.0)
    assert jit_locks.remove_stale_locks([str(tmp_path)]) == []
    assert lock.exists()


def test_extension_roots_follow_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "exts"))
    assert jit_locks.extension_roots() == [str(tmp_path / "exts")]
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "torch_extensions" / "py311_cpu").mkdir(parents=True)
    assert jit_locks.extension_roots() == [str(tmp_path / "cache" / "torch_extensions" / "py311_cpu")]
    # Where torch itself builds (checked against its own helper).
    from torch.utils.cpp_extension import get_default_build_root

    assert os.path.realpath(get_default_build_root()) == os.path.realpath(tmp_path / "cache" / "torch_extensions")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_open_paths_sees_our_own_files(tmp_path):
    path = tmp_path / "held"
    with open(path, "w"):
        assert str(path) in jit_locks._open_paths()

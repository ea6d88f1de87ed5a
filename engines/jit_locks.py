"""Stale locks left by a killed just-in-time op build.

DeepSpeed builds some ops on first use (on CPU: its shared-memory communication op, CPU Adam)
with torch.utils.cpp_extension, which guards each build folder with a `lock` file: the builder
creates it and keeps it open until it is done; everyone else polls until it disappears. A build
killed half way leaves the file behind, and every later start on the machine then waits on it,
silently, for ever. A lock that no live process has open is such a leftover: remove it.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import time

logger = logging.getLogger(__name__)


def extension_roots() -> list[str]:
    """Where torch's JIT builds go: $TORCH_EXTENSIONS_DIR/<name>/, else
    <cache>/torch_extensions/<py..._cpu|cu...>/<name>/ (every such subfolder is checked)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return [root]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    base = os.path.join(cache, "torch_extensions")
    return sorted(glob.glob(os.path.join(base, "py*")))


def _open_paths() -> set[str] | None:
    """Paths that some process has open (from /proc); None where /proc cannot tell."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc/self/fd"):
        return None
    held: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                held.add(os.readlink(os.path.join(fd_dir, fd)))
            except OSError:
                continue
    return held


def stale_locks(roots: list[str] | None = None, min_age_s: float = 2.0) -> list[str]:
    """Lock files under the extension roots that no process has open (and older than min_age_s,
    so a lock created a moment ago by a builder we could not see is left alone)."""
    roots = extension_roots() if roots is None else roots
    locks = [p for root in roots for p in glob.glob(os.path.join(root, "*", "lock"))]
    if not locks:
        return []
    held = _open_paths()
    if held is None:
        return []
    now = time.time()
    out = []
    for lock in locks:
        real = os.path.realpath(lock)
        try:
            age = now - os.stat(lock).st_mtime
        except OSError:
            continue
        if real not in held and age >= min_age_s:
            out.append(lock)
    return out


def remove_stale_locks(roots: list[str] | None = None, min_age_s: float = 2.0) -> list[str]:
    """Remove the stale locks (each re-checked just before removal); returns the ones removed."""
    removed = []
    for lock in stale_locks(roots, min_age_s):
        if lock not in stale_locks([os.path.dirname(os.path.dirname(lock))], min_age_s):
            continue  # a builder took it in the meantime
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        removed.append(lock)
        logger.warning("removed a stale JIT build lock %s: no process holds it (a build of this op was killed "
                       "part way); the op is rebuilt on first use", lock)
    return removed


__all__ = ["extension_roots", "remove_stale_locks", "stale_locks"]

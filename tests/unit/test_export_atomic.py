"""Exports under a kill: a process killed at any point of an export leaves the target folder either the
complete old export or the complete new one, never partial, and never missing once the next export (or
recover_dir) has run. Each writer is a separate Python process that dies by os._exit or SIGKILL, as in a
real crash: no ``finally`` or ``except`` of the exporter runs. (Not a fork of pytest: a fork of a process
with many threads can inherit a lock held by one of them and hang.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from multiengine.engines import export

FILES = 12  # an export is complete when all of them are there, each naming the same version


# The writer, run in a child process: `python -c CHILD <scenario> <out> [version]`.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from multiengine.engines import export

    FILES = %d

    def write(folder, version, stop_after=None):
        os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
        for i in range(FILES):
            if stop_after is not None and i == stop_after:
                os._exit(9)  # killed half-way through the writes
            name = os.path.join(folder, "sub" if i %% 3 == 0 else "", f"part{i}.bin")
            with open(name, "w") as f:
                f.write(f"{version}:{i}:" + "x" * 4096)

    def run_export(out, version, stop_after=None):
        with export.atomic_dir(out) as tmp:
            write(tmp, version, stop_after)

    scenario, out = sys.argv[1], sys.argv[2]
    if scenario == "export":
        run_export(out, sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
    elif scenario == "die_before_cleanup":
        export._remove = lambda path: os._exit(9)  # the swap done, the old copy not yet deleted
        run_export(out, "new")
    elif scenario == "die_between_renames":
        export._exchange = lambda a, b: False  # a file system without renameat2's exchange
        real_replace = os.replace

        def replace_then_die(src, dst):
            real_replace(src, dst)
            os._exit(9)  # the old folder is aside, the new one not yet in place

        os.replace = replace_then_die
        run_export(out, "new")
    elif scenario in ("loop_exchange", "loop_two_renames"):
        if scenario == "loop_two_renames":
            export._exchange = lambda a, b: False
        trial, n = sys.argv[3], 0
        while True:
            start = time.monotonic()
            n += 1
            run_export(out, f"{trial}n{n}")
            print(f"{time.monotonic() - start:.6f}", flush=True)  # one export done, its duration
    """ % FILES  # noqa: UP031 (the child source is full of f-strings)
)


def _child(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *map(str, args)], **kwargs)


def _in_child(*args: str) -> int:
    """Run a writer scenario in a child process; return its exit code."""
    return _child(*args).wait(timeout=120)


def _export(out: Path, version: str) -> None:
    """An export in this process (nothing is killed here)."""
    with export.atomic_dir(str(out)) as tmp:
        os.makedirs(os.path.join(tmp, "sub"), exist_ok=True)
        for i in range(FILES):
            with open(os.path.join(tmp, "sub" if i % 3 == 0 else "", f"part{i}.bin"), "w") as f:
                f.write(f"{version}:{i}:" + "x" * 4096)


def _version(out: Path) -> str:
    """The version of a complete export at ``out``; fails on a missing, partial or mixed folder."""
    assert out.is_dir(), f"{out} is missing"
    files = sorted(p for p in out.rglob("part*.bin"))
    assert len(files) == FILES, f"{out} is partial: {len(files)} of {FILES} files"
    versions = {p.read_text().split(":")[0] for p in files}
    assert len(versions) == 1, f"{out} mixes exports {versions}"
    return versions.pop()


def _exchange_supported(tmp_path: Path) -> bool:
    a, b = tmp_path / "swap_a", tmp_path / "swap_b"
    a.mkdir()
    b.mkdir()
    (a / "mark").write_text("a")
    ok = export._exchange(str(a), str(b))
    if ok:
        assert (b / "mark").read_text() == "a" and not (a / "mark").exists()
    for p in (a, b):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    return ok


def test_kill_mid_write_keeps_the_old_export_and_the_next_export_succeeds(tmp_path):
    out = tmp_path / "export" / "actor"
    _export(out, "old")
    assert _in_child("export", out, "new", FILES // 2) == 9
    assert _version(out) == "old"
    assert Path(f"{out}.tmp").is_dir()  # the partial one, never promoted
    _export(out, "new")
    assert _version(out) == "new"
    assert not Path(f"{out}.tmp").exists() and not Path(f"{out}.old").exists()


def test_kill_after_the_swap_leaves_the_complete_new_export(tmp_path):
    if not _exchange_supported(tmp_path):
        pytest.skip("this file system has no atomic exchange (renameat2 RENAME_EXCHANGE)")
    out = tmp_path / "actor"
    _export(out, "old")
    assert _in_child("die_before_cleanup", out) == 9
    assert _version(out) == "new"
    assert _version(Path(f"{out}.tmp")) == "old"  # what the swap moved out; the next export clears it
    _export(out, "newer")
    assert _version(out) == "newer" and not Path(f"{out}.tmp").exists()


def test_kill_between_the_two_renames_without_exchange_restores_the_old_export(tmp_path):
    out = tmp_path / "actor"
    _export(out, "old")
    assert _in_child("die_between_renames", out) == 9
    assert not out.exists() and _version(Path(f"{out}.old")) == "old"  # the window the fallback has
    export.recover_dir(str(out))  # what the next export does first
    assert _version(out) == "old" and not Path(f"{out}.old").exists()
    # a stale aside beside a present export is removed, never swapped in
    Path(f"{out}.old").mkdir()
    _export(out, "new")
    assert _version(out) == "new" and not Path(f"{out}.old").exists()


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_sigkill_at_any_moment_of_repeated_exports(tmp_path, exchange):
    """A child re-exports the same folder in a loop and is SIGKILLed at a different moment of an export in
    each trial; after each kill (and recover_dir, which the next export runs first) the folder is one
    complete export. With the exchange the folder is also never missing while the child runs."""
    if exchange and not _exchange_supported(tmp_path):
        pytest.skip("this file system has no atomic exchange (renameat2 RENAME_EXCHANGE)")
    out = tmp_path / "actor"
    _export(out, "v0")
    seen: list[str] = []
    for trial, fraction in enumerate((0.0, 0.2, 0.45, 0.7, 0.9)):
        child = _child("loop_exchange" if exchange else "loop_two_renames", out, f"t{trial}",
                       stdout=subprocess.PIPE, text=True)
        took = float(child.stdout.readline())  # the child has finished one export and started the next
        missing = 0
        end = time.monotonic() + fraction * took  # kill that far into the next export
        while time.monotonic() < end:
            missing += not os.path.isdir(out)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        if exchange:
            assert missing == 0, f"trial {trial}: {out} was missing {missing} times during the exports"
        export.recover_dir(str(out))
        seen.append(_version(out))
    assert all(v.startswith(f"t{i}") for i, v in enumerate(seen)), seen  # every trial's exports did land

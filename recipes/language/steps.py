"""Running another recipe in-process as a step of this one, reused while its fingerprint (hash of its resolved
config and identity of every local input outside its output_dir) is unchanged (rlhf_e2e, and SFT actors first)."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from multiengine.engines.metrics import write_summary

from .config import checked_config, flatten, load_recipe

logger = logging.getLogger(__name__)

__all__ = ["FINGERPRINT_FILE", "path_identity", "reuse_reason", "run_step", "step_fingerprint"]

FINGERPRINT_FILE = "fingerprint.json"
_SMALL_FILE = 1 << 20  # files up to 1 MiB are identified by content, larger ones by size and mtime
_MAX_FILES = 5000  # per input folder


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _file_identity(path: str) -> str:
    st = os.stat(path)
    if st.st_size <= _SMALL_FILE:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    return f"size:{st.st_size}:mtime_ns:{st.st_mtime_ns}"


def path_identity(path: str) -> dict[str, str]:
    """``{relative file: identity}`` of a file or of every file under a folder (hidden ones and lock files
    skipped; at most 5000)."""
    if os.path.isfile(path):
        return {".": _file_identity(path)}
    out: dict[str, str] = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith(".lock"):
                continue
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = _file_identity(full)
            if len(out) >= _MAX_FILES:
                return out
    return out


def step_fingerprint(recipe: str, resolved: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """What a step's result depends on: its resolved config (hashed) and the identity of every existing
    local path its config names, except its own output_dir and what lies under it."""
    text = json.dumps(resolved, sort_keys=True, default=str)
    own = os.path.abspath(out_dir)
    cwd = os.path.abspath(os.getcwd())
    inputs: dict[str, dict[str, str]] = {}
    for value in sorted(set(_strings(resolved))):
        if not value or not os.path.exists(value):
            continue
        full = os.path.abspath(value)
        if full == own or full.startswith(own + os.sep) or cwd == full or cwd.startswith(full + os.sep):
            continue  # the step's own outputs, or a folder holding the working directory (".", "/")
        inputs[value] = path_identity(full)
    return {"recipe": recipe, "config_sha256": hashlib.sha256(text.encode()).hexdigest(), "config": resolved,
            "inputs": inputs}


def reuse_reason(out_dir: str, fingerprint: dict[str, Any], rerun: bool) -> tuple[bool, str]:
    """``(reuse, why)`` for a step whose fingerprint would be ``fingerprint``."""
    if rerun:
        return False, "rerun=true"
    if not os.path.isfile(os.path.join(out_dir, "summary.json")):
        return False, "no finished run to reuse"
    path = os.path.join(out_dir, FINGERPRINT_FILE)
    if not os.path.isfile(path):
        return False, f"summary.json has no {FINGERPRINT_FILE} beside it (an older or interrupted run)"
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    changes = []
    if old.get("config_sha256") != fingerprint["config_sha256"]:
        before, after = flatten(old.get("config", {})), flatten(fingerprint["config"])
        keys = sorted(k for k in set(before) | set(after) if before.get(k, "<unset>") != after.get(k, "<unset>"))
        shown = ", ".join(f"{k} ({before.get(k, '<unset>')!r} -> {after.get(k, '<unset>')!r})" for k in keys[:4])
        changes.append(f"config changed: {shown}{' ...' if len(keys) > 4 else ''}")
    old_inputs, new_inputs = old.get("inputs", {}), fingerprint["inputs"]
    for name in sorted(set(old_inputs) | set(new_inputs)):
        a, b = old_inputs.get(name), new_inputs.get(name)
        if a != b:
            files = sorted(k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k))
            changes.append(f"input {name} changed ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''})")
    if changes:
        return False, "; ".join(changes)
    return True, "config and inputs unchanged since it ran"


def _on_every_rank(value: Any) -> Any:
    """Rank 0's value on every rank: one decision, so no rank runs a step the others skip (a hang)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def run_step(recipe: str, config: str, overrides: list[str], out_dir: str, rerun: bool,
             decisions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run ``recipe`` with ``config`` and ``overrides`` under ``out_dir`` on this process group, or reuse the
    finished run (:func:`reuse_reason`); returns its summary.json and records the decision in ``decisions``."""
    # CHECKS and validate(cfg): the step's inputs (earlier steps' exports) exist by now
    cfg = checked_config(recipe, config or None, [*overrides, f"output_dir={out_dir}"])
    fingerprint = step_fingerprint(recipe, cfg.to_dict(), out_dir)
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    reuse, why = _on_every_rank(reuse_reason(out_dir, fingerprint, rerun) if is_main else None)
    summary_path = os.path.join(out_dir, "summary.json")
    decisions[recipe] = {"reused": reuse, "why": why}
    if reuse:
        logger.info("%s: reusing %s (%s)", recipe, out_dir, why)
        with open(summary_path) as f:
            return json.load(f)
    logger.info("=== %s (config %s) -> %s: running (%s)", recipe, config or "defaults", out_dir, why)
    if is_main and os.path.isfile(os.path.join(out_dir, FINGERPRINT_FILE)):
        os.remove(os.path.join(out_dir, FINGERPRINT_FILE))  # an interrupted rerun must not look finished
    load_recipe(recipe).main(cfg)
    # Engines of the finished step are garbage now; free them before the next step builds its own.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if is_main:
        write_summary(os.path.join(out_dir, FINGERPRINT_FILE), fingerprint)
    with open(summary_path) as f:
        return json.load(f)

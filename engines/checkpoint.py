"""Checkpoints of a registry: ``save_dir/latest`` names the newest complete ``step_<n>/`` folder (manifest.json,
client_state/, rng/, each trainable role's DeepSpeed state, stateful frozen roles' partitions); saves in progress
are ``.tmp-<tag>``. Frozen roles are rebuilt from their source. Nothing is unpickled without an allow-list
(safe_io.py). See docs/reliability.md."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .dist import barrier
from .partition import local_tensors, refresh_full_copies
from .safe_io import CheckpointError, deepspeed_loads_refusing_pickles, fsync_path, fsync_tree, load_tree, save_tree
from .safe_io import UnsafeCheckpointError as UnsafeCheckpointError  # re-exported

if TYPE_CHECKING:
    from .registry import EngineRegistry

logger = logging.getLogger(__name__)

# 2: client state, RNG and EMA partitions as JSON + safetensors (1 pickled them: not read any more).
FORMAT_VERSION = 2
_TAG_PREFIX = "step_"
_ASIDE_PREFIX = ".old-"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for name in ("deepspeed", "transformers", "diffusers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            pass
    try:
        from importlib.metadata import version

        out["multiengine"] = version("multiengine")
    except Exception:
        pass
    return out


def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # no data copied: the old files just get a second name
    except OSError:
        shutil.copy2(src, dst)


def _remove_tree(path: str) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path)


def _point_latest(save_dir: str, name: str) -> None:
    _fsync_write(os.path.join(save_dir, "latest.tmp"), name)
    os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
    fsync_path(save_dir)


def _commit(save_dir: str, tmp: str, tag: str) -> None:
    """Rank 0: make the finished save visible. Re-saving the tag `latest` names goes through a hard-linked
    .old-<tag> copy, so `latest` always names a complete checkpoint."""
    final = os.path.join(save_dir, tag)
    fsync_tree(tmp)
    aside = None
    if os.path.exists(final):
        if latest_tag(save_dir) == tag:
            aside = os.path.join(save_dir, _ASIDE_PREFIX + tag)
            _remove_tree(aside)  # a leftover of an earlier crash, not what `latest` names
            shutil.copytree(final, aside, copy_function=_link_or_copy)
            fsync_tree(aside)
            _point_latest(save_dir, _ASIDE_PREFIX + tag)
        _remove_tree(final)
    os.replace(tmp, final)
    fsync_path(save_dir)
    _point_latest(save_dir, tag)
    for name in os.listdir(save_dir):  # this aside and any left by a crash in an earlier re-save
        if name.startswith(_ASIDE_PREFIX):
            _remove_tree(os.path.join(save_dir, name))


def list_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [d for d in os.listdir(save_dir)
            if not d.startswith(".") and os.path.isfile(os.path.join(save_dir, d, "manifest.json"))]
    return sorted(tags)


def latest_tag(save_dir: str) -> str | None:
    """The folder `latest` names (a tag, or .old-<tag> while that tag is being re-saved)."""
    path = os.path.join(save_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def save(registry: EngineRegistry, save_dir: str, client_state: dict[str, Any], tag: str | None = None,
         keep_last: int | None = None) -> str:
    trainable = registry.trainable_roles()
    step = int(client_state.get("step", max((int(r.engine.global_steps) for r in trainable), default=0)))
    tag = tag or f"{_TAG_PREFIX}{step:08d}"
    tmp = os.path.join(save_dir, f".tmp-{tag}")
    if registry.is_main:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # a leftover from a crashed save of the same tag
        os.makedirs(os.path.join(tmp, "client_state"))
        os.makedirs(os.path.join(tmp, "rng"))
    barrier()

    # Client state first: a value it cannot store fails here, on every rank, before any role is written.
    save_tree(client_state, os.path.join(tmp, "client_state", f"rank_{registry.rank}"), what="client state")
    save_tree(rng_state(), os.path.join(tmp, "rng", f"rank_{registry.rank}"), what="RNG state")
    for role in trainable:
        role.engine.save_checkpoint(os.path.join(tmp, role.name), tag="state")
    for role in registry.stateful_frozen_roles():
        if registry.is_main:
            os.makedirs(os.path.join(tmp, role.name), exist_ok=True)
        barrier()
        save_tree([t.detach().cpu() for t in local_tensors(role.module)],
                  os.path.join(tmp, role.name, f"rank_{registry.rank}"), what=f"role '{role.name}' partitions")
    barrier()
    if registry.is_main:
        manifest = {
            "format": FORMAT_VERSION,
            "tag": tag,
            "step": step,
            "world_size": registry.world_size,
            "backend": registry.backend,
            "roles": {r.name: {"stage": r.stage, "dtype": str(r.dtype).replace("torch.", "")} for r in trainable},
            "frozen_roles": [r.name for r in registry.roles() if not r.trainable],
            "stateful_roles": [r.name for r in registry.stateful_frozen_roles()],
            "versions": _versions(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        _fsync_write(os.path.join(tmp, "manifest.json"), json.dumps(manifest, indent=2))
        _commit(save_dir, tmp, tag)
        if keep_last:
            for old in list_checkpoints(save_dir)[:-keep_last]:
                if old != tag:
                    shutil.rmtree(os.path.join(save_dir, old), ignore_errors=True)
        logger.info("saved checkpoint %s", os.path.join(save_dir, tag))
    barrier()
    return os.path.join(save_dir, tag)


def read_manifest(path: str) -> dict[str, Any]:
    file = os.path.join(path, "manifest.json")
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); the checkpoint is corrupt or was replaced.") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file} is not a multiengine manifest.")
    return manifest


def load(registry: EngineRegistry, load_dir: str, tag: str | None = None) -> dict[str, Any]:
    if os.path.isfile(os.path.join(load_dir, "manifest.json")) and tag is None:
        path = load_dir
    else:
        tag = tag or latest_tag(load_dir)
        if tag is None:
            raise CheckpointError(f"no checkpoint in {load_dir!r}: it has no 'latest' file and no manifest.json.")
        path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise CheckpointError(f"{path!r} is not a complete checkpoint (no manifest.json).")
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r} has format {manifest.get('format')!r}; this multiengine reads "
                              f"format {FORMAT_VERSION}. Format 1 stored client state as a pickle, which can run code "
                              "when loaded, so it is no longer read: restart from the exported weights or resume from "
                              "a checkpoint written by this version.")
    ours = {r.name for r in registry.trainable_roles()}
    theirs = set(manifest["roles"])
    if ours != theirs:
        raise CheckpointError(f"checkpoint {path!r} holds trainable roles {sorted(theirs)}, but this registry trains "
                              f"{sorted(ours)}; build the same trainable roles to resume.")
    if manifest["world_size"] != registry.world_size:
        raise CheckpointError(f"checkpoint {path!r} was written by {manifest['world_size']} ranks, this run has "
                              f"{registry.world_size}; ZeRO partitions are per rank: resume with the same number of "
                              "ranks.")
    for role in registry.trainable_roles():
        if manifest["roles"][role.name]["stage"] != role.stage:
            raise CheckpointError(f"role '{role.name}' was saved at ZeRO stage {manifest['roles'][role.name]['stage']}"
                                  f" and is built at stage {role.stage}; build it at the saved stage to resume.")
        safe = deepspeed_loads_refusing_pickles if role.backend == "deepspeed" else lambda _: contextlib.nullcontext()
        with safe(role.engine):
            loaded, _ = role.engine.load_checkpoint(os.path.join(path, role.name), tag="state")
        if loaded is None:
            raise CheckpointError(f"role '{role.name}': DeepSpeed found no state under {path!r}.")
    stateful, saved_stateful = {r.name for r in registry.stateful_frozen_roles()}, manifest.get("stateful_roles", [])
    if stateful != set(saved_stateful):
        raise CheckpointError(f"checkpoint {path!r} holds stateful frozen roles {sorted(saved_stateful)}, but this "
                              f"registry has {sorted(stateful)}; build the same roles (e.g. the same EMA "
                              "setting) to resume.")
    for role in registry.stateful_frozen_roles():
        saved = load_tree(os.path.join(path, role.name, f"rank_{registry.rank}"))
        targets = local_tensors(role.module)
        if not isinstance(saved, list) or len(saved) != len(targets):
            raise CheckpointError(f"role '{role.name}': the checkpoint holds {len(saved)} partitions, the role has"
                                  f" {len(targets)}; build the same model to resume.")
        with torch.no_grad():
            for target, value in zip(targets, saved, strict=True):
                target.copy_(value.to(target.device, target.dtype))
        refresh_full_copies(role.module)
    client_state = load_tree(os.path.join(path, "client_state", f"rank_{registry.rank}"))
    set_rng_state(load_tree(os.path.join(path, "rng", f"rank_{registry.rank}")))
    barrier()
    return client_state

"""Checkpoints and exports for a registry.

Layout of a checkpoint directory:

    save_dir/
      latest                  text: the tag of the newest complete checkpoint (replaced atomically)
      step_00000010/
        manifest.json         roles, stages, world size, step, versions
        client_state/rank_0.pt  the caller's client state + this rank's RNG states
        actor/state/...       DeepSpeed's own checkpoint of each trainable role
        critic/state/...
        ema/rank_0.pt         a stateful frozen role (EMA): this rank's parameter partitions
      .tmp-step_00000020/     a save in progress: never pointed to by `latest`

Frozen roles are not saved: they are rebuilt from their source, except stateful ones (an EMA),
whose local partitions are saved per rank (an inference-only DeepSpeed engine has no checkpoint
engine of its own). Every rank takes part
(a ZeRO checkpoint is written by all ranks); rank 0 commits with two renames.
"""

from __future__ import annotations

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

if TYPE_CHECKING:
    from .registry import EngineRegistry

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_TAG_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that does not match the registry that tries to load it."""


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


def _commit(save_dir: str, tmp: str, tag: str) -> None:
    """Rank 0 only: make the finished save visible. Until `latest` is replaced, readers see the
    previous checkpoint; a crash anywhere before that leaves only a .tmp- folder behind."""
    final = os.path.join(save_dir, tag)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_write(os.path.join(save_dir, "latest.tmp"), tag)
    os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))


def list_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [d for d in os.listdir(save_dir)
            if not d.startswith(".") and os.path.isfile(os.path.join(save_dir, d, "manifest.json"))]
    return sorted(tags)


def latest_tag(save_dir: str) -> str | None:
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
    barrier()

    for role in trainable:
        role.engine.save_checkpoint(os.path.join(tmp, role.name), tag="state")
    for role in registry.stateful_frozen_roles():
        if registry.is_main:
            os.makedirs(os.path.join(tmp, role.name), exist_ok=True)
        barrier()
        torch.save([t.detach().cpu() for t in local_tensors(role.module)],
                   os.path.join(tmp, role.name, f"rank_{registry.rank}.pt"))
    torch.save({"client_state": client_state, "rng": rng_state()},
               os.path.join(tmp, "client_state", f"rank_{registry.rank}.pt"))
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
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


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
    ours = {r.name for r in registry.trainable_roles()}
    theirs = set(manifest["roles"])
    if ours != theirs:
        raise CheckpointError(
            f"checkpoint {path!r} holds trainable roles {sorted(theirs)}, but this registry trains {sorted(ours)};"
            " build the same trainable roles to resume."
        )
    if manifest["world_size"] != registry.world_size:
        raise CheckpointError(
            f"checkpoint {path!r} was written by {manifest['world_size']} ranks, this run has {registry.world_size};"
            " ZeRO partitions are per rank: resume with the same number of ranks."
        )
    for role in registry.trainable_roles():
        if manifest["roles"][role.name]["stage"] != role.stage:
            raise CheckpointError(
                f"role '{role.name}' was saved at ZeRO stage {manifest['roles'][role.name]['stage']} and is built at"
                f" stage {role.stage}; build it at the saved stage to resume."
            )
        loaded, _ = role.engine.load_checkpoint(os.path.join(path, role.name), tag="state")
        if loaded is None:
            raise CheckpointError(f"role '{role.name}': DeepSpeed found no state under {path!r}.")
    stateful = {r.name for r in registry.stateful_frozen_roles()}
    if stateful != set(manifest.get("stateful_roles", [])):
        raise CheckpointError(
            f"checkpoint {path!r} holds stateful frozen roles {sorted(manifest.get('stateful_roles', []))}, but this"
            f" registry has {sorted(stateful)}; build the same roles (e.g. the same EMA setting) to resume."
        )
    for role in registry.stateful_frozen_roles():
        saved = torch.load(os.path.join(path, role.name, f"rank_{registry.rank}.pt"), weights_only=True)
        with torch.no_grad():
            for target, value in zip(local_tensors(role.module), saved, strict=True):
                target.copy_(value.to(target.device, target.dtype))
        refresh_full_copies(role.module)
    state = torch.load(os.path.join(path, "client_state", f"rank_{registry.rank}.pt"), weights_only=False)
    set_rng_state(state["rng"])
    barrier()
    return state["client_state"]

"""Checkpoints under attack and under a kill, on 2 ranks with DeepSpeed.

argv: out_dir mode ckpt_dir
  prepare: actor (ZeRO-3, fp32), critic (ZeRO-2, bf16), ema (stateful frozen ZeRO-3): train 2 steps, save.
  poison:  for every kind of file the loader reads, load a copy of that checkpoint whose file(s) of that
           kind (every rank's) carry a malicious pickle; record each refusal; then load the clean copy.
  resave:  save tag 'same' (step 1), re-save it (step 2), then re-save it again (step 3) dying in the
           window after the old folder is removed and before the new one is renamed in.
  verify:  load what resave left (step 2's state), then save a new tag (which clears the leftovers).
"""

import json
import os
import pickle
import re
import shutil
import sys

import torch
from common import MLP, dump, finish, full_params, seeded
from multiengine.engines import CheckpointError, EngineRegistry, RoleSpec, ema_update, eval_ds_config, train_ds_config
from multiengine.engines import checkpoint as ckpt_module
from multiengine.engines.dist import barrier

mode, ckpt_dir = sys.argv[2], sys.argv[3]
out = sys.argv[1]


class Evil:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def build():
    registry = EngineRegistry(backend="deepspeed")
    registry.add(RoleSpec("actor", seeded(MLP, 1), train_ds_config(stage=3, dtype="fp32", micro_batch_size=4),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                          lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))))
    registry.add(RoleSpec("critic", seeded(MLP, 2), train_ds_config(stage=2, dtype="bf16", micro_batch_size=4),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
    registry.add(RoleSpec("ema", seeded(MLP, 1), eval_ds_config(stage=3, dtype="fp32"), stateful=True))
    return registry.build()


def train(registry, steps):
    for _ in range(steps):
        x = torch.randn(4, 64)
        for name in ("actor", "critic"):
            engine = registry[name]
            loss = engine(x.to(next(engine.module.parameters()).dtype)).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
        ema_update(registry["ema"].module, registry["actor"].module, decay=0.5)


def fingerprint(registry):
    return {n: [p.sum().item() for p in full_params(registry, n)] for n in ("actor", "critic", "ema")}


def kinds(root):
    """Files the loader reads, grouped by kind: every rank's copy of a per-rank file is one kind."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if name.endswith(".py") or (name == "latest" and rel != "latest"):
                continue  # DeepSpeed's zero_to_fp32.py and its own 'latest' (we pass the tag): never read
            out.setdefault(re.sub(r"(?<!mp_)rank_\d+", "rank_{r}", rel), []).append(rel)
    return dict(sorted(out.items()))


def poison(path, marker):
    if path.endswith(".pt"):
        state = torch.load(path, weights_only=False)  # our own file, written a moment ago
        state["extra"] = Evil(marker)
        torch.save(state, path)
    else:  # JSON / safetensors: replaced by a pickle, as an attacker would
        with open(path, "wb") as f:
            pickle.dump({"extra": Evil(marker)}, f)


result = {"mode": mode}
registry = build()
if mode == "prepare":
    train(registry, 2)
    registry.save_checkpoint(ckpt_dir, client_state={"step": 2, "note": "clean"})
    result["params"] = fingerprint(registry)
elif mode == "poison":
    tag = ckpt_module.latest_tag(ckpt_dir)
    clean = os.path.join(ckpt_dir, tag)
    groups = kinds(clean)
    result["kinds"] = list(groups)
    result["refused"] = {}
    for i, (kind, files) in enumerate(groups.items()):
        work = os.path.join(out, "poisoned", str(i))
        marker = os.path.join(out, "markers", f"{i}")
        if registry.is_main:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            shutil.copytree(clean, work)
            for rel in files:
                poison(os.path.join(work, rel), marker)
        barrier()
        try:
            registry.load_checkpoint(work)
            result["refused"][kind] = None
        except CheckpointError as exc:
            result["refused"][kind] = {"type": type(exc).__name__, "message": str(exc)}
        barrier()
    # A checkpoint of the old format with a pickled client state: refused before anything is read.
    old = os.path.join(out, "old_format")
    old_marker = os.path.join(out, "markers", "old_format")
    if registry.is_main:
        shutil.copytree(clean, old)
        with open(os.path.join(old, "manifest.json")) as f:
            manifest = json.load(f)
        manifest["format"] = 1
        with open(os.path.join(old, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        for r in range(registry.world_size):
            torch.save({"client_state": {}, "rng": Evil(old_marker)}, os.path.join(old, "client_state", f"rank_{r}.pt"))
    barrier()
    try:
        registry.load_checkpoint(old)
        result["old_format"] = None
    except CheckpointError as exc:
        result["old_format"] = str(exc)
    result["client_state"] = registry.load_checkpoint(ckpt_dir)  # the clean one still loads
    result["params"] = fingerprint(registry)
    result["markers"] = sorted(os.listdir(os.path.join(out, "markers"))) if os.path.isdir(
        os.path.join(out, "markers")) else []
elif mode == "resave":
    train(registry, 1)
    registry.save_checkpoint(ckpt_dir, client_state={"step": 1}, tag="same")
    train(registry, 1)
    registry.save_checkpoint(ckpt_dir, client_state={"step": 2}, tag="same")
    result["entries_after_resave"] = sorted(os.listdir(ckpt_dir))
    result["params_at_2"] = fingerprint(registry)
    dump(result)
    train(registry, 1)
    final = os.path.join(ckpt_dir, "same")
    remove = ckpt_module._remove_tree

    def remove_then_die(path):
        remove(path)
        if path == final:
            os._exit(3)  # the old folder is gone, the new one not yet renamed in

    ckpt_module._remove_tree = remove_then_die
    registry.save_checkpoint(ckpt_dir, client_state={"step": 3}, tag="same")
    # Only rank 0 commits; the other rank waits at the barrier until the launcher stops it.
elif mode == "verify":
    result["latest"] = ckpt_module.latest_tag(ckpt_dir)
    result["entries"] = sorted(os.listdir(ckpt_dir))
    result["client_state"] = registry.load_checkpoint(ckpt_dir)
    result["params"] = fingerprint(registry)
    registry.save_checkpoint(ckpt_dir, client_state={"step": 9}, tag="next")
    result["entries_after_next"] = sorted(os.listdir(ckpt_dir))
    result["latest_after_next"] = ckpt_module.latest_tag(ckpt_dir)
dump(result)
finish()  # leave together, skip the interpreter's teardown

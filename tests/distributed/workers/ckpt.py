"""Checkpoint round trip, resume equivalence, and a save killed before its commit.

argv: out_dir mode ckpt_dir backend
  full:   train 6 steps, saving a checkpoint after step 3 and going on
  part2:  load that checkpoint, train steps 4..6
  crash:  train 2 steps, save; train 1 more; die inside the next save before its commit
  verify: load what the crash left; check mismatching registries are refused
"""

import os
import sys

import numpy as np
import torch
from common import MLP, dump, full_params, seeded
from multiengine.engines import (
    CheckpointError,
    EngineRegistry,
    RoleSpec,
    ema_update,
    eval_ds_config,
    train_ds_config,
)
from multiengine.engines import checkpoint as ckpt_module

mode, ckpt_dir, backend = sys.argv[2], sys.argv[3], sys.argv[4]
TOTAL = 6


def build(trainable=("actor", "critic"), backend=backend):
    registry = EngineRegistry(backend=backend)
    if "actor" in trainable:
        registry.add(RoleSpec("actor", seeded(lambda: MLP(dropout=0.1), 1),
                              train_ds_config(stage=3, dtype="fp32", micro_batch_size=4),
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                              lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))))
    if "critic" in trainable:
        registry.add(RoleSpec("critic", seeded(lambda: MLP(dropout=0.1), 2),
                              train_ds_config(stage=2, dtype="fp32", micro_batch_size=4),
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
    registry.add(RoleSpec("ref", seeded(MLP, 1), eval_ds_config(stage=3, dtype="fp32")))
    if "actor" in trainable:
        registry.add(RoleSpec("ema", seeded(lambda: MLP(dropout=0.1), 1), eval_ds_config(stage=3, dtype="fp32"),
                              stateful=True))
    return registry.build()


def train(registry, start, stop, data_position):
    """Data comes from the position-indexed stream; noise from the RNG (so RNG restore matters)."""
    losses = []
    for _ in range(start, stop):
        g = torch.Generator().manual_seed(data_position * 10 + registry.rank)
        x = torch.randn(4, 64, generator=g) + 0.01 * torch.randn(4, 64) + float(np.random.rand())
        data_position += 1
        for name in ("actor", "critic"):
            engine = registry[name]
            loss = (engine(x) - registry["ref"](x)).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        ema_update(registry["ema"].module, registry["actor"].module, decay=0.5)
    return losses, data_position


def fingerprint(registry):
    return {n: [p.sum().item() for p in full_params(registry, n)] for n in ("actor", "critic", "ema")}


torch.manual_seed(1234)
np.random.seed(1234)
result = {"mode": mode}
if mode == "full":
    registry = build()
    first, pos = train(registry, 0, 3, 0)
    before = fingerprint(registry), torch.get_rng_state(), np.random.get_state()[1].tolist()
    result["path"] = registry.save_checkpoint(ckpt_dir, client_state={"step": 3, "data_position": pos})
    after = fingerprint(registry), torch.get_rng_state(), np.random.get_state()[1].tolist()
    # the save leaves the run as it was: weights and both RNGs the data noise is drawn from
    result["save_changed"] = [name for name, x, y in zip(("params", "torch_rng", "numpy_rng"), before, after)
                              if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y)]
    rest, _ = train(registry, 3, TOTAL, pos)
    result["losses"] = first + rest
    result["params"] = fingerprint(registry)
elif mode == "part2":
    registry = build()
    state = registry.load_checkpoint(ckpt_dir)
    result["client_state"] = state
    result["losses"], _ = train(registry, state["step"], TOTAL, state["data_position"])
    result["params"] = fingerprint(registry)
    result["lr"] = registry["actor"].get_lr()[0]
elif mode == "crash":
    registry = build()
    _, pos = train(registry, 0, 2, 0)
    registry.save_checkpoint(ckpt_dir, client_state={"step": 2, "data_position": pos})
    result["params_at_2"] = fingerprint(registry)
    dump(result)
    _, pos = train(registry, 2, 3, pos)

    def die(*args, **kwargs):
        os._exit(3)  # a kill between writing the new checkpoint and pointing `latest` at it

    ckpt_module._commit = die
    registry.save_checkpoint(ckpt_dir, client_state={"step": 3, "data_position": pos})
    # Only rank 0 commits; the other rank would wait at the barrier until the launcher kills it.
elif mode == "verify":
    registry = build()
    state = registry.load_checkpoint(ckpt_dir)
    result["client_state"] = state
    result["params"] = fingerprint(registry)
    result["entries"] = sorted(os.listdir(ckpt_dir))
    errors = {}
    other = build(trainable=("actor",))
    try:
        other.load_checkpoint(ckpt_dir)
    except CheckpointError as exc:
        errors["roles"] = str(exc)
    result["errors"] = errors
elif mode == "world":
    registry = build()
    try:
        registry.load_checkpoint(ckpt_dir)
    except CheckpointError as exc:
        result["error"] = str(exc)
dump(result)

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

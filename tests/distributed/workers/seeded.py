"""Seeding and sharded data through the registry: a dropout model fed by ShardedBatches (registered with
add_state) plus per-step noise from registry.generator; runs repeat bit-exactly and resume in place.

argv: out_dir mode(full|part1|part2) ckpt_dir
"""

import sys

import torch
from common import MLP, dump
from multiengine.engines import EngineRegistry, OptimSpec, Placement, ShardedBatches, trainable_role

mode, ckpt = sys.argv[2], sys.argv[3]
registry = EngineRegistry(seed=7)
registry.add(trainable_role("net", lambda: MLP(32, depth=2, dropout=0.3), Placement(stage=2, dtype="fp32"),
                            OptimSpec(lr=1e-2), micro_batch_size=4))
registry.build()
rows = [{"x": torch.full((32,), float(i) / 40)} for i in range(40)]
batches = registry.add_state("data", ShardedBatches(rows, lambda b: torch.stack([r["x"] for r in b]), 4,
                                                    registry.world_size, registry.rank, seed=3))
engine = registry["net"]
start, stop = {"full": (0, 6), "part1": (0, 3), "part2": (3, 6)}[mode]
result = {}
if mode == "part2":
    state = registry.load_checkpoint(ckpt)
    result["client_state"] = state
    result["sampler_after_load"] = batches.state_dict()
losses, seen = [], []
for step in range(start, stop):
    x = next(batches)
    noise = torch.randn(x.shape, generator=registry.generator(step))
    loss = engine(x + 0.01 * noise).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
    seen.append(x[:, 0].tolist())
    if step == 2:  # the global RNG (dropout's) after 3 steps, read without advancing it
        rng = torch.get_rng_state()
        result["rand_at_3"] = torch.rand(3).tolist()
        torch.set_rng_state(rng)
if mode == "part1":
    registry.save_checkpoint(ckpt, client_state={"step": stop})
    result["sampler_at_save"] = batches.state_dict()
result.update(losses=losses, seen=seen, rand_after=torch.rand(3).tolist())
dump(result)
registry.close()
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""The same tiny training run at ZeRO 0, 2 and 3 (three roles of one registry) gives the same losses."""

import torch
import torch.distributed as dist
from common import MLP, batch, dump, seeded
from multiengine.engines import EngineRegistry, RoleSpec, train_ds_config

registry = EngineRegistry()
for stage in (0, 2, 3):
    registry.add(RoleSpec(f"s{stage}", seeded(MLP), train_ds_config(stage=stage, dtype="fp32", micro_batch_size=4,
                                                                        grad_accum=2),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
registry.build()

losses = {name: [] for name in registry.names()}
for step in range(6):
    for micro in range(2):
        x, y = batch(10 * step + micro, registry.rank)  # different data on each rank: exercises reduction
        for name in registry.names():
            engine = registry[name]
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[name].append(mean.item() / registry.world_size)
dump({"losses": losses, "train_batch_size": {n: registry[n].train_batch_size() for n in registry.names()}})

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""Close, then a new registry in the same process, three times: each round builds a ZeRO-2 and a ZeRO-3 role, trains
them a step and closes (which destroys the process group); every round's registry asks for its own collective
timeout, and every group of the round (the default one and DeepSpeed's) is read back.

argv: out_dir
"""

import torch
import torch.distributed as dist
from common import MLP, dump, finish, seeded
from multiengine.engines import EngineRegistry, OptimSpec, Placement, trainable_role

rounds = []
for timeout_s in (41, 42, 43):
    registry = EngineRegistry(backend="deepspeed", timeout_s=timeout_s)
    for stage in (2, 3):
        registry.add(trainable_role(f"s{stage}", seeded(lambda: MLP(64, depth=2)), Placement(stage=stage, dtype="fp32"),
                                    OptimSpec(name="sgd", lr=0.1), micro_batch_size=2))
    registry.build()
    x = torch.linspace(-1, 1, 128).reshape(2, 64) * (registry.rank + 1)
    losses = {}
    for name in ("s2", "s3"):
        for _ in range(2):  # the second loss shows the first step's update
            loss = registry[name](x).pow(2).mean()
            registry[name].backward(loss)
            registry[name].step()
            losses.setdefault(name, []).append(loss.item())
    groups = dist.distributed_c10d._world.pg_map
    timeouts = sorted({pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in groups})
    rounds.append({"losses": losses, "groups": len(groups), "timeouts": timeouts})
    registry.close()
    rounds[-1]["after_close"] = dist.is_initialized()
dump({"rounds": rounds})
finish()

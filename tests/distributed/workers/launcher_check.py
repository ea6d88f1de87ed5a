"""A stage-3 pair of roles under whichever launcher started us (argv: out_dir, maybe --local_rank=N)."""

import json
import os
import sys

import torch
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config

out_dir = next(a for a in sys.argv[1:] if not a.startswith("--"))
registry = EngineRegistry()
registry.add(RoleSpec("actor", lambda: torch.nn.Linear(64, 64),
                      train_ds_config(stage=3, dtype="fp32", micro_batch_size=2),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1)))
registry.add(RoleSpec("ref", lambda: torch.nn.Linear(64, 64), eval_ds_config(stage=3, dtype="fp32")))
registry.build()
x = torch.randn(2, 64)
loss = registry["actor"](x).pow(2).mean()
registry["actor"].backward(loss)
registry["actor"].step()
registry["ref"](x)
from deepspeed.comm import comm as ds_comm  # noqa: E402
from multiengine.engines.dist import _shm_buffer_path  # noqa: E402

with open(os.path.join(out_dir, f"rank{registry.rank}.json"), "w") as f:
    json.dump({"rank": registry.rank, "world": registry.world_size,
               "shm_op": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
               "shm_left": [n for n in os.listdir("/dev/shm")
                            if n == os.path.basename(_shm_buffer_path(registry.rank))],
               "local": {r.name: sum(p.ds_tensor.numel() for p in r.module.parameters()) for r in registry.roles()}}, f)

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""Whole-parameter access with coalesced collectives (registry.gathered, gather_forward, partition.whole_parameters)
on ZeRO-3 roles: how many all-gathers each costs, persistent parameters left whole, values against DeepSpeed's own
GatheredParameters, nesting, modifier_rank, an error inside the block, buckets, and training afterwards identical
to a twin role that was never gathered."""

import deepspeed
import torch
from common import MLP, batch, dump, seeded
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
from multiengine.engines.partition import hooks_detached, whole_parameters


class Collectives:
    """c10d collectives launched inside the block, by kind (from torch's profiler: every c10d op is one event)."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        names = [e.name.lower() for e in self.prof.events() if e.name.startswith("c10d::")]
        self.all_gather = sum("allgather" in n or "all_gather" in n for n in names)
        self.broadcast = sum("broadcast" in n for n in names)
        self.total = len(names)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


registry = EngineRegistry()
train = train_ds_config(stage=3, dtype="fp32", micro_batch_size=4)
for name in ("policy", "twin"):  # the same initial weights (seeded factory), trained identically
    registry.add(RoleSpec(name, seeded(MLP), train, optimizer=adamw))
registry.add(RoleSpec("frozen", seeded(MLP), eval_ds_config(stage=3, dtype="fp32")))
registry.add(RoleSpec("scratch", seeded(MLP), eval_ds_config(stage=3, dtype="fp32")))
registry.add(RoleSpec("gathered_fwd", seeded(MLP), eval_ds_config(stage=3, dtype="fp32"), gather_forward=True))
registry.build()


def state(name):
    params = list(registry[name].module.parameters())
    return {"whole": [p.numel() == p.ds_numel for p in params], "persist": [bool(p.ds_persist) for p in params]}


def reference(name):
    """The full values through DeepSpeed's GatheredParameters (hooks detached, as registry.gathered does)."""
    with hooks_detached(registry[name]), deepspeed.zero.GatheredParameters(list(registry[name].module.parameters())):
        return [p.detach().clone() for p in registry[name].module.parameters()]


def step(name, i):
    x, y = batch(i, registry.rank)
    loss = torch.nn.functional.mse_loss(registry[name](x), y)
    registry[name].backward(loss)
    registry[name].step()
    return loss.item()


out = {"losses": {"policy": [], "twin": []}}
for i in range(2):
    for name in ("policy", "twin"):
        out["losses"][name].append(step(name, i))
out["before"] = state("policy")  # after optimizer steps: persistent parameters whole, the others 1/N

frozen_values = reference("frozen")

# 1. one role: one all-gather for all its partitioned tensors; the values are DeepSpeed's
with Collectives() as c:
    with registry.gathered("policy"):
        inside = [p.detach().clone() for p in registry["policy"].module.parameters()]
        out["inside_whole"] = all(p.numel() == p.ds_numel for p in registry["policy"].module.parameters())
out["one_role"] = {"all_gather": c.all_gather, "total": c.total}
out["after"] = state("policy")
out["values_equal"] = all(torch.equal(a, b) for a, b in zip(inside, reference("policy")))  # (partitions it all)

# 2. two roles in one block: still one all-gather
with Collectives() as c, registry.gathered("policy", "frozen"):
    pass
out["two_roles"] = {"all_gather": c.all_gather, "total": c.total}

# 3. nesting: the inner block gathers nothing and releases nothing
with registry.gathered("frozen"):
    with Collectives() as c, registry.gathered("frozen"):
        pass
    out["nested"] = {"total": c.total,
                     "whole_after_inner": all(p.numel() == p.ds_numel for p in registry["frozen"].module.parameters())}

# 4. modifier_rank=0: rank 0's values everywhere and in every partition (persistent tensors too); one broadcast
with Collectives() as c:
    with registry.gathered("scratch", modifier_rank=0), torch.no_grad():
        for k, p in enumerate(registry["scratch"].module.parameters()):
            p.fill_(10.0 * (registry.rank + 1) + k)
out["modifier"] = {"broadcast": c.broadcast, "state": state("scratch"),
                   "values": [float(t.flatten()[0]) for t in reference("scratch")],
                   "all_equal": all(bool((t == t.flatten()[0]).all()) for t in reference("scratch"))}
x, _ = batch(7, registry.rank)
with torch.no_grad():
    out["modifier"]["forward"] = registry["scratch"](x).tolist()
    # the same forward by hand on rank 0's values
    h = x
    weights = reference("scratch")
    for k in range(0, len(weights) - 2, 2):
        h = torch.nn.functional.gelu(h @ weights[k].T + weights[k + 1])
    out["modifier"]["by_hand"] = (h @ weights[-2].T + weights[-1]).squeeze(-1).tolist()

# 5. an error inside the block: released without a collective, the next gather works
try:
    with registry.gathered("frozen"):
        raise ValueError("inside")
except ValueError:
    out["error_released"] = state("frozen")
out["error_values_equal"] = all(torch.equal(a, b) for a, b in zip(reference("frozen"), frozen_values))

# 6. buckets: at most bucket_numel elements per all-gather (a larger tensor alone)
engine = registry["frozen"]
with hooks_detached(engine):
    with Collectives() as c, whole_parameters(list(engine.module.parameters()), bucket_numel=8256):
        pass
    out["bucket_8256"] = c.all_gather
    with Collectives() as c, whole_parameters(list(engine.module.parameters()), bucket_numel=1):
        pass
    out["bucket_1"] = c.all_gather
    out["partitioned_tensors"] = sum(not p.ds_persist for p in engine.module.parameters())

# 7. gather_forward: the frozen twin's output, one all-gather per call, 1/N afterwards
registry["gathered_fwd"](x)
with Collectives() as c:
    y_gathered = registry["gathered_fwd"](x)
out["gather_forward"] = {"all_gather": c.all_gather, "equal": torch.equal(y_gathered, registry["frozen"](x)),
                         "state": state("gathered_fwd")}

# 8. training goes on exactly as for the twin that was never gathered
for i in range(2, 4):
    for name in ("policy", "twin"):
        out["losses"][name].append(step(name, i))
    with registry.gathered("policy"):
        pass
out["final_equal"] = all(torch.equal(a, b) for a, b in zip(reference("policy"), reference("twin")))
dump(out)
registry.close()
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

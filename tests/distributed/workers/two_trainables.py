"""Two (three) trainable roles, each with its own optimizer, learning rate, accumulation and clipping.

argv: out_dir backend
"""

import sys

import torch
from common import MLP, batch, dump, full_params, max_diff, seeded
from multiengine.engines import EngineRegistry, RoleSpec, train_ds_config

backend = sys.argv[2]
registry = EngineRegistry(backend=backend)
registry.add(RoleSpec("a", seeded(MLP, 1), train_ds_config(stage=3, dtype="fp32", micro_batch_size=2, grad_accum=2),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                      lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)))
registry.add(RoleSpec("b", seeded(MLP, 2), train_ds_config(stage=2, dtype="fp32", micro_batch_size=4, grad_accum=1,
                                                           gradient_clipping=0.01),
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5)))
registry.add(RoleSpec("z", seeded(MLP, 3), train_ds_config(stage=0, dtype="fp32", micro_batch_size=3),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.0)))
registry.build()


def micro_step(name, step):
    x, y = batch(step, registry.rank)
    engine = registry[name]
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()


start = {n: full_params(registry, n) for n in registry.names()}
# Phase 1: one micro step of "a" (accumulation 2: no optimizer step yet), then a second one.
micro_step("a", 0)
after_one_micro = full_params(registry, "a")
micro_step("a", 1)
phase1 = {n: full_params(registry, n) for n in registry.names()}
lr_a = [registry["a"].get_lr()[0]]
# Phase 2: "b" and "z" train; "a" does not.
for step in range(2):
    micro_step("b", step)
    micro_step("z", step)
phase2 = {n: full_params(registry, n) for n in registry.names()}
micro_step("a", 2)
micro_step("a", 3)
lr_a.append(registry["a"].get_lr()[0])

# b's update is bounded by clipping: SGD lr 0.5 x clipped norm 0.01 per step.
b_update_norm = torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(phase1["b"], phase2["b"]))).item()
dump({
    "a_after_one_micro": max_diff(start["a"], after_one_micro),
    "a_after_boundary": max_diff(start["a"], phase1["a"]),
    "b_phase1": max_diff(start["b"], phase1["b"]),
    "z_phase1": max_diff(start["z"], phase1["z"]),
    "a_phase2": max_diff(phase1["a"], phase2["a"]),
    "b_phase2": max_diff(phase1["b"], phase2["b"]),
    "z_phase2": max_diff(phase1["z"], phase2["z"]),
    "b_update_norm": b_update_norm,
    "lr_a": lr_a,
    "train_batch_size": {n: registry[n].train_batch_size() for n in registry.names()},
    "gas": {n: registry[n].gradient_accumulation_steps() for n in registry.names()},
    "a_param_sum": sum(p.sum().item() for p in full_params(registry, "a")),
    "backend": registry.backend,
})

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

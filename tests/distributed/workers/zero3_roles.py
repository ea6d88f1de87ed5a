"""A stage-3 trainable role and a stage-3 frozen role, both built under zero.Init."""

import torch
from common import MLP, batch, dump, full_params, max_diff, seeded
from multiengine.engines import EngineRegistry, RoleSpec, ema_update, eval_ds_config, train_ds_config

seen_partitioned_at_build = {}


def factory(name):
    def build():
        model = seeded(MLP)()
        # Under zero.Init, parameters are partitioned as each layer is constructed.
        seen_partitioned_at_build[name] = all(hasattr(p, "ds_tensor") for p in model.parameters())
        return model
    return build


registry = EngineRegistry()
registry.add(RoleSpec("policy", factory("policy"), train_ds_config(stage=3, dtype="fp32", micro_batch_size=4),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
registry.add(RoleSpec("frozen", factory("frozen"), eval_ds_config(stage=3, dtype="fp32")))
registry.add(RoleSpec("ema", factory("ema"), eval_ds_config(stage=3, dtype="fp32"), stateful=True))
registry.add(RoleSpec("gathered", factory("gathered"), eval_ds_config(stage=3, dtype="fp32"), gather_forward=True))
registry.build()

per_role = {}
for name in ("policy", "frozen"):
    params = list(registry[name].module.parameters())
    per_role[name] = {
        "local": sum(p.ds_tensor.numel() for p in params),
        "total": sum(p.ds_numel for p in params),
        "shapes_outside_gather": sorted({tuple(p.shape) for p in params if not getattr(p, "ds_persist", False)}),
    }
    with registry.gathered(name):
        per_role[name]["shapes_inside_gather"] = [list(p.shape) for p in params][:2]

before = {n: full_params(registry, n) for n in ("policy", "frozen")}
losses = []
for step in range(3):
    x, y = batch(step, registry.rank)
    loss = torch.nn.functional.mse_loss(registry["policy"](x), y)
    registry["policy"].backward(loss)
    registry["policy"].step()
    frozen_out = registry["frozen"](x)
    losses.append(loss.item())
after = {n: full_params(registry, n) for n in ("policy", "frozen")}
ema_update(registry["ema"].module, registry["policy"].module, decay=0.75)
gathered_out = registry["gathered"](x)
gathered_error = (gathered_out - registry["frozen"](x)).abs().max().item()
gathered_released = all(p.numel() == 0 for p in registry["gathered"].module.parameters()
                        if not getattr(p, "ds_persist", False))
expected_ema = [0.75 * b + 0.25 * a for b, a in zip(before["policy"], after["policy"])]
ema_error = max_diff(full_params(registry, "ema"), expected_ema)

report = registry.memory_report()
dump({
    "per_role": per_role,
    "partitioned_at_build": seen_partitioned_at_build,
    "policy_changed": max_diff(before["policy"], after["policy"]),
    "frozen_changed": max_diff(before["frozen"], after["frozen"]),
    "frozen_output_requires_grad": bool(frozen_out.requires_grad),
    "frozen_requires_grad": any(p.requires_grad for p in registry["frozen"].module.parameters()),
    "frozen_training_mode": registry["frozen"].module.training,
    "frozen_optimizer": type(registry["frozen"].optimizer).__name__,
    "losses": losses,
    "ema_error": ema_error,
    "gathered_error": gathered_error,
    "gathered_released": gathered_released,
    "ema_local": sum(p.ds_tensor.numel() for p in registry["ema"].module.parameters()),
    "report": list(report),
    "report_text": str(report),
})

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

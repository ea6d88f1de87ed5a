"""What a built trainable role will do, read back from the engine, on both backends and at ZeRO 0/1/2/3; and
one SGD step with a gradient norm above 1 against plain PyTorch on the global batch, clipping off and at 0.5.

argv: out_dir
"""

import torch
from common import MLP, dump, finish, full_params, seeded
from multiengine.engines import EngineRegistry, OptimSpec, Placement, RoleSpec, trainable_role

LR = 0.1


def global_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, 64, generator=g)
    return x, 50.0 * x[:, :4].sum(-1)  # large targets: a gradient norm far above 1


def reference(clip: float) -> list[torch.Tensor]:
    """Plain PyTorch: the mean of the ranks' mean losses, clip_grad_norm_ if clip > 0, one SGD step."""
    model = seeded(MLP, 5)()
    loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in map(global_batch, range(2))) / 2
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return [p.detach().clone() for p in model.parameters()], norm


results = {}
for backend in ("deepspeed", "torch"):
    registry = EngineRegistry(backend=backend, seed=0)
    for stage in (0, 1, 2, 3):
        for clip in (0.0, 0.5):
            registry.add(trainable_role(f"s{stage}_c{int(clip * 10)}", seeded(MLP, 5),
                                        Placement(stage=stage, dtype="fp32"),
                                        OptimSpec(name="sgd", lr=LR, max_grad_norm=clip), micro_batch_size=4))
    # a user's own DeepSpeed config without gradient_clipping: both backends apply DeepSpeed's default
    own = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True}
    registry.add(RoleSpec("own", seeded(MLP, 5), own, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR)))
    registry.build()
    for name in registry.names():
        engine = registry[name]
        x, y = global_batch(registry.rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed wraps it under ZeRO
        results[f"{backend}/{name}"] = {
            "clip": engine.gradient_clipping(),
            "bf16": bool(engine.bfloat16_enabled()), "fp16": bool(engine.fp16_enabled()),
            "accum": engine.gradient_accumulation_steps(), "micro": engine.train_micro_batch_size_per_gpu(),
            "optimizer": type(optimizer).__name__, "lr": engine.get_lr()[0],
            "config_clip": registry.role(name).config["gradient_clipping"],
            "params": [p.tolist() for p in full_params(registry, name)],
        }
    del registry
for clip in (0.0, 0.5, 1.0):
    params, norm = reference(clip)
    results[f"reference/{clip}"] = {"params": [p.tolist() for p in params], "grad_norm": norm}
dump(results)
finish()

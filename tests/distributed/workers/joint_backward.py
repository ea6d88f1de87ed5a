"""One contrastive loss over two trainable roles (a dual encoder) through registry.backward/step.

Pairs of roles at mixed stages (3+2, 3+3, 0+3; accumulation 2, different optimizers) and a pair
with different accumulation steps (2 and 1). Every gradient is compared with a single-process
reference computed on every rank from the same initial weights and the data of all ranks.

argv: out_dir backend
"""

import sys

import torch
import torch.nn.functional as F
from common import MLP, dump, seeded
from multiengine.engines import EngineRegistry, JointLossError, RoleSpec, train_ds_config

backend = sys.argv[2]
WIDTH, MICRO = 64, 4
PAIRS = {"a": (3, 2, 2, 2), "b": (3, 3, 2, 2), "c": (0, 3, 2, 2), "d": (3, 2, 2, 1)}  # stages, accumulations


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(WIDTH, depth=2).net[:-1]  # width -> width features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=-1)


def contrastive(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    logits = q @ d.T / 0.1
    return F.cross_entropy(logits, torch.arange(q.shape[0]))


def data(pair: str, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * ord(pair) + 10 * micro + rank)
    x = torch.randn(MICRO, WIDTH, generator=g)
    return x, x + 0.1 * torch.randn(MICRO, WIDTH, generator=g)


registry = EngineRegistry(backend=backend)
seeds = {}
for i, (pair, (sq, sd, gq, gd)) in enumerate(PAIRS.items()):
    seeds[f"q{pair}"], seeds[f"d{pair}"] = 10 + i, 20 + i
    # lr 0: the weights stay put, so every accumulation window sees the same reference weights
    registry.add(RoleSpec(f"q{pair}", seeded(Encoder, 10 + i),
                          train_ds_config(stage=sq, dtype="fp32", micro_batch_size=MICRO, grad_accum=gq),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0)))
    registry.add(RoleSpec(f"d{pair}", seeded(Encoder, 20 + i),
                          train_ds_config(stage=sd, dtype="fp32", micro_batch_size=MICRO, grad_accum=gd,
                                          gradient_clipping=0.5),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1)))
registry.build()
W = registry.world_size


def full_grads(name: str) -> list[torch.Tensor]:
    engine = registry[name]
    if backend == "torch":
        return [p.grad.detach().clone() for p in engine.module.parameters()]
    from deepspeed.utils import safe_get_full_grad

    return [safe_get_full_grad(p).detach().float().clone() for p in engine.module.parameters()]


def reference(pair: str, micros: list[int], scale_q: float, scale_d: float):
    """Gradients of (1/W) sum over ranks and micro batches of the loss, per role."""
    q, d = seeded(Encoder, seeds[f"q{pair}"])(), seeded(Encoder, seeds[f"d{pair}"])()
    for m in micros:
        for r in range(W):
            x, y = data(pair, m, r)
            loss = contrastive(q(x), d(y)) / W
            gq = torch.autograd.grad(loss, list(q.parameters()), retain_graph=True)
            gd = torch.autograd.grad(loss, list(d.parameters()))
            for p, g in zip(q.parameters(), gq):
                p.grad = g * scale_q if p.grad is None else p.grad + g * scale_q
            for p, g in zip(d.parameters(), gd):
                p.grad = g * scale_d if p.grad is None else p.grad + g * scale_d
    return [p.grad for p in q.parameters()], [p.grad for p in d.parameters()]


def diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


result = {"backend": backend, "errors": {}}
for pair, (_, _, gq, gd) in PAIRS.items():
    names = [f"q{pair}", f"d{pair}"]
    checks = []
    for micro in range(gq):
        x, y = data(pair, micro, registry.rank)
        loss = contrastive(registry[names[0]](x), registry[names[1]](y))
        registry.backward(loss, roles=names)
        if gd == 1:  # d reaches its boundary every micro batch: its gradient is this micro batch's alone
            checks.append(("d", micro, full_grads(names[1])))
        if micro == gq - 1:
            checks.append(("q", micro, full_grads(names[0])))
            if gd == gq:
                checks.append(("d", micro, full_grads(names[1])))
        registry.step(roles=names)
    errs = []
    for which, micro, got in checks:
        if which == "q":
            want, _ = reference(pair, list(range(gq)), 1.0 / gq, 1.0 / gd)
        else:
            window = [micro] if gd == 1 else list(range(gd))
            _, want = reference(pair, window, 1.0 / gq, 1.0 / gd)
        errs.append(diff(got, want))
    result["errors"][pair] = max(errs)
    result.setdefault("checks", {})[pair] = len(checks)

# One engine's backward on a loss that reaches two trainable roles: a clear error naming registry.backward.
x, y = data("a", 99, registry.rank)
loss = contrastive(registry["qa"](x), registry["da"](y))
try:
    registry["qa"].backward(loss, retain_graph=True)
    result["naive_error"] = ""
except JointLossError as exc:
    result["naive_error"] = str(exc)
try:
    registry.backward(contrastive(registry["qa"](x), registry["da"](y)), roles=["qa"])
    result["unlisted_error"] = ""
except JointLossError as exc:
    result["unlisted_error"] = str(exc)
dump(result)
registry.close()

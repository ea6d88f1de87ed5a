"""One contrastive loss over two trainable roles (a dual encoder) through registry.backward/step.

Pairs of roles at mixed stages (3+2, 3+3, 0+3; accumulation 2, different optimizers) and a pair
with different accumulation steps (2 and 1). Every gradient is compared with a single-process
reference computed on every rank from the same initial weights and the data of all ranks.
Each role clips at its own threshold over its own gradient norm (q 1.0, d 0.5; both norms are about 5):
after the window, q (plain SGD, lr 1) moved by exactly its clipped reference gradient, and d's AdamW
(lr 0, so its weights stay put) holds (1 - beta1) x its clipped reference gradient as its first moment
(a running average of them when d steps per micro batch).

argv: out_dir backend
"""

import sys

import torch
import torch.nn.functional as F
from common import MLP, dump, full_params, seeded
from multiengine.engines import EngineRegistry, JointLossError, RoleSpec, train_ds_config

backend = sys.argv[2]
WIDTH, MICRO = 64, 4
PAIRS = {"a": (3, 2, 2, 2), "b": (3, 3, 2, 2), "c": (0, 3, 2, 2), "d": (3, 2, 2, 1)}  # stages, accumulations
CLIP = {"q": 1.0, "d": 0.5}
BETA1 = 0.9


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
    # q steps once, after its gradients were read (so lr 1 shows the clipped gradient as the weight change);
    # d may step every micro batch: lr 0 keeps its weights, so each of its windows sees the reference weights
    registry.add(RoleSpec(f"q{pair}", seeded(Encoder, 10 + i),
                          train_ds_config(stage=sq, dtype="fp32", micro_batch_size=MICRO, grad_accum=gq,
                                          gradient_clipping=CLIP["q"]),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)))
    registry.add(RoleSpec(f"d{pair}", seeded(Encoder, 20 + i),
                          train_ds_config(stage=sd, dtype="fp32", micro_batch_size=MICRO, grad_accum=gd,
                                          gradient_clipping=CLIP["d"]),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.0, betas=(BETA1, 0.999),
                                                                 weight_decay=0.1)))
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


def norm(grads) -> float:
    return torch.cat([g.flatten() for g in grads]).norm().item()


def clipped(grads, threshold: float, total: float | None = None):
    """What DeepSpeed and clip_grad_norm_ apply: scale by threshold / (norm + 1e-6) when that is below 1."""
    total = norm(grads) if total is None else total
    return [g * min(1.0, threshold / (total + 1e-6)) for g in grads]


def first_moment(name: str) -> list[torch.Tensor]:
    engine = registry[name]
    if backend == "torch":
        return [engine.optimizer.state[p]["exp_avg"].detach().clone() for p in engine.module.parameters()]
    from deepspeed.utils import safe_get_full_optimizer_state

    return [safe_get_full_optimizer_state(p, "exp_avg").detach().float().clone() for p in engine.module.parameters()]


def clip_checks(pair: str, q_grad, d_windows) -> dict[str, float]:
    """q: weights after its one SGD(lr 1) step == initial - clipped gradient. d: AdamW's exp_avg after its
    steps == the running (1 - beta1) average of its clipped window gradients. Also the errors had a role been
    clipped at the other role's threshold, over the joint norm of both roles, or not at all (all must be large)."""
    q0 = list(seeded(Encoder, seeds[f"q{pair}"])().parameters())
    got_q = full_params(registry, f"q{pair}")
    got_d = [m / (1 - BETA1) for m in first_moment(f"d{pair}")]  # in gradient units

    def d_moment(threshold: float, joint: bool):
        m = [torch.zeros_like(g) for g in d_windows[0]]
        for g in d_windows:
            total = norm(q_grad + g) if joint else None
            m = [BETA1 * a + (1 - BETA1) * c for a, c in zip(m, clipped(g, threshold, total))]
        return [a / (1 - BETA1) for a in m]

    def q_after(threshold: float, joint: bool):
        total = norm(q_grad + d_windows[-1]) if joint else None
        return [p.detach() - c for p, c in zip(q0, clipped(q_grad, threshold, total))]

    return {"q_norm": norm(q_grad), "d_norm": min(norm(g) for g in d_windows),
            "q_err": diff(got_q, q_after(CLIP["q"], False)), "d_err": diff(got_d, d_moment(CLIP["d"], False)),
            "q_err_other": diff(got_q, q_after(CLIP["d"], False)),
            "d_err_other": diff(got_d, d_moment(CLIP["q"], False)),
            "q_err_joint": diff(got_q, q_after(CLIP["q"], True)),
            "d_err_joint": diff(got_d, d_moment(CLIP["d"], True)),
            "q_err_unclipped": diff(got_q, q_after(float("inf"), False))}


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
    errs, q_grad, d_windows = [], None, []
    for which, micro, got in checks:
        if which == "q":
            want, _ = reference(pair, list(range(gq)), 1.0 / gq, 1.0 / gd)
            q_grad = want
        else:
            window = [micro] if gd == 1 else list(range(gd))
            _, want = reference(pair, window, 1.0 / gq, 1.0 / gd)
            d_windows.append(want)
        errs.append(diff(got, want))
    result["errors"][pair] = max(errs)
    result.setdefault("checks", {})[pair] = len(checks)
    result.setdefault("clip", {})[pair] = clip_checks(pair, q_grad, d_windows)

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
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""A GAN on the registry at every mix of ZeRO stages 0/2/3 for its two trainable roles (and on the torch
backend): the discriminator's step on detached fakes, then the generator's step with its loss flowing
through the discriminator, which must not change ("through": registry.backward(..., through=["disc"]);
"by_hand": disc's parameters switched off and the generator engine's own backward). "joint": the same
loss trains both roles (registry.backward over both, both step). Every step is compared with plain
PyTorch on the global batch (both ranks' rows).

argv: out_dir
"""

import torch
from common import dump, finish, full_params, seeded
from multiengine.engines import ConfigError, EngineRegistry, JointLossError, OptimSpec, Placement, trainable_role

WIDTH, NOISE, STEPS, LR = 32, 8, 2, 0.05


class Gen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(NOISE, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class Disc(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def rows(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(4, NOISE, generator=g), torch.randn(4, WIDTH, generator=g) + 1.0


def d_loss(disc, real, fake):
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    return bce(disc(real), torch.ones(len(real))) + bce(disc(fake), torch.zeros(len(fake)))


def g_loss(disc, fake):
    return torch.nn.functional.binary_cross_entropy_with_logits(disc(fake), torch.ones(len(fake)))


def reference(joint: bool, d_accum: int = 1) -> list[dict]:
    """Plain PyTorch, the mean over both ranks' losses, SGD without clipping; the discriminator accumulates its own
    loss over ``d_accum`` steps before it steps."""
    gen, disc = seeded(Gen, 1)(), seeded(Disc, 2)()
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=LR), torch.optim.SGD(disc.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        batches = [rows(step, r) for r in range(2)]
        (sum(d_loss(disc, real, gen(z).detach()) for z, real in batches) / 2 / d_accum).backward()
        if (step + 1) % d_accum == 0:
            opt_d.step()
            opt_d.zero_grad()
        opt_g.zero_grad()
        disc.requires_grad_(joint)
        (sum(g_loss(disc, gen(z)) for z, _ in batches) / 2).backward()
        disc.requires_grad_(True)
        grads = [p.grad.clone() for p in gen.parameters()]
        opt_g.step()
        if joint:
            opt_d.step()
            opt_d.zero_grad()
        out.append({"gen": [p.detach().clone() for p in gen.parameters()], "gen_grad": grads,
                     "disc": [p.detach().clone() for p in disc.parameters()]})
    return out


def diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def refusals(registry) -> dict[str, str]:
    """The error each wrong call gives, raised before any backward runs."""
    gen, disc = registry["gen"], registry["disc"]
    z, _ = rows(0, registry.rank)
    calls = {"engine": (gen.backward, {}), "unlisted": (registry.backward, {"roles": ["gen"]}),
             "both": (registry.backward, {"roles": ["gen", "disc"], "through": ["disc"]})}
    errors = {}
    for name, (call, kwargs) in calls.items():
        try:
            call(g_loss(disc, gen(z)), **kwargs)
            errors[name] = ""
        except (JointLossError, ConfigError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


refs = {(joint, acc): reference(joint, acc) for joint, acc in ((False, 1), (True, 1), (False, 2))}
results = {}
mixes = [("deepspeed", g, d, how, 1) for g in (0, 2, 3) for d in (0, 2, 3) for how in ("through", "by_hand", "joint")]
mixes += [("torch", 0, 0, how, 1) for how in ("through", "by_hand", "joint")]
# the discriminator accumulating 2 micro batches: what flows through it to the generator is not divided by 2
mixes += [("deepspeed", 2, d, how, 2) for d in (0, 3) for how in ("through", "by_hand")]
mixes += [("torch", 0, 0, "through", 2)]
for backend, g_stage, d_stage, how, d_accum in mixes:
    registry = EngineRegistry(backend=backend, seed=0)
    sgd = OptimSpec(name="sgd", lr=LR, max_grad_norm=0)
    registry.add(trainable_role("gen", seeded(Gen, 1), Placement(stage=g_stage, dtype="fp32"), sgd, micro_batch_size=4))
    registry.add(trainable_role("disc", seeded(Disc, 2), Placement(stage=d_stage, dtype="fp32"), sgd,
                                micro_batch_size=4, grad_accum=d_accum))
    registry.build()
    gen, disc = registry["gen"], registry["disc"]
    ref = refs[(how == "joint", d_accum)]
    worst = {"gen": 0.0, "gen_grad": 0.0, "disc": 0.0, "disc_moved_by_gen_step": 0.0}
    for step in range(STEPS):
        z, real = rows(step, registry.rank)
        # 1. discriminator step on detached fakes: only disc is reached
        loss = d_loss(disc, real, gen(z).detach())
        disc.backward(loss)
        disc.step()
        disc_before = full_params(registry, "disc")
        # 2. generator step through the discriminator
        if how == "through":
            registry.backward(g_loss(disc, gen(z)), roles=["gen"], through=["disc"])
        elif how == "joint":
            registry.backward(g_loss(disc, gen(z)), roles=["gen", "disc"])
        else:
            disc.module.requires_grad_(False)
            gen.backward(g_loss(disc, gen(z)))
            disc.module.requires_grad_(True)
        with registry.gathered("gen"):
            grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in gen.module.parameters()] if backend == "torch" or g_stage == 0 else None
        registry.step(["gen", "disc"] if how == "joint" else ["gen"])
        worst["disc_moved_by_gen_step"] = max(worst["disc_moved_by_gen_step"],
                                              diff(disc_before, full_params(registry, "disc")))
        worst["gen"] = max(worst["gen"], diff(full_params(registry, "gen"), ref[step]["gen"]))
        worst["disc"] = max(worst["disc"], diff(full_params(registry, "disc"), ref[step]["disc"]))
        if grads is not None:
            worst["gen_grad"] = max(worst["gen_grad"], diff(grads, ref[step]["gen_grad"]))
    results[f"{backend}/g{g_stage}/d{d_stage}/{how}" + ("/acc2" if d_accum == 2 else "")] = worst
    if (backend, g_stage, d_stage, how) == ("deepspeed", 0, 0, "through"):
        results["errors"] = refusals(registry)
    del registry, gen, disc
dump(results)
finish()

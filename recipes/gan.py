"""A GAN: two trainable roles with their own ZeRO stages and optimizers, the generator's loss flowing through
the discriminator without updating it.

    multiengine run gan --config tiny --nproc-per-node 2
    multiengine run gan --config tiny --nproc-per-node 2 roles.disc.stage=2 roles.gen.lr=5e-4
    multiengine plan gan --config tiny --gpus 8 --gpu-mem 80GiB

The generator maps noise to points, the discriminator scores points; the target is a ring of Gaussians, so
the figures say plainly whether it learns: the share of generated points near some mode of the ring
(``high_quality``) and the share of modes it covers (``mode_coverage``), on a fixed evaluation noise. The
discriminator steps on detached fakes (its own backward); the generator steps on
``registry.backward(g_loss, roles=["gen"], through=["disc"])``: the gradient passes through the discriminator,
whose parameters get none. Writes metrics.jsonl, summary.json, curves.png, checkpoints/ and export/gen
(``model.safetensors`` + ``config.json``, loadable with :func:`load_mlp`).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch
from multiengine.engines import mean_over_ranks, save_role, trainable_role
from multiengine.engines.recipe_config import Key, Range, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, optim_spec, placement, role_keys
from multiengine.pipelines.gan import MLP, discriminator_loss, generator_loss, ring_modes, sample_quality, sample_ring
from multiengine.recipes import plans

GAN_TRAINABLE = {"dtype": "fp32", "lr": 1e-3, "betas": [0.5, 0.999], "max_grad_norm": 0.0, "micro_batch_size": 128,
                 "model": Key("", "a folder this recipe exported (config.json + model.safetensors); \"\" = a new MLP "
                                  "of gan.width x gan.depth")}
ROLES = (
    Role("gen", "the generator: noise -> a point", trainable=True, keys={**GAN_TRAINABLE, "stage": 2}),
    Role("disc", "the discriminator: a point -> one logit", trainable=True, keys={**GAN_TRAINABLE, "stage": 3}),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/gan", "everything the run writes goes under this folder"),
    "max_steps": Key(800, "generator steps (each after gan.d_steps discriminator steps)"),
    "roles": role_keys(ROLES),
    "gan": Key({
        "noise_dim": Key(8, "generator input size", Range(1)),
        "width": Key(64, "hidden width of both MLPs", Range(1)),
        "depth": Key(2, "hidden layers of both MLPs", Range(1)),
        "d_steps": Key(1, "discriminator steps per generator step", Range(1)),
        "modes": Key(8, "Gaussians on the target ring", Range(1)),
        "radius": Key(2.0, "radius of the ring", Range(0, min_exclusive=True)),
        "std": Key(0.2, "standard deviation of each Gaussian (\"near a mode\" = within 3 std)",
                   Range(0, min_exclusive=True)),
    }, "the two networks and the target distribution"),
    "eval": Key({
        "every": Key(200, "also evaluate every N steps (0 = only before and after)"),
        "size": Key(2048, "generated points scored at each evaluation (the same noise every time)", Range(1)),
    }, "sample quality on a fixed evaluation noise"),
    "export": Key({"enabled": Key(True, "export/gen: model.safetensors + config.json")},
                  "what the run writes under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)


def load_mlp(folder: str) -> MLP:
    """A network this recipe exported: ``config.json`` gives its shape, ``model.safetensors`` its weights."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        shape = json.load(f)
    model = MLP(shape["inputs"], shape["width"], shape["outputs"], shape["depth"])
    model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
    return model


def _shape(cfg: Any, name: str) -> dict[str, int]:
    g = cfg.gan
    inputs, outputs = (g.noise_dim, 2) if name == "gen" else (2, 1)
    return {"inputs": int(inputs), "width": int(g.width), "outputs": outputs, "depth": int(g.depth)}


def validate(cfg: Any, world_size: int = 1) -> None:
    """A given model folder holds an export of this recipe with the shape the config asks for."""
    for name in ("gen", "disc"):
        folder = str(cfg.roles[name].model)
        if not folder:
            continue
        key, path = f"roles.{name}.model", os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise config_problem(key, folder, "has no config.json", f"give a folder this recipe exported "
                                 f"(export/{name}), or set {key}=\"\" for a new network")
        with open(path) as f:
            saved = json.load(f)
        if saved != _shape(cfg, name):
            raise config_problem(key, folder, f"holds a network of shape {saved}, the config asks for "
                                 f"{_shape(cfg, name)}", "set gan.noise_dim/width/depth to the saved shape")


class GAN(Recipe):
    name = "gan"
    postfix_keys = ("d_loss", "g_loss")
    headline = (("high_quality", "share of generated points near a mode", True),
                ("mode_coverage", "share of the ring's modes covered", True))
    plot_panels = [("losses", ["train/d_loss", "train/g_loss"]),
                   ("sample quality", ["eval/high_quality", "eval/mode_coverage"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. one role per network, each with its own placement and optimizer
        for name in ("gen", "disc"):
            s, shape = cfg.roles[name], _shape(cfg, name)
            folder = str(s.model)
            build = (lambda f=folder: load_mlp(f)) if folder else (lambda sh=shape: MLP(**sh))
            registry.add(trainable_role(name, build, placement(cfg, ROLES, name), optim_spec(cfg, name, cfg.max_steps),
                                        micro_batch_size=s.micro_batch_size, grad_accum=s.grad_accum,
                                        gradient_checkpointing=False, seed=cfg.seed))
        registry.build()
        g = cfg.gan
        self.modes = ring_modes(g.modes, g.radius)
        # 2. the evaluation noise: drawn once, the same on every rank and at every evaluation
        self.eval_noise = torch.randn(cfg.eval.size, g.noise_dim, generator=registry.generator(0, "eval", rank=0))

    def _noise(self, rows: int, salt: str) -> torch.Tensor:
        return torch.randn(rows, self.cfg.gan.noise_dim, generator=self.registry.generator(self.step, salt))

    def train_step(self) -> dict[str, float]:
        registry, g = self.registry, self.cfg.gan
        gen, disc = registry["gen"], registry["disc"]
        d_losses, g_losses = [], []
        # 1. the discriminator: real rows against detached fakes, its own backward and step
        for k in range(g.d_steps * disc.gradient_accumulation_steps()):
            rows = self.cfg.roles.disc.micro_batch_size
            real = sample_ring(rows, g.modes, g.radius, g.std, registry.generator(self.step, f"real{k}"))
            with torch.no_grad():
                fake = gen(self._noise(rows, f"d{k}").to(registry.device))
            d_loss = discriminator_loss(disc(real.to(registry.device)), disc(fake))
            disc.backward(d_loss)
            disc.step()
            d_losses.append(d_loss.item())
        # 2. the generator: its loss flows through the discriminator, which gets no gradient from it
        for k in range(gen.gradient_accumulation_steps()):
            z = self._noise(self.cfg.roles.gen.micro_batch_size, f"g{k}").to(registry.device)
            g_loss = generator_loss(disc(gen(z)))
            registry.backward(g_loss, roles=["gen"], through=["disc"])
            gen.step()
            g_losses.append(g_loss.item())
        # 3. means over micro batches and ranks
        return mean_over_ranks({"d_loss": statistics.fmean(d_losses), "g_loss": statistics.fmean(g_losses),
                                "lr": gen.get_lr()[0]})

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        module = self.registry.role("gen").module
        was_training = module.training
        module.eval()
        points = self.registry["gen"](self.eval_noise.to(self.registry.device)).float().cpu()
        module.train(was_training)
        return sample_quality(points, self.modes, self.cfg.gan.std)

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}

        def shape_file(folder: str) -> None:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(_shape(self.cfg, "gen"), f)

        return {"gen": save_role(self.registry, "gen", self.path("export", "gen"), extra_files=shape_file)}

    def summary_metrics(self) -> dict[str, Any]:
        return self.eval_figures(("high_quality", "mode_coverage", "mode_distance"))


main = GAN.main
plan = plans.gan  # what `multiengine plan` sees of this recipe

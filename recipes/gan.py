"""A GAN: two trainable roles with their own ZeRO stages and optimizers on a ring of Gaussians, judged by
``high_quality`` and ``mode_coverage``; the generator steps on ``registry.backward(g_loss, roles=["gen"],
through=["disc"])``, its gradient passing through the discriminator, whose parameters get none.

    multiengine run gan --config tiny --nproc-per-node 2"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import mean_over_ranks, save_role
from multiengine.engines.settings import Range, Settings, section, setting
from multiengine.pipelines.gan import (
    MLP,
    GANSettings,
    discriminator_loss,
    generator_loss,
    ring_modes,
    sample_quality,
    sample_ring,
)
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role

_NETWORK = {"dtype": "fp32", "lr": 1e-3, "betas": [0.5, 0.999], "max_grad_norm": 0.0, "micro_batch_size": 128,
            "model": Key("", "a folder this recipe exported (config.json + model.safetensors); \"\" = a new MLP of "
                             "gan.width x gan.depth")}
_NOT_HERE = ("tokenizer", "lora", "gradient_checkpointing")
_WHY = "the GAN's networks are plain MLPs: they have no tokenizer, LoRA adapters or gradient checkpointing"


@dataclass(frozen=True)
class GANEval(Settings):
    every: int = setting(200, "also evaluate every N steps (0 = only before and after)", Range(0))
    size: int = setting(2048, "generated points scored at each evaluation (the same noise every time)", Range(1))


@dataclass(frozen=True)
class GANExport(Settings):
    enabled: bool = setting(True, "export/gen: model.safetensors + config.json")


@dataclass(frozen=True)
class GANConfig(RunConfig):
    output_dir: str = setting("outputs/gan", "everything the run writes goes under this folder")
    max_steps: int = setting(800, "generator steps (each after gan.d_steps discriminator steps)", Range(1))
    gan: GANSettings = section(GANSettings, "the two networks and the target distribution")
    eval: GANEval = section(GANEval, "sample quality on a fixed evaluation noise")
    export: GANExport = section(GANExport, "what the run writes under output_dir/export")


def load_mlp(folder: str) -> MLP:
    """A network this recipe exported: ``config.json`` gives its shape, ``model.safetensors`` its weights."""
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json")) as f:
        shape = json.load(f)
    model = MLP(shape["inputs"], shape["width"], shape["outputs"], shape["depth"])
    model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")))
    return model


class GAN(Recipe):
    name = "gan"
    roles = (Role("gen", "the generator: noise -> a point", trainable=True, defaults={**_NETWORK, "stage": 2},
                  omit=_NOT_HERE, why=_WHY),
             Role("disc", "the discriminator: a point -> one logit", trainable=True,
                  defaults={**_NETWORK, "stage": 3}, omit=_NOT_HERE, why=_WHY))
    Config = GANConfig
    postfix_keys = ("d_loss", "g_loss")
    headline = (("high_quality", "share of generated points near a mode", True),
                ("mode_coverage", "share of the ring's modes covered", True))
    plot_panels = [("losses", ["train/d_loss", "train/g_loss"]),
                   ("sample quality", ["eval/high_quality", "eval/mode_coverage"])]

    @classmethod
    def validate(cls, cfg: GANConfig, world_size: int = 1) -> None:
        """A given model folder holds an export of this recipe with the shape the config asks for."""
        for name in ("gen", "disc"):
            folder = cfg.roles[name].model
            if not folder:
                continue
            key, path = f"roles.{name}.model", os.path.join(folder, "config.json")
            if not os.path.isfile(path):
                raise config_problem(key, folder, "has no config.json", f"give a folder this recipe exported "
                                     f"(export/{name}), or set {key}=\"\" for a new network")
            with open(path) as f:
                saved = json.load(f)
            if saved != cfg.gan.shape(name):
                raise config_problem(key, folder, f"holds a network of shape {saved}, the config asks for "
                                     f"{cfg.gan.shape(name)}", "set gan.noise_dim/width/depth to the saved shape")

    @classmethod
    def plan(cls, cfg: GANConfig, assume: Any = None) -> list[plans.RecipePlan]:
        with torch.device("meta"):
            infos = {name: plans.module_info(name, MLP(**cfg.gan.shape(name))) for name in ("gen", "disc")}
        return [plans.declared_roles(cfg, infos, title="gan",
                                     notes=["two MLPs of gan.width x gan.depth; activations are negligible"])]

    def build(self) -> None:
        cfg, registry, g = self.cfg, self.registry, self.cfg.gan
        # 1. one role per network, each with its own placement and optimizer
        for name in ("gen", "disc"):
            role, shape = cfg.roles[name], g.shape(name)
            build = (lambda f=role.model: load_mlp(f)) if role.model else (lambda sh=shape: MLP(**sh))
            registry.add(role.spec(build, total_steps=cfg.max_steps, seed=cfg.seed))
        registry.build()
        self.modes = ring_modes(g.modes, g.radius)
        # 2. the evaluation noise: drawn once, the same on every rank and at every evaluation
        self.eval_noise = torch.randn(cfg.eval.size, g.noise_dim, generator=registry.generator(0, "eval", rank=0))

    def _noise(self, rows: int, salt: str) -> torch.Tensor:
        return torch.randn(rows, self.cfg.gan.noise_dim, generator=self.registry.generator(self.step, salt))

    def train_step(self) -> dict[str, float]:
        registry, g, roles = self.registry, self.cfg.gan, self.cfg.roles
        gen, disc = registry["gen"], registry["disc"]
        d_losses, g_losses = [], []
        # 1. the discriminator: real rows against detached fakes, its own backward and step
        for k in range(g.d_steps * disc.gradient_accumulation_steps()):
            rows = roles.disc.micro_batch_size
            real = sample_ring(rows, g.modes, g.radius, g.std, registry.generator(self.step, f"real{k}"))
            with torch.no_grad():
                fake = gen(self._noise(rows, f"d{k}").to(registry.device))
            d_loss = discriminator_loss(disc(real.to(registry.device)), disc(fake))
            disc.backward(d_loss)
            disc.step()
            d_losses.append(d_loss.item())
        # 2. the generator: its loss flows through the discriminator, which gets no gradient from it
        for k in range(gen.gradient_accumulation_steps()):
            z = self._noise(roles.gen.micro_batch_size, f"g{k}").to(registry.device)
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
                json.dump(self.cfg.gan.shape("gen"), f)

        return {"gen": save_role(self.registry, "gen", self.path("export", "gen"), extra_files=shape_file)}

    def summary_metrics(self) -> dict[str, Any]:
        return self.eval_figures(("high_quality", "mode_coverage", "mode_distance"))


RECIPE = GAN

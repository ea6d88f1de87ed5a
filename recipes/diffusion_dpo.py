"""Diffusion-DPO (Wallace et al., 2024) of a text-to-image denoiser on preference pairs against a frozen reference
copy of its starting weights. ``multiengine run diffusion_dpo --config tiny --nproc-per-node 2``; docs/diffusion-rl.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import barrier
from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.diffusion import rl
from multiengine.pipelines.diffusion.export import ExportSettings
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.rl_runs import (
    DPOEval,
    PolicyModel,
    PreferenceData,
    RLModelSettings,
    make_shapes_preference_pairs,
    preference_split,
    rl_export,
    rl_model,
    rl_specs,
)
from multiengine.pipelines.diffusion.runs import first_last, step_record
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.recipes import diffusion_parts as parts
from multiengine.recipes.diffusion_parts import POLICY, refuse, rl_roles, unset
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig


@dataclass(frozen=True)
class DiffusionDPOConfig(RunConfig):
    output_dir: str = setting("outputs/diffusion_dpo", "everything the run writes goes under this folder")
    max_steps: int = setting(60, "optimizer steps", Range(1))
    model: RLModelSettings = section(RLModelSettings, "the diffusers pipeline whose denoiser is trained")
    dpo: rl.DiffusionDPOSettings = section(rl.DiffusionDPOSettings, "the objective")
    data: PreferenceData = section(PreferenceData, "preference pairs (prompt, chosen, rejected)")
    eval: DPOEval = section(DPOEval, "implicit reward accuracy on held-out pairs (fixed noise and timesteps)")
    export: ExportSettings = section(ExportSettings, "what the run writes under output_dir/export")


class DiffusionDPO(Recipe):
    """The policy (a denoiser) against its frozen starting copy (ref) on preference pairs, with the vae and text
    encoders frozen."""

    name = "diffusion_dpo"
    roles = rl_roles(
        {**POLICY, "lr": 1e-4, "micro_batch_size": Key(16, "preference pairs per rank per forward (2x images)"),
         "grad_accum": Key(1, "micro batches per optimizer step")},
        "frozen reference: the policy's starting weights (a separate copy, also with LoRA)",
        vae="frozen: latents of the chosen and rejected images")
    Config = DiffusionDPOConfig
    postfix_keys = ("loss", "implicit_acc")
    headline = (("implicit_acc", "implicit reward accuracy on held-out pairs", True),)
    plot_panels = [("loss", ["train/loss"]), ("implicit accuracy", ["train/implicit_acc", "eval/implicit_acc"])]

    @classmethod
    def validate(cls, cfg: DiffusionDPOConfig, world_size: int = 1) -> None:
        """Model folder and resolution, the family's keys, the pair data (columns, enough rows for the held-out
        split)."""
        parts.check_rl_model(cls, cfg)
        if cfg.data.eval_source:
            refuse(unset(cfg.eval, ("size",), "eval", "applies to pairs held out of data.source, and "
                         "data.eval_source is given"))
        rows = cfg.data.rows()
        if (rows if cfg.data.eval_source else rows - cfg.eval.size) < 1:
            raise config_problem("eval.size", cfg.eval.size, f"holds out every one of the {rows} pairs",
                                 f"set eval.size below {rows} or give data.eval_source")

    @classmethod
    def check_family(cls, cfg: DiffusionDPOConfig, family: str, where: str = "") -> None:
        """The keys of a text encoder or denoiser this family has not, and the dpo options it has no use for, are
        refused."""
        unused = {} if family == "flux" else unset(cfg.dpo, ("guidance_scale",), "dpo", "is FLUX's guidance input; "
                                                                                        f"this {family} model has none")
        if family_roles(family).objective != "flow":
            unused.update(unset(cfg.dpo, ("max_sequence_length",), "dpo", f"is the T5 length of SD3/FLUX; this "
                                                                          f"{family} model has no T5"))
        parts.check_family(cls, cfg, parts.absent_roles(cfg, family), unused, where)

    @classmethod
    def role_specs(cls, cfg: DiffusionDPOConfig, family: str, model_path: str) -> list[Any]:
        return rl_specs(cfg, family, model_path, rows=2)  # a pair is a chosen and a rejected image

    describe = classmethod(parts.describe)

    @classmethod
    def plan(cls, cfg: DiffusionDPOConfig, assume: Any = None) -> list[plans.RecipePlan]:
        pairs = 2 * cfg.roles.policy.micro_batch_size  # chosen and rejected images
        return parts.rl_plan(cfg, assume, cls.name, pairs, f"{pairs // 2} preference pairs per rank: {pairs} images "
                             "per forward", res=cfg.data.resolution, t5_tokens=cfg.dpo.max_sequence_length)

    def build(self) -> None:
        cfg, registry, data = self.cfg, self.registry, self.cfg.data
        # 1. the model folder (the tiny pipeline built and pretrained here when model.pretrained is empty); the
        #    family's checks again (a hub name's is known only now)
        self.model_path, done = rl_model(cfg, registry, self.path(f"tiny_{cfg.model.tiny_family}"),
                                         self.path("data", "shapes"), data.resolution)
        self.vae_pretrain, self.family = done["vae"], model_family(self.model_path)
        self.check_family(cfg, self.family, self.model_path)
        # 2. the policy, the ref, the vae and the text encoders, each its own engine
        for spec in self.role_specs(cfg, self.family, self.model_path):
            registry.add(spec)
        registry.build()
        self.pm = PolicyModel(registry, self.model_path, self.family, resolution=data.resolution,
                              guidance_scale=cfg.dpo.guidance_scale, t5_tokens=cfg.dpo.max_sequence_length)
        # 3. the pairs: data.source, or shapes pairs that rank 0 draws; the held-out split
        source = os.path.expanduser(data.source)
        if not source:
            source = self.path("data", "pairs", "pairs.jsonl")
            if registry.is_main:
                make_shapes_preference_pairs(os.path.dirname(source), data.builtin_size, data.resolution, cfg.seed,
                                             list(data.shapes_colors))
            barrier()
        self.train_pairs, self.held = preference_split(source, data.eval_source, cfg.eval.size, data.resolution,
                                                       **data.options())

    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        policy = registry["policy"]
        prompts_all, chosen_all, rejected_all = self.train_pairs
        records = []
        for micro in range(cfg.roles.policy.grad_accum):
            # 1. this rank's pairs and all randomness from (seed, step, micro, rank): resumable without a stream
            g = step_generator(cfg.seed, self.step, micro, registry.rank)
            idx = torch.randint(0, len(prompts_all), (cfg.roles.policy.micro_batch_size,), generator=g)
            prompts = [prompts_all[i] for i in idx.tolist()]
            state = g.get_state()
            # 2. the policy's and the reference's predictions on the same latents, noise and timesteps
            pred, target = self.pm.pair_predictions("policy", prompts, chosen_all[idx], rejected_all[idx], g)
            g.set_state(state)
            with torch.no_grad():
                ref_pred, _ = self.pm.pair_predictions("ref", prompts, chosen_all[idx], rejected_all[idx], g)
            # 3. the Diffusion-DPO loss; backward and step through the policy engine
            loss, stats = rl.diffusion_dpo_loss(pred, ref_pred, target, cfg.dpo.beta)
            policy.backward(loss)
            policy.step()
            records.append({"loss": loss.item(), "implicit_acc": float(stats.implicit_acc),
                            "model_mse": float(stats.model_mse), "ref_mse": float(stats.ref_mse)})
        return step_record(registry, records, "policy")

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Every rank scores every held-out pair at eval.timesteps evenly spaced timesteps with fixed noise: the
        policy's and the reference's mean denoising losses, the implicit reward margin and its accuracy."""
        e = self.cfg.eval
        mw, ml = self.pm.pair_losses("policy", *self.held, timesteps=e.timesteps, seed=e.seed)
        rw, rl_ = self.pm.pair_losses("ref", *self.held, timesteps=e.timesteps, seed=e.seed)
        _, stats = rl.diffusion_dpo_loss_from_losses(mw, ml, rw, rl_, self.cfg.dpo.beta)
        return {"implicit_acc": float(stats.implicit_acc), "margin": float(stats.margin.mean()),
                "chosen_preferred": float((mw < ml).float().mean()), "policy_mse": float(stats.model_mse)}

    def export(self) -> dict[str, Any]:
        """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy."""
        return rl_export(self.registry, self.cfg, self.path("export"), self.model_path, self.family)

    def summary_metrics(self) -> dict[str, Any]:
        return {**first_last(self.step_metrics, "loss"),
                **self.eval_figures(("implicit_acc", "margin", "chosen_preferred"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"family": self.family, "model_path": self.model_path, "heldout_pairs": len(self.held[0]),
                "train_pairs": len(self.train_pairs[0]), "tiny_vae_pretrain": self.vae_pretrain}


RECIPE = DiffusionDPO

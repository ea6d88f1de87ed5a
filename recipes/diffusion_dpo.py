"""Diffusion-DPO (Wallace et al., 2024) of a text-to-image denoiser on preference pairs (prompt, chosen image,
rejected image), against a frozen reference copy of its starting weights.

    multiengine run diffusion_dpo --config tiny --nproc-per-node 2
    multiengine run diffusion_dpo --config sdxl --nproc-per-node 8
    multiengine plan diffusion_dpo --config sdxl --gpus 8 --gpu-mem 80GiB

Roles: ``policy`` (the SD/SDXL unet or the SD3/FLUX transformer; full or LoRA), ``ref`` (frozen, its starting
weights), the ``vae`` and each text encoder (frozen). Data: ``data.source`` (``""`` = shapes pairs: chosen in the
prompt's colour, rejected in another). Reports the implicit reward accuracy on held-out pairs; writes
export/policy (a diffusers pipeline folder; export/lora for LoRA). docs/diffusion-rl.md has the details.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from multiengine.engines import barrier
from multiengine.engines.recipe_config import Key, Length, Range, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS
from multiengine.engines.role_schema import role_keys
from multiengine.pipelines.diffusion import rl
from multiengine.pipelines.diffusion.rl_runs import (
    make_shapes_preference_pairs,
    preference_source,
    preference_split,
)
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.recipes import diffusion_keys as shared
from multiengine.recipes import plans
from multiengine.recipes.diffusion_base import DiffusionRoles, first_last, step_record

ROLES = shared.rl_roles(
    {**shared.POLICY, "lr": 1e-4, "micro_batch_size": Key(16, "preference pairs per rank per forward (2x images)"),
     "grad_accum": Key(1, "micro batches per optimizer step")},
    "frozen reference: the policy's starting weights (a separate copy, also with LoRA)",
    vae="frozen: latents of the chosen and rejected images")
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/diffusion_dpo", "everything the run writes goes under this folder"),
    "max_steps": Key(60, "optimizer steps"),
    "model": shared.RL_MODEL_KEYS,
    "roles": role_keys(ROLES),
    "dpo": Key({
        "beta": Key(5000.0, "Diffusion-DPO's beta (diffusers' script: 2500 for SD 1.5, 5000 for SDXL)",
                    Range(0, min_exclusive=True)),
        "guidance_scale": Key(1.0, "FLUX only: its guidance input while training"),
        "max_sequence_length": Key(0, "SD3/FLUX: T5 tokens per prompt (0 = the family's)"),
    }, "the objective"),
    "data": Key({
        "source": Key("", "preference pairs: a data file, save_to_disk folder or hub name; \"\" = shapes pairs"),
        "columns": Key({"prompt": Key("prompt", "your prompt column"), "chosen": Key("chosen", "your chosen "
                        "image column"), "rejected": Key("rejected", "your rejected image column")},
                       "your column names per field"),
        "split": Key("train", "the split of a hub dataset or DatasetDict folder"),
        "eval_source": Key("", "held-out pairs (same forms); \"\" = the last eval.size rows of data.source"),
        "resolution": Key(16, "image side in pixels (resized, center-cropped)"),
        "builtin_size": Key(256, "pairs generated for the shapes task"),
        "shapes_colors": Key(["red"], "shapes pairs: the chosen image (and the prompt) has one of these colours; "
                                      "[] = all six"),
        "cache_dir": Key("", "datasets cache folder (\"\" = the default)"),
    }, "preference pairs (prompt, chosen, rejected)"),
    "eval": Key({
        "every": Key(0, "also evaluate every N steps (0 = only before and after)"),
        "size": Key(32, "held-out pairs taken from data.source when data.eval_source is \"\"", Range(1)),
        "timesteps": Key(4, "evenly spaced timesteps per held-out pair"),
        "seed": Key(1234, "the held-out noise's seed"),
    }, "implicit reward accuracy on held-out pairs (fixed noise and timesteps)"),
    "export": shared.RL_EXPORT_KEYS,
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = {"data.columns.*": Length(1)}


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder and resolution, component folders, the pair data (columns, enough rows for the held-out
    split and a micro batch)."""
    shared.check_rl_model(cfg, "data.resolution")
    rows = int(cfg.data.builtin_size)
    if cfg.data.source:
        try:
            rows = len(preference_source(str(cfg.data.source), **_load(cfg))[0])
        except (ValueError, FileNotFoundError) as exc:
            raise config_problem("data.source", cfg.data.source, f"cannot be used as preference pairs: {exc}",
                                 "give a file or dataset with prompt/chosen/rejected columns (data.columns)") from None
    train = rows if cfg.data.eval_source else rows - int(cfg.eval.size)
    if train < 1:
        raise config_problem("eval.size", cfg.eval.size, f"holds out every one of the {rows} pairs",
                             f"set eval.size below {rows} or give data.eval_source")


def _load(cfg: Any) -> dict[str, Any]:
    """How the data section reads preference rows (preference_source's options)."""
    return {"columns": {k: str(v) for k, v in cfg.data.columns.items()}, "split": str(cfg.data.split),
            "cache_dir": str(cfg.data.cache_dir) or None}


class DiffusionDPO(DiffusionRoles):
    name = "diffusion_dpo"
    roles = ROLES
    postfix_keys = ("loss", "implicit_acc")
    headline = (("implicit_acc", "implicit reward accuracy on held-out pairs", True),)
    plot_panels = [("loss", ["train/loss"]), ("implicit accuracy", ["train/implicit_acc", "eval/implicit_acc"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        res = int(cfg.data.resolution)
        self.add_denoisers(res, True, cfg.max_steps, int(cfg.roles.policy.grad_accum))
        registry.build()
        self.pm = self.policy_model(res, float(cfg.dpo.guidance_scale), int(cfg.dpo.max_sequence_length))
        source = os.path.expanduser(str(cfg.data.source))
        if not source:
            source = self.path("data", "pairs", "pairs.jsonl")
            if registry.is_main:
                make_shapes_preference_pairs(os.path.dirname(source), int(cfg.data.builtin_size), res, cfg.seed,
                                             [str(c) for c in cfg.data.shapes_colors])
            barrier()
        self.train_pairs, self.held = preference_split(source, str(cfg.data.eval_source), int(cfg.eval.size), res,
                                                       **_load(cfg))

    def train_step(self) -> dict[str, float]:
        cfg, registry = self.cfg, self.registry
        policy = registry["policy"]
        prompts_all, chosen_all, rejected_all = self.train_pairs
        records = []
        for micro in range(int(cfg.roles.policy.grad_accum)):
            # 1. this rank's pairs and all randomness from (seed, step, micro, rank): resumable without a stream
            g = step_generator(cfg.seed, self.step, micro, registry.rank)
            idx = torch.randint(0, len(prompts_all), (int(cfg.roles.policy.micro_batch_size),), generator=g)
            prompts = [prompts_all[i] for i in idx.tolist()]
            state = g.get_state()
            # 2. the policy's and the reference's predictions on the same latents, noise and timesteps
            pred, target = self.pm.pair_predictions("policy", prompts, chosen_all[idx], rejected_all[idx], g)
            g.set_state(state)
            with torch.no_grad():
                ref_pred, _ = self.pm.pair_predictions("ref", prompts, chosen_all[idx], rejected_all[idx], g)
            # 3. the Diffusion-DPO loss; backward and step through the policy engine
            loss, stats = rl.diffusion_dpo_loss(pred, ref_pred, target, float(cfg.dpo.beta))
            policy.backward(loss)
            policy.step()
            records.append({"loss": loss.item(), "implicit_acc": float(stats.implicit_acc),
                            "model_mse": float(stats.model_mse), "ref_mse": float(stats.ref_mse)})
        return step_record(registry, records, "policy")

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Every rank scores every held-out pair at eval.timesteps evenly spaced timesteps with fixed noise: the
        policy's and the reference's mean denoising losses, the implicit reward margin and its accuracy."""
        cfg = self.cfg
        timesteps, seed = int(cfg.eval.timesteps), int(cfg.eval.seed)
        mw, ml = self.pm.pair_losses("policy", *self.held, timesteps=timesteps, seed=seed)
        rw, rl_ = self.pm.pair_losses("ref", *self.held, timesteps=timesteps, seed=seed)
        _, stats = rl.diffusion_dpo_loss_from_losses(mw, ml, rw, rl_, float(cfg.dpo.beta))
        return {"implicit_acc": float(stats.implicit_acc), "margin": float(stats.margin.mean()),
                "chosen_preferred": float((mw < ml).float().mean()), "policy_mse": float(stats.model_mse)}

    def summary_metrics(self) -> dict[str, Any]:
        return {**first_last(self.step_metrics, "loss"),
                **self.eval_figures(("implicit_acc", "margin", "chosen_preferred"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"family": self.family, "model_path": self.model_path, "heldout_pairs": len(self.held[0]),
                "train_pairs": len(self.train_pairs[0]), "tiny_vae_pretrain": self.vae_pretrain}


main = DiffusionDPO.main
plan = plans.diffusion_dpo  # what `multiengine plan` sees of this recipe

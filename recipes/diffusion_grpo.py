"""Online RL of a text-to-image denoiser (DDPO / Flow-GRPO): sample groups of images per prompt with a
stochastic sampler that records each step's log-probability, score them, and step the policy on a clipped
importance-ratio objective with group-relative advantages and an optional KL to a frozen reference.

    multiengine run diffusion_grpo --config tiny --nproc-per-node 2
    multiengine run diffusion_grpo --config sd3_medium --nproc-per-node 8
    multiengine plan diffusion_grpo --config flux_lora --gpus 8 --gpu-mem 80GiB

Roles: ``policy`` (the SD/SDXL unet or the SD3/FLUX transformer; full or LoRA), ``ref`` (a separate frozen copy
of its starting weights, when ``diffusion.kl_coef > 0``), ``reward`` (when ``reward.functions`` lists
``reward_model``), the ``vae`` and each text encoder (frozen). Unets sample with DDIM at ``diffusion.eta``
(DDPO), flow families with Flow-GRPO's SDE at ``diffusion.noise_level``. Writes grids/ of held-out images and
export/policy (a diffusers pipeline folder; export/lora for LoRA). docs/diffusion-rl.md has the details.
"""

from __future__ import annotations

from typing import Any

import torch
from multiengine.engines import frozen_role
from multiengine.engines.recipe_config import Choice, Each, Key, Length, Range, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS
from multiengine.engines.role_schema import Role, placement, role_keys
from multiengine.pipelines.diffusion import rl
from multiengine.pipelines.diffusion.inputs import check_config_folder, check_prompts, check_rewards
from multiengine.pipelines.diffusion.rl_runs import (
    BUILTIN_REWARDS,
    REWARD_MODEL,
    load_reward_model_role,
    read_prompts,
    reward_functions,
    reward_grid,
    score_images,
    shapes_prompt_split,
    tiny_reward_model,
)
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.recipes import diffusion_keys as shared
from multiengine.recipes import plans
from multiengine.recipes.diffusion_base import DiffusionRoles, first_last, step_record

ROLES = shared.rl_roles(
    shared.POLICY, "frozen reference for the KL term (built when diffusion.kl_coef > 0): a separate copy of the "
    "policy's starting weights, with LoRA too",
    Role("reward", "the frozen reward model (reward.functions lists reward_model); model \"\" = the tiny shapes "
         "CNN trained here", keys={**shared.FROZEN}), vae="frozen: decodes the sampled latents")
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/diffusion_grpo", "everything the run writes goes under this folder"),
    "max_steps": Key(60, "optimizer steps (each after grad_accum rollouts)"),
    "model": shared.RL_MODEL_KEYS,
    "roles": role_keys(ROLES),
    "diffusion": Key({
        "resolution": Key(16, "image side in pixels"),
        "num_inference_steps": Key(4, "sampler steps per image"),
        "eta": Key(1.0, "unet families: DDIM noise (> 0; DDPO uses 1.0)", Range(0, min_exclusive=True)),
        "noise_level": Key(0.7, "flow families: SDE noise level (> 0; Flow-GRPO uses 0.7)",
                           Range(0, min_exclusive=True)),
        "guidance_scale": Key(1.0, "CFG scale while sampling (1 = none); FLUX: its guidance input"),
        "group_size": Key(8, "images per prompt (advantages are relative to the group)", Range(2)),
        "advantage_std": Key("global", "group | global (the batch's std, Flow-GRPO's base config) | none (Dr. GRPO)",
                             Choice("group", "global", "none")),
        "clip_range": Key(1e-4, "importance-ratio clip (DDPO, Flow-GRPO)", Range(0, min_exclusive=True)),
        "adv_clip_max": Key(5.0, "advantages clamped to [-x, x]", Range(0, min_exclusive=True)),
        "kl_coef": Key(0.01, "weight of the KL to roles.ref (0 = no ref role)"),
        "train_timestep_fraction": Key(0.5, "fraction of each trajectory's steps trained on",
                                       Range(0, 1, min_exclusive=True)),
        "train_noisiest": Key(True, "true: the noisiest steps first; false: a random subset per image (DDPO)"),
    }, "sampling and the policy objective"),
    "reward": Key({
        "functions": Key(["color", REWARD_MODEL], f"rewards summed: builtins {', '.join(BUILTIN_REWARDS)}, or "
                                                  "module:function fn(prompts, images [N,3,H,W] in [0,1]) -> list",
                         Each(Length(1))),
        "weights": Key([0.8, 0.2], "one weight per function ([] = 1 each)"),
        "model_steps": Key(300, "tiny reward model (roles.reward.model \"\"): its training steps", Range(1)),
    }, "what the sampled images are scored with"),
    "prompts": Key({
        "train_file": Key("", "training prompts: .txt (one per line) or .json/.jsonl (prompt field); \"\" = the "
                              "shapes captions not held out"),
        "eval_file": Key("", "held-out prompts (same forms); \"\" = eval.size shapes captions"),
        "shapes_colors": Key(["red"], "the shapes captions used (train and held out) name these colours; [] = all six"),
    }, "prompts sampled for rollouts and held out for evaluation"),
    "eval": Key({
        "every": Key(0, "also evaluate every N steps (0 = only before and after)"),
        "size": Key(3, "held-out shapes captions when prompts.eval_file is \"\"", Range(1)),
        "images_per_prompt": Key(8, "images per held-out prompt (fixed noise)", Range(1)),
        "reward": Key("color", "the evaluation reward (a builtin or module:function); \"\" = the training rewards"),
        "seed": Key(1234, "the held-out noise's seed"),
        "grid": Key(True, "grids/ of the held-out images labelled with prompt and reward (before, after)"),
    }, "mean reward of held-out prompts at fixed noise"),
    "export": shared.RL_EXPORT_KEYS,
}
DEFAULTS, HELP = split_keys(KEYS)


def validate(cfg: Any, world_size: int = 1) -> None:
    """The model folder and family, component folders, resolution, the batch (micro batch = prompts x
    group_size), the reward functions import, the prompt files and the reward-model folder; before any rank
    starts."""
    shared.check_rl_model(cfg, "diffusion.resolution")
    d = cfg.diffusion
    micro = int(cfg.roles.policy.micro_batch_size)
    if micro % int(d.group_size):
        raise config_problem("roles.policy.micro_batch_size", micro, f"is not a multiple of diffusion.group_size="
                             f"{d.group_size} (each rank samples whole groups)",
                             f"set roles.policy.micro_batch_size={max(1, micro // d.group_size) * d.group_size}")
    if int(int(d.num_inference_steps) * float(d.train_timestep_fraction)) < 1:
        raise config_problem("diffusion.train_timestep_fraction", d.train_timestep_fraction,
                             f"of {d.num_inference_steps} steps trains on no step",
                             f"use at least {1 / int(d.num_inference_steps):.3g}")
    check_rewards([str(n) for n in cfg.reward.functions], list(cfg.reward.weights), str(cfg.eval.reward))
    check_config_folder("roles.reward.model", str(cfg.roles.reward.model), "a tiny reward model folder",
                        "give a folder written by save_tiny_reward_model, or \"\" to train one")
    check_prompts({f"prompts.{k}": str(cfg.prompts[k]) for k in ("train_file", "eval_file")}, int(cfg.eval.size),
                  [str(c) for c in cfg.prompts.shapes_colors])


class DiffusionGRPO(DiffusionRoles):
    name = "diffusion_grpo"
    roles = ROLES
    postfix_keys = ("reward", "policy_loss")
    headline = (("reward", "mean reward of held-out prompts", True),)
    plot_panels = [("reward", ["train/reward", "eval/reward"]), ("policy", ["train/policy_loss", "train/kl"]),
                   ("ratio", ["train/clipfrac", "train/approx_kl"])]

    def build(self) -> None:
        cfg, registry, d = self.cfg, self.registry, self.cfg.diffusion
        self.trained_steps = int(int(d.num_inference_steps) * float(d.train_timestep_fraction))
        accum = int(cfg.roles.policy.grad_accum) * self.trained_steps
        self.uses_ref = float(d.kl_coef) > 0
        self.add_denoisers(int(d.resolution), self.uses_ref, cfg.max_steps, accum)
        names = [str(n) for n in cfg.reward.functions]
        if REWARD_MODEL in names:  # roles.reward.model "" = the tiny shapes CNN, trained here by rank 0
            folder = str(cfg.roles.reward.model) or tiny_reward_model(
                self.path("tiny_reward"), resolution=int(d.resolution), steps=int(cfg.reward.model_steps),
                seed=cfg.seed, is_main=registry.is_main)
            registry.add(frozen_role("reward", lambda: load_reward_model_role(folder),
                                     placement(cfg, ROLES, "reward")))
        registry.build()
        self.rewards = reward_functions(names, list(cfg.reward.weights), registry)
        ev = str(cfg.eval.reward)
        self.eval_rewards = reward_functions([ev], [1.0], registry) if ev else self.rewards
        self.pm = self.policy_model(int(d.resolution), float(d.guidance_scale))
        self.sampler = self.pm.sampler(int(d.num_inference_steps), float(d.eta), float(d.noise_level))
        train, held = shapes_prompt_split(int(cfg.eval.size), cfg.seed, [str(c) for c in cfg.prompts.shapes_colors])
        self.train_prompts = read_prompts(str(cfg.prompts.train_file)) if cfg.prompts.train_file else train
        self.eval_prompts = read_prompts(str(cfg.prompts.eval_file)) if cfg.prompts.eval_file else held
        self.grids: list[str] = []

    def train_step(self) -> dict[str, float]:
        cfg, registry, d = self.cfg, self.registry, self.cfg.diffusion
        policy = registry["policy"]
        group = int(d.group_size)
        records: list[dict[str, float]] = []
        for micro in range(int(cfg.roles.policy.grad_accum)):
            # 1. this rank's prompts (whole groups) and all randomness from (seed, step, micro, rank): resumable
            g = step_generator(cfg.seed, self.step, micro, registry.rank)
            count = int(cfg.roles.policy.micro_batch_size) // group
            picks = torch.randint(0, len(self.train_prompts), (count,), generator=g).tolist()
            prompts = [self.train_prompts[i] for i in picks for _ in range(group)]
            # 2. sample with the current policy, recording every step's log-probability; decode; score
            trajectory, cond, images = self.pm.rollout(prompts, self.sampler, g)
            rewards, means = score_images(self.rewards, prompts, images)
            # 3. group-relative advantages (a group of equal rewards gets 0)
            adv = rl.group_advantages(rewards, group, std=str(d.advantage_std)).to(registry.device)
            steps = rl.train_step_indices(len(prompts), self.sampler.num_steps, float(d.train_timestep_fraction), g,
                                          shuffle=not d.train_noisiest).to(registry.device)
            rows = torch.arange(len(prompts), device=registry.device)
            # 4. per trained step: re-score under the policy (and the ref), clipped loss + KL, backward; the engine
            #    steps once all grad_accum x trained steps are accumulated
            for k in range(steps.shape[1]):
                j = steps[:, k]
                now = rl.rescore(self.pm.denoiser("policy", cond), self.sampler, trajectory, j)
                ref = rl.rescore(self.pm.denoiser("ref", cond), self.sampler, trajectory, j) if self.uses_ref else None
                loss, stats = rl.diffusion_grpo_loss(
                    now.log_prob, trajectory.log_probs[rows, j], adv, float(d.clip_range),
                    adv_clip_max=float(d.adv_clip_max), kl_coef=float(d.kl_coef), prev_sample_mean=now.prev_sample_mean,
                    ref_prev_sample_mean=None if ref is None else ref.prev_sample_mean, std=now.noise_std)
                policy.backward(loss)
                policy.step()
                records.append({"loss": loss.item(), **{k2: float(v) for k2, v in stats.items()}})
            records[-1].update({"reward": float(rewards.mean()), **{f"reward/{n}": v for n, v in means.items()}})
        return step_record(registry, records, "policy")

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Every rank samples the same held-out images (fixed noise and sampler draws) and scores them."""
        cfg = self.cfg
        n = int(cfg.eval.images_per_prompt)
        prompts = [p for p in self.eval_prompts for _ in range(n)]
        _, _, images = self.pm.rollout(prompts, self.sampler, torch.Generator().manual_seed(int(cfg.eval.seed)))
        rewards, means = score_images(self.eval_rewards, prompts, images)
        result: dict[str, Any] = {"reward": float(rewards.mean()), **{f"reward/{k}": v for k, v in means.items()}}
        if cfg.eval.grid and tag in ("before", "after") and self.registry.is_main:
            path = self.path("grids", f"{self.step:06d}_{tag}.png")
            grid = reward_grid(images, prompts, rewards.tolist(), self.step, per_prompt=n, path=path)
            self.metrics.log_image(self.step, "eval/grid", grid)
            self.grids.append(path)
        return result

    def summary_metrics(self) -> dict[str, Any]:
        return {**first_last(self.step_metrics, "reward"), **self.eval_figures(("reward",))}

    def summary_extra(self) -> dict[str, Any]:
        return {"family": self.family, "model_path": self.model_path, "grids": self.grids,
                "trained_steps_per_image": self.trained_steps, "ref": self.uses_ref,
                "eval_prompts": self.eval_prompts, "tiny_vae_pretrain": self.vae_pretrain,
                "tiny_unet_pretrain": self.unet_pretrain}


main = DiffusionGRPO.main
plan = plans.diffusion_grpo  # what `multiengine plan` sees of this recipe

"""Online RL of a text-to-image denoiser (DDPO / Flow-GRPO): groups of images per prompt sampled with recorded
log-probabilities, scored, and a clipped importance-ratio step with group-relative advantages and an optional KL
to a frozen reference. ``multiengine run diffusion_grpo --config tiny --nproc-per-node 2``; docs/diffusion-rl.md."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.diffusion import rl
from multiengine.pipelines.diffusion.export import ExportSettings
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.inputs import check_config_folder
from multiengine.pipelines.diffusion.rl_runs import (
    REWARD_MODEL,
    GRPOEval,
    PolicyModel,
    PromptSettings,
    RewardSettings,
    RLModelSettings,
    load_reward_model_role,
    reward_functions,
    reward_grid,
    rl_export,
    rl_model,
    rl_specs,
    rollout_advantages,
    score_images,
    tiny_reward_model,
)
from multiengine.pipelines.diffusion.runs import first_last, step_record
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.recipes import diffusion_parts as parts
from multiengine.recipes.diffusion_parts import FROZEN, POLICY, refuse, rl_roles, unset
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class DiffusionGRPOConfig(RunConfig):
    output_dir: str = setting("outputs/diffusion_grpo", "everything the run writes goes under this folder")
    max_steps: int = setting(60, "optimizer steps (each after grad_accum rollouts)", Range(1))
    model: RLModelSettings = section(RLModelSettings, "the diffusers pipeline whose denoiser is trained")
    diffusion: rl.DiffusionGRPOSettings = section(rl.DiffusionGRPOSettings, "sampling and the policy objective")
    reward: RewardSettings = section(RewardSettings, "what the sampled images are scored with")
    prompts: PromptSettings = section(PromptSettings, "prompts sampled for rollouts and held out for evaluation")
    eval: GRPOEval = section(GRPOEval, "mean reward of held-out prompts at fixed noise")
    export: ExportSettings = section(ExportSettings, "what the run writes under output_dir/export")


class DiffusionGRPO(Recipe):
    """The policy (a denoiser) sampled, scored and stepped on group-relative advantages, with a frozen ref for the
    KL term, the reward model where listed, and the vae and text encoders frozen."""

    name = "diffusion_grpo"
    roles = rl_roles(
        POLICY, "frozen reference for the KL term (built when diffusion.kl_coef > 0): a separate copy of the policy's "
        "starting weights, with LoRA too",
        Role("reward", "the frozen reward model (reward.functions lists reward_model); model \"\" = the tiny shapes "
             "CNN trained here", defaults=FROZEN, omit=("tokenizer",), why="the reward model scores images"),
        vae="frozen: decodes the sampled latents")
    Config = DiffusionGRPOConfig
    postfix_keys = ("reward", "policy_loss")
    headline = (("reward", "mean reward of held-out prompts", True),)
    plot_panels = [("reward", ["train/reward", "eval/reward"]), ("policy", ["train/policy_loss", "train/kl"]),
                   ("ratio", ["train/clipfrac", "train/approx_kl"])]

    @classmethod
    def validate(cls, cfg: DiffusionGRPOConfig, world_size: int = 1) -> None:
        """The model folder and family, resolution, the batch (micro batch = prompts x group_size), the reward
        functions, the prompt files and the reward-model folder; before any rank starts."""
        parts.check_rl_model(cls, cfg, "diffusion.resolution")
        d, micro = cfg.diffusion, cfg.roles.policy.micro_batch_size
        if micro % d.group_size:
            raise config_problem("roles.policy.micro_batch_size", micro, f"is not a multiple of diffusion.group_size="
                                 f"{d.group_size} (each rank samples whole groups)",
                                 f"set roles.policy.micro_batch_size={max(1, micro // d.group_size) * d.group_size}")
        cfg.reward.check_functions(cfg.eval.reward)
        check_config_folder("roles.reward.model", cfg.roles.reward.model, "a tiny reward model folder",
                            "give a folder written by save_tiny_reward_model, or \"\" to train one")
        if cfg.roles.reward.model:
            unused = unset(cfg.reward, ("model_steps",), "reward", "trains the tiny reward model, and "
                           "roles.reward.model is given")
        else:
            unused = unset(cfg.reward, ("model_steps",), "reward", "trains the tiny reward model, which "
                           "reward.functions does not list") if REWARD_MODEL not in cfg.reward.functions else {}
        if cfg.prompts.train_file and cfg.prompts.eval_file:
            unused.update(unset(cfg.eval, ("size",), "eval", "applies to the shapes captions, and both prompt "
                                                              "files are given"))
        refuse(unused)
        cfg.prompts.check_files(cfg.eval.size)

    @classmethod
    def uses_ref(cls, cfg: DiffusionGRPOConfig) -> bool:
        return cfg.diffusion.kl_coef > 0

    @classmethod
    def uses_reward_model(cls, cfg: DiffusionGRPOConfig) -> bool:
        return REWARD_MODEL in cfg.reward.functions

    @classmethod
    def check_family(cls, cfg: DiffusionGRPOConfig, family: str, where: str = "") -> None:
        """The keys of a role the run does not build (a text encoder or denoiser this family has not, the ref
        without the KL term, the reward model unless listed) and the other sampler's noise are refused."""
        absent = parts.absent_roles(cfg, family)
        if not cls.uses_ref(cfg):
            absent["ref"] = ("diffusion.kl_coef=0 builds no ref role", "drop roles.ref.{key}, or set diffusion.kl_coef")
        if not cls.uses_reward_model(cfg):
            absent["reward"] = ("reward.functions lists no reward_model: no reward role is built",
                                "drop roles.reward.{key}, or add reward_model to reward.functions")
        if family_roles(family).objective == "flow":
            unused = unset(cfg.diffusion, ("eta",), "diffusion", f"is DDIM's noise (unet families); this {family} "
                                                                 "model samples with diffusion.noise_level")
        else:
            unused = unset(cfg.diffusion, ("noise_level",), "diffusion", f"is the flow SDE's noise; this {family} "
                                                                         "model samples with DDIM at diffusion.eta")
        parts.check_family(cls, cfg, absent, unused, where)

    @classmethod
    def role_specs(cls, cfg: DiffusionGRPOConfig, family: str, model_path: str) -> list[Any]:
        """The policy (each rollout trains on its sampled steps, one backward each), the ref, the vae, the text
        encoders and the reward model (its folder, or the tiny one trained here)."""
        specs = rl_specs(cfg, family, model_path, accum=cfg.diffusion.trained_steps, ref=cls.uses_ref(cfg))
        if cls.uses_reward_model(cfg):
            folder = cfg.roles.reward.model or os.path.join(cfg.output_dir, "tiny_reward")
            specs.append(cfg.roles.reward.spec(lambda: load_reward_model_role(folder)))
        return specs

    @classmethod
    def describe(cls, cfg: DiffusionGRPOConfig) -> dict[str, Any]:
        return parts.describe(cls, cfg, "diffusion.resolution")

    @classmethod
    def plan(cls, cfg: DiffusionGRPOConfig, assume: Any = None) -> list[plans.RecipePlan]:
        from multiengine.pipelines.diffusion.rewards import TinyShapesRewardModel

        d, extra = cfg.diffusion, {}
        if cls.uses_reward_model(cfg):
            with torch.device("meta"):
                extra["reward"] = plans.module_info("reward", TinyShapesRewardModel())
        return parts.rl_plan(cfg, assume, cls.name, cfg.roles.policy.micro_batch_size, f"{d.num_inference_steps} "
                             f"sampling steps, group {d.group_size}", res=d.resolution, ref=cls.uses_ref(cfg),
                             extra=extra, guidance_scale=d.guidance_scale)

    def build(self) -> None:
        cfg, registry, d = self.cfg, self.registry, self.cfg.diffusion
        # 1. the model folder (the tiny pipeline built and pretrained here when model.pretrained is empty); the
        #    family's checks again (a hub name's is known only now); the tiny reward model, trained by rank 0
        self.model_path, done = rl_model(cfg, registry, self.path(f"tiny_{cfg.model.tiny_family}"),
                                         self.path("data", "shapes"), d.resolution)
        self.vae_pretrain, self.unet_pretrain, self.family = done["vae"], done["unet"], model_family(self.model_path)
        self.check_family(cfg, self.family, self.model_path)
        if self.uses_reward_model(cfg) and not cfg.roles.reward.model:
            tiny_reward_model(self.path("tiny_reward"), resolution=d.resolution, steps=cfg.reward.model_steps,
                              seed=cfg.seed, is_main=registry.is_main)
        # 2. the roles, each its own engine; the reward functions, the sampler, the prompts
        for spec in self.role_specs(cfg, self.family, self.model_path):
            registry.add(spec)
        registry.build()
        self.rewards = reward_functions(cfg.reward.functions, cfg.reward.weights, registry)
        ev = cfg.eval.reward
        self.eval_rewards = reward_functions([ev], [1.0], registry) if ev else self.rewards
        self.pm = PolicyModel(registry, self.model_path, self.family, resolution=d.resolution,
                              guidance_scale=d.guidance_scale)
        self.sampler = self.pm.sampler(d.num_inference_steps, d.eta, d.noise_level)
        self.train_prompts, self.eval_prompts = cfg.prompts.split(cfg.eval.size, cfg.seed)
        self.tracker = rl.PromptStatTracker(d.prompt_buffer, d.prompt_min_count, d.advantage_std) \
            if d.prompt_buffer else None
        self.grids: list[str] = []

    def train_step(self) -> dict[str, float]:
        cfg, registry, d = self.cfg, self.registry, self.cfg.diffusion
        policy, group, uses_ref = registry["policy"], d.group_size, self.uses_ref(cfg)
        records: list[dict[str, float]] = []
        for micro in range(cfg.roles.policy.grad_accum):
            # 1. this rank's prompts (whole groups) and all randomness from (seed, step, micro, rank): resumable
            g = step_generator(cfg.seed, self.step, micro, registry.rank)
            count = cfg.roles.policy.micro_batch_size // group
            picks = torch.randint(0, len(self.train_prompts), (count,), generator=g).tolist()
            prompts = [self.train_prompts[i] for i in picks for _ in range(group)]
            # 2. sample with the current policy, recording every step's log-probability; decode; score
            trajectory, cond, images = self.pm.rollout(prompts, self.sampler, g)
            rewards, means = score_images(self.rewards, prompts, images)
            # 3. group-relative advantages, or DDPO's per-prompt buffers (equal rewards get 0)
            adv = rollout_advantages(rewards, prompts, d, self.tracker).to(registry.device)
            steps = rl.train_step_indices(len(prompts), self.sampler.num_steps, d.train_timestep_fraction, g,
                                          shuffle=not d.train_noisiest).to(registry.device)
            rows = torch.arange(len(prompts), device=registry.device)
            # 4. per trained step: re-score under the policy (and the ref), clipped loss + KL, backward; the engine
            #    steps once all grad_accum x trained steps are accumulated
            for k in range(steps.shape[1]):
                j = steps[:, k]
                now = rl.rescore(self.pm.denoiser("policy", cond), self.sampler, trajectory, j)
                ref = rl.rescore(self.pm.denoiser("ref", cond), self.sampler, trajectory, j) if uses_ref else None
                loss, stats = rl.grpo_step_loss(now, ref, trajectory.log_probs[rows, j], adv, d)
                policy.backward(loss)
                policy.step()
                records.append({"loss": loss.item(), **{k2: float(v) for k2, v in stats.items()}})
            records[-1].update({"reward": float(rewards.mean()), **{f"reward/{n}": v for n, v in means.items()}})
        return step_record(registry, records, "policy")

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_buffers": self.tracker.state_dict()} if self.tracker else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tracker:
            self.tracker.load_state_dict(state.get("prompt_buffers", {"buffers": {}}))  # none saved: none yet

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Every rank samples the same held-out images (fixed noise and sampler draws) and scores them."""
        e = self.cfg.eval
        prompts = [p for p in self.eval_prompts for _ in range(e.images_per_prompt)]
        _, _, images = self.pm.rollout(prompts, self.sampler, torch.Generator().manual_seed(e.seed))
        rewards, means = score_images(self.eval_rewards, prompts, images)
        result: dict[str, Any] = {"reward": float(rewards.mean()), **{f"reward/{k}": v for k, v in means.items()}}
        if e.grid and tag in ("before", "after") and self.registry.is_main:
            path = self.path("grids", f"{self.step:06d}_{tag}.png")
            grid = reward_grid(images, prompts, rewards.tolist(), self.step, per_prompt=e.images_per_prompt,
                               path=path)
            self.metrics.log_image(self.step, "eval/grid", grid)
            self.grids.append(path)
        return result

    def export(self) -> dict[str, Any]:
        """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy."""
        return rl_export(self.registry, self.cfg, self.path("export"), self.model_path, self.family)

    def summary_metrics(self) -> dict[str, Any]:
        return {**first_last(self.step_metrics, "reward"), **self.eval_figures(("reward",))}

    def summary_extra(self) -> dict[str, Any]:
        return {"family": self.family, "model_path": self.model_path, "grids": self.grids,
                "trained_steps_per_image": self.cfg.diffusion.trained_steps, "ref": self.uses_ref(self.cfg),
                "eval_prompts": self.eval_prompts, "tiny_vae_pretrain": self.vae_pretrain,
                "tiny_unet_pretrain": self.unet_pretrain}


RECIPE = DiffusionGRPO

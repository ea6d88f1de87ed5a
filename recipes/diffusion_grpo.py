"""Online RL of a text-to-image denoiser (DDPO / Flow-GRPO): sample groups of images per prompt with a
stochastic sampler that records each step's log-probability, score them, and step the policy on a clipped
importance-ratio objective with group-relative advantages and an optional KL to a frozen reference.

    multiengine run diffusion_grpo --config tiny --nproc-per-node 2
    multiengine run diffusion_grpo --config sd3_medium --nproc-per-node 8
    multiengine plan diffusion_grpo --config flux_lora --gpus 8 --gpu-mem 80GiB

Roles: ``policy`` (the unet of SD/SDXL or the transformer of SD3/FLUX; full or LoRA with
``roles.policy.lora.r``), ``ref`` (frozen; a separate copy of the policy's starting weights, built only when
``diffusion.kl_coef > 0``, also for LoRA: the adapter-disabled policy is never used as the reference),
``reward`` (the frozen reward model, built when ``reward.functions`` lists ``reward_model``), the ``vae`` and
each text encoder (frozen). Unet families sample with DDIM at ``diffusion.eta > 0`` (DDPO), flow families with
Flow-GRPO's SDE at ``diffusion.noise_level``. Writes metrics.jsonl, summary.json, grids/ (held-out images
labelled with prompt and reward, also in TensorBoard), checkpoints and export/policy (a diffusers pipeline
folder; export/lora for LoRA runs).
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

import torch
from multiengine.engines import barrier, frozen_role, mean_over_ranks
from multiengine.engines.recipe_config import Choice, Each, Key, Length, Range, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, model_path, optim_spec, placement, role_keys
from multiengine.pipelines.diffusion import rl
from multiengine.pipelines.diffusion.export import export_pipeline, save_lora
from multiengine.pipelines.diffusion.families import FAMILIES, family_roles, model_family
from multiengine.pipelines.diffusion.models import resolve_model_path
from multiengine.pipelines.diffusion.rewards import (
    COLOR_NAMES,
    parse_shapes_prompt,
    save_tiny_reward_model,
    train_tiny_reward_model,
)
from multiengine.pipelines.diffusion.rl_runs import (
    BUILTIN_REWARDS,
    REWARD_MODEL,
    PolicyModel,
    load_reward_function,
    load_reward_model_role,
    prepare_tiny_pipeline,
    read_prompts,
    reward_grid,
    rl_role_specs,
    score_images,
    shapes_prompt_split,
)
from multiengine.pipelines.diffusion.runs import (
    memory_metrics,
    t5_length,
    text_tokenizers,
    token_lengths,
)
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.recipes import plans
from multiengine.recipes.common import recipe_checks

logger = logging.getLogger(__name__)

# Frozen components: fp32 on CPU, gathered whole once per call (one collective; 1/N of each between calls).
FROZEN: dict[str, Any] = {"dtype": "fp32", "gather_forward": True}
POLICY: dict[str, Any] = {
    "dtype": "fp32", "stage": 2, "lr": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0,
    "model": Key("", "a folder holding the denoiser (config.json + weights, e.g. an export's unet/); \"\" = the "
                     "unet/ or transformer/ of model.pretrained"),
    "micro_batch_size": Key(16, "images per rank per rollout (prompts x diffusion.group_size)"),
    "grad_accum": Key(1, "rollouts per optimizer step (each trains on its sampled steps; the engine accumulates "
                         "grad_accum x the trained steps)"),
    "lora": {"target_modules": Key([], "[] = diffusers' targets of the family")},
}
# The reference is ZeRO-3 whatever the policy's stage (its dtype follows the policy's).
REF_STAGE = Key(3, "ZeRO stage 0-3 (a frozen role asked for stage 1 or 2 is built at 0: nothing to partition "
                   "but its weights)")
ROLES = (
    Role("policy", "the denoiser trained (SD/SDXL unet, SD3/FLUX transformer)", trainable=True, keys=POLICY),
    Role("ref", "frozen reference for the KL term (built when diffusion.kl_coef > 0): a separate copy of the "
         "policy's starting weights, with LoRA too", follows="policy", weights="policy",
         keys={"stage": REF_STAGE, "gather_forward": True}),
    Role("reward", "the frozen reward model (reward.functions lists reward_model); model \"\" = the tiny shapes "
         "CNN trained here", keys={**FROZEN}),
    Role("vae", "frozen: decodes the sampled latents", keys={**FROZEN}),
    Role("text_encoder", "frozen: the first text encoder (CLIP-L)", keys={**FROZEN}),
    Role("text_encoder_2", "frozen: SDXL's and SD3's CLIG-G, FLUX's T5", follows="text_encoder",
         keys={"gather_forward": True}),
    Role("text_encoder_3", "frozen: SD3's T5", follows="text_encoder", keys={"gather_forward": True}),
)
COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")

MODEL_KEYS = Key({
    "pretrained": Key("", "the diffusers pipeline folder or hub name; \"\" = the tiny model of model.tiny_family"),
    "revision": Key("", "hub revision (\"\" = main)"),
    "variant": Key("", "weight variant (e.g. fp16; \"\" = the default weights)"),
    "tiny_family": Key("sd", "tiny model only: sd | sdxl | sd3 | flux"),
    "tiny_vae_steps": Key(100, "tiny model only: pretrain its random vae on the shapes images first (0 = no)"),
    "tiny_unet_steps": Key(400, "tiny SD only: pretrain its random unet on the shapes images first (0 = no)"),
}, "the diffusers pipeline whose denoiser is trained")
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/diffusion_grpo", "everything the run writes goes under this folder"),
    "max_steps": Key(60, "optimizer steps (each after grad_accum rollouts)"),
    "model": MODEL_KEYS,
    "roles": role_keys(ROLES),
    "diffusion": Key({
        "resolution": Key(16, "image side in pixels"),
        "num_inference_steps": Key(4, "sampler steps per image"),
        "eta": Key(1.0, "unet families: DDIM noise (> 0; DDPO uses 1.0)"),
        "noise_level": Key(0.7, "flow families: SDE noise level (> 0; Flow-GRPO uses 0.7)"),
        "guidance_scale": Key(1.0, "CFG scale while sampling (1 = none); FLUX: its guidance input"),
        "group_size": Key(8, "images per prompt (advantages are relative to the group)"),
        "advantage_std": Key("global", "group | global (the batch's std, Flow-GRPO's base config) | none (Dr. GRPO)"),
        "clip_range": Key(1e-4, "importance-ratio clip (DDPO, Flow-GRPO)"),
        "adv_clip_max": Key(5.0, "advantages clamped to [-x, x]"),
        "kl_coef": Key(0.01, "weight of the KL to roles.ref (0 = no ref role)"),
        "train_timestep_fraction": Key(0.5, "fraction of each trajectory's steps trained on"),
        "train_noisiest": Key(True, "true: the noisiest steps first; false: a random subset per image (DDPO)"),
    }, "sampling and the policy objective"),
    "reward": Key({
        "functions": Key(["color", REWARD_MODEL], f"rewards summed: builtins {', '.join(BUILTIN_REWARDS)}, or "
                                                  "module:function fn(prompts, images [N,3,H,W] in [0,1]) -> list"),
        "weights": Key([0.8, 0.2], "one weight per function ([] = 1 each)"),
        "model_steps": Key(300, "tiny reward model (roles.reward.model \"\"): its training steps"),
    }, "what the sampled images are scored with"),
    "prompts": Key({
        "train_file": Key("", "training prompts: .txt (one per line) or .json/.jsonl (prompt field); \"\" = the "
                              "shapes captions not held out"),
        "eval_file": Key("", "held-out prompts (same forms); \"\" = eval.size shapes captions"),
        "shapes_colors": Key(["red"], "the shapes captions used (train and held out) name these colours; [] = all six"),
    }, "prompts sampled for rollouts and held out for evaluation"),
    "eval": Key({
        "every": Key(0, "also evaluate every N steps (0 = only before and after)"),
        "size": Key(3, "held-out shapes captions when prompts.eval_file is \"\""),
        "images_per_prompt": Key(8, "images per held-out prompt (fixed noise)"),
        "reward": Key("color", "the evaluation reward (a builtin or module:function); \"\" = the training rewards"),
        "seed": Key(1234, "the held-out noise's seed"),
        "grid": Key(True, "grids/ of the held-out images labelled with prompt and reward (before, after)"),
    }, "mean reward of held-out prompts at fixed noise"),
    "export": Key({
        "enabled": Key(True, "export/policy: a diffusers pipeline folder (and export/lora for LoRA)"),
        "dtype": Key("fp32", "dtype of the exported components"),
    }, "what the run writes under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = recipe_checks(DEFAULTS, {
    "model.tiny_family": Choice(*FAMILIES), "model.tiny_vae_steps": Range(0),
    "diffusion.resolution": Range(8), "diffusion.num_inference_steps": Range(1),
    "diffusion.eta": Range(0, min_exclusive=True), "diffusion.noise_level": Range(0, min_exclusive=True),
    "diffusion.guidance_scale": Range(0), "diffusion.group_size": Range(2),
    "diffusion.advantage_std": Choice("group", "global", "none"), "diffusion.clip_range": Range(0, min_exclusive=True),
    "diffusion.adv_clip_max": Range(0, min_exclusive=True), "diffusion.kl_coef": Range(0),
    "diffusion.train_timestep_fraction": Range(0, 1, min_exclusive=True), "reward.functions": Each(Length(1)),
    "reward.model_steps": Range(1), "eval.size": Range(1), "eval.images_per_prompt": Range(1),
    "export.dtype": Choice("fp32", "bf16", "fp16"), "roles.policy.lora.target_modules": Each(Length(1)),
})


# --- checks before any rank starts (shared with diffusion_dpo) ------------------------------------------------
def pipeline_family(cfg: Any) -> str:
    """The family of model.pretrained (a local folder), model.tiny_family when empty, "" for a hub name."""
    path = str(cfg.model.pretrained)
    if not path:
        return str(cfg.model.tiny_family)
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        return ""
    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise config_problem("model.pretrained", path, "is not a diffusers folder (no model_index.json)",
                             "point it at a pipeline folder saved with save_pretrained, or a hub name")
    return model_family(folder)


def check_components(cfg: Any) -> None:
    """The vae and text encoders come from model.pretrained; a role folder of their own is refused."""
    for name in COMPONENTS:
        if cfg.roles[name].model or cfg.roles[name].tokenizer:
            raise config_problem(f"roles.{name}.model", cfg.roles[name].model or cfg.roles[name].tokenizer,
                                 "is not supported: the vae and text encoders load from model.pretrained",
                                 f"set roles.{name}.model=\"\" (and tokenizer) and point model.pretrained at the "
                                 "pipeline folder")
    for name in ("policy", "ref"):
        folder = str(cfg.roles[name].model)
        if folder and not os.path.isfile(os.path.join(os.path.expanduser(folder), "config.json")):
            raise config_problem(f"roles.{name}.model", folder, "has no config.json (not a denoiser folder)",
                                 f"give a unet/ or transformer/ folder, or set roles.{name}.model=\"\"")


def check_resolution(cfg: Any, family: str, key: str = "diffusion.resolution") -> None:
    from multiengine.pipelines.diffusion.runs import resolution_multiple

    path = os.path.expanduser(str(cfg.model.pretrained))
    multiple = resolution_multiple(family, path if cfg.model.pretrained and os.path.isdir(path) else None)
    res = int(_get(cfg, key))
    if res % multiple:
        raise config_problem(key, res, f"is not a multiple of {multiple}, which this {family} model needs",
                             f"use {key}={max(multiple, res // multiple * multiple)}")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def validate(cfg: Any, world_size: int = 1) -> None:
    """The model folder and family (eta for unets, noise_level for flows), component folders, resolution, the
    batch (micro batch = prompts x group_size), the reward functions import, the prompt files and the LoRA /
    reward-model combinations; before any rank starts."""
    check_components(cfg)
    family = pipeline_family(cfg)
    if family:
        check_resolution(cfg, family)
    d = cfg.diffusion
    micro = int(cfg.roles.policy.micro_batch_size)
    if micro % int(d.group_size):
        raise config_problem("roles.policy.micro_batch_size", micro, f"is not a multiple of diffusion.group_size="
                             f"{d.group_size} (each rank samples whole groups)",
                             f"set roles.policy.micro_batch_size={max(1, micro // d.group_size) * d.group_size}")
    steps = int(int(d.num_inference_steps) * float(d.train_timestep_fraction))
    if steps < 1:
        raise config_problem("diffusion.train_timestep_fraction", d.train_timestep_fraction,
                             f"of {d.num_inference_steps} steps trains on no step",
                             f"use at least {1 / int(d.num_inference_steps):.3g}")
    names = list(cfg.reward.functions)
    if not names:
        raise config_problem("reward.functions", [], "is empty: nothing scores the images",
                             "list a builtin (color, shapes, reward_model) or module:function")
    if cfg.reward.weights and len(cfg.reward.weights) != len(names):
        raise config_problem("reward.weights", list(cfg.reward.weights), f"has {len(cfg.reward.weights)} weights "
                             f"for {len(names)} functions", "give one weight per reward function, or []")
    for name in [*names, *([cfg.eval.reward] if cfg.eval.reward else [])]:
        if name == REWARD_MODEL:
            continue
        try:
            load_reward_function(str(name))
        except (ValueError, ImportError) as exc:
            key = "reward.functions" if name in names else "eval.reward"
            raise config_problem(key, name, f"cannot be loaded: {exc}", "use a builtin (color, shapes, "
                                 "reward_model) or an importable module:function") from None
    if cfg.eval.reward == REWARD_MODEL and REWARD_MODEL not in names:
        raise config_problem("eval.reward", REWARD_MODEL, "needs the reward role, built only when reward.functions "
                             "lists reward_model", "add reward_model to reward.functions, or set eval.reward=color")
    model = str(cfg.roles.reward.model)
    if model and not os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
        raise config_problem("roles.reward.model", model, "has no config.json (not a tiny reward model folder)",
                             "give a folder written by save_tiny_reward_model, or \"\" to train one")
    for key in ("train_file", "eval_file"):
        path = str(cfg.prompts[key])
        if not path:
            continue
        try:
            if not read_prompts(os.path.expanduser(path)):
                raise ValueError("it holds no prompt")
        except (OSError, ValueError) as exc:
            raise config_problem(f"prompts.{key}", path, f"cannot be read as prompts: {exc}",
                                 "give a .txt file (one prompt a line) or .json/.jsonl rows with a prompt field"
                                 ) from None
    colors = [str(c) for c in cfg.prompts.shapes_colors]
    if not (cfg.prompts.train_file and cfg.prompts.eval_file):
        try:
            shapes_prompt_split(int(cfg.eval.size), 0, colors)
        except ValueError as exc:
            raise config_problem("eval.size", cfg.eval.size, f"cannot split the shapes captions: {exc}",
                                 "set eval.size below the number of captions, or prompts.shapes_colors") from None
    check_tiny_unet(cfg)


def check_tiny_unet(cfg: Any) -> None:
    if cfg.model.tiny_unet_steps and (cfg.model.pretrained or cfg.model.tiny_family != "sd"):
        raise config_problem("model.tiny_unet_steps", cfg.model.tiny_unet_steps, "pretrains the tiny SD unet only "
                             f"(model.pretrained={str(cfg.model.pretrained)!r}, model.tiny_family="
                             f"{cfg.model.tiny_family})", "set model.tiny_unet_steps=0")


# --- building (shared with diffusion_dpo) ---------------------------------------------------------------------
class DiffusionRoles(Recipe):
    """The model folder (the tiny one built and its vae pretrained when empty) and the roles every diffusion RL
    recipe has: policy, ref (when ``uses_ref``), vae and the text encoders."""

    roles = ROLES

    def add_denoisers(self, resolution: int, uses_ref: bool, total_steps: int, accum: int) -> None:
        cfg, registry = self.cfg, self.registry
        self.vae_pretrain = self.unet_pretrain = None
        if cfg.model.pretrained:
            self.model_path = resolve_model_path(str(cfg.model.pretrained), str(cfg.model.revision) or None,
                                                 str(cfg.model.variant) or None)
        else:  # the tiny model, its vae (and SD unet) pretrained on the shapes images first
            family = str(cfg.model.tiny_family)
            self.model_path = self.path(f"tiny_{family}")
            done = prepare_tiny_pipeline(self.model_path, self.path("data", "shapes"), family, seed=cfg.seed,
                                         resolution=resolution, vae_steps=int(cfg.model.tiny_vae_steps),
                                         unet_steps=int(cfg.model.tiny_unet_steps), is_main=registry.is_main,
                                         device=registry.device)
            self.vae_pretrain, self.unet_pretrain = done["vae"], done["unet"]
        self.family = model_family(self.model_path)
        self.family_roles = family_roles(self.family)
        self.denoiser = self.family_roles.denoiser
        self.text_encoders = list(self.family_roles.text_encoders)
        default = {"policy": os.path.join(self.model_path, self.denoiser)}
        p = cfg.roles.policy
        for spec in rl_role_specs(
                self.model_path, self.denoiser, self.text_encoders,
                {r.name: placement(cfg, self.roles, r.name) for r in self.roles if r.name in cfg.roles},
                policy_folder=model_path(cfg, self.roles, "policy", default),
                ref_folder=model_path(cfg, self.roles, "ref", default) if uses_ref else None,
                optim=optim_spec(cfg, "policy", total_steps), micro_batch_size=int(p.micro_batch_size),
                grad_accum=accum, gradient_checkpointing=bool(p.gradient_checkpointing), seed=cfg.seed,
                # target_modules [] = diffusers' LoRA targets of the family
                lora=lora_spec(cfg, "policy", target_modules=tuple(p.lora.target_modules
                                                                   or self.family_roles.lora_targets)),
                variant=str(cfg.model.variant) or None):
            registry.add(spec)

    def policy_model(self, resolution: int, guidance_scale: float, t5_tokens: int = 0) -> PolicyModel:
        t5 = t5_length(self.family, t5_tokens)
        return PolicyModel(self.registry, self.model_path, self.family, self.text_encoders, resolution=resolution,
                           tokenizers=text_tokenizers(self.model_path, self.text_encoders),
                           token_lengths=token_lengths(self.model_path, self.text_encoders, t5),
                           guidance_scale=guidance_scale)

    def export_policy(self, dtype: str) -> dict[str, Any]:
        components = {self.denoiser: "policy", "vae": "vae", **{n: n for n in self.text_encoders}}
        folder = self.path("export", "policy")
        written: dict[str, Any] = {"policy": export_pipeline(self.registry, self.model_path, folder, components,
                                                             dtype=dtype)}
        if self.cfg.roles.policy.lora.r:
            written["lora"] = save_lora(self.registry, self.path("export", "lora"), role="policy",
                                        component=self.denoiser, pipeline_class=self.family_roles.pipeline)
        return written


class DiffusionGRPO(DiffusionRoles):
    name = "diffusion_grpo"
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
        weights = [float(w) for w in cfg.reward.weights] or [1.0] * len(names)
        if REWARD_MODEL in names:
            folder = str(cfg.roles.reward.model) or self.path("tiny_reward")
            if not cfg.roles.reward.model and registry.is_main and not os.path.isfile(os.path.join(folder,
                                                                                                   "config.json")):
                save_tiny_reward_model(train_tiny_reward_model(resolution=int(d.resolution), steps=int(
                    cfg.reward.model_steps), seed=cfg.seed), folder)
            barrier()
            registry.add(frozen_role("reward", lambda: load_reward_model_role(folder),
                                     placement(cfg, ROLES, "reward")))
        registry.build()
        self.rewards = [(n, self.reward_model_fn if n == REWARD_MODEL else load_reward_function(n), w)
                        for n, w in zip(names, weights)]
        ev = str(cfg.eval.reward)
        self.eval_rewards = [(ev, self.reward_model_fn if ev == REWARD_MODEL else load_reward_function(ev), 1.0)] \
            if ev else self.rewards
        self.pm = self.policy_model(int(d.resolution), float(d.guidance_scale))
        self.sampler = self.pm.sampler(int(d.num_inference_steps), float(d.eta), float(d.noise_level))
        train, held = shapes_prompt_split(int(cfg.eval.size), cfg.seed, [str(c) for c in cfg.prompts.shapes_colors])
        self.train_prompts = read_prompts(str(cfg.prompts.train_file)) if cfg.prompts.train_file else train
        self.eval_prompts = read_prompts(str(cfg.prompts.eval_file)) if cfg.prompts.eval_file else held
        self.grids: list[str] = []

    @torch.no_grad()
    def reward_model_fn(self, prompts: list[str], images: torch.Tensor, **kwargs: Any) -> list[float | None]:
        """The reward role's score for the colour each prompt names (every rank calls it: ZeRO-3 lockstep)."""
        colors = [parse_shapes_prompt(p)["color"] for p in prompts]
        ids = torch.tensor([COLOR_NAMES.index(c) if c else 0 for c in colors])
        role = self.registry.role("reward")
        scores = role.engine(images.to(self.registry.device, role.dtype), ids.to(self.registry.device)).float().cpu()
        return [None if c is None else float(s) for c, s in zip(colors, scores)]

    def rollout(self, prompts: list[str], generator: torch.Generator) -> tuple[rl.Trajectory, Any, torch.Tensor]:
        cond = self.pm.encode(prompts)
        latents = torch.randn(self.pm.latent_shape(len(prompts)), generator=generator).to(self.registry.device)
        module = self.registry.role("policy").module
        module.eval()
        try:
            trajectory = rl.sample_with_logprobs(self.pm.denoiser("policy", cond), latents, self.sampler, generator)
        finally:
            module.train()
        return trajectory, cond, self.pm.decode(trajectory.final)

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
            trajectory, cond, images = self.rollout(prompts, g)
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
        out = {key: statistics.fmean(r[key] for r in records if key in r) for key in records[-1]}
        return {**mean_over_ranks(out), "lr": policy.get_lr()[0], **memory_metrics(registry)}

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        """Every rank samples the same held-out images (fixed noise and sampler draws) and scores them."""
        cfg = self.cfg
        n = int(cfg.eval.images_per_prompt)
        prompts = [p for p in self.eval_prompts for _ in range(n)]
        trajectory, _, images = self.rollout(prompts, torch.Generator().manual_seed(int(cfg.eval.seed)))
        rewards, means = score_images(self.eval_rewards, prompts, images)
        result: dict[str, Any] = {"reward": float(rewards.mean()), **{f"reward/{k}": v for k, v in means.items()}}
        if cfg.eval.grid and tag in ("before", "after") and self.registry.is_main:
            keep = list(range(0, len(prompts), n))[:16]  # the first image of each prompt
            grid = reward_grid(images[keep], [prompts[i] for i in keep], [float(rewards[i]) for i in keep], self.step)
            path = self.path("grids", f"{self.step:06d}_{tag}.png")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            grid.save(path)
            self.metrics.log_image(self.step, "eval/grid", grid)
            self.grids.append(path)
        return result

    def export(self) -> dict[str, Any]:
        return self.export_policy(str(self.cfg.export.dtype)) if self.cfg.export.enabled else {}

    def summary_metrics(self) -> dict[str, Any]:
        rewards = [m["reward"] for m in self.step_metrics]
        return {"first_reward": rewards[0] if rewards else None, "final_reward": rewards[-1] if rewards else None,
                **self.eval_figures(("reward",))}

    def summary_extra(self) -> dict[str, Any]:
        return {"family": self.family, "model_path": self.model_path, "grids": self.grids,
                "trained_steps_per_image": self.trained_steps, "ref": self.uses_ref,
                "eval_prompts": self.eval_prompts, "tiny_vae_pretrain": self.vae_pretrain,
                "tiny_unet_pretrain": self.unet_pretrain}


main = DiffusionGRPO.main
plan = plans.diffusion_grpo  # what `multiengine plan` sees of this recipe

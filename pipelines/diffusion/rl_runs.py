"""Around rl.py's math: the diffusion RL recipes' settings, the policy model on registry engines, reward
functions, preference pairs, the tiny pipeline and labelled grids."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.settings import Each, FieldError, Length, Range, Settings, config_problem, section, setting

from . import flow
from .data import SHAPES_COLORS, _draw_shape, _shapes_rows, shapes_captions
from .families import family_roles
from .models import ModelSettings, call_engine, component_loader, load_component
from .rl import DDIMSampler, Denoiser, FlowSDESampler, PromptStatTracker, ddim_timesteps, flow_sampler, group_advantages
from .training import Conditioning, DiffusionObjective, DiffusionSettings, FlowMatchingObjective, prompt_input_ids

logger = logging.getLogger(__name__)

__all__ = ["BUILTIN_REWARDS", "DPOEval", "GRPOEval", "PolicyModel", "PreferenceData", "PromptSettings",
           "RLModelSettings", "RewardSettings", "denoiser_factory", "load_preference_rows", "load_reward_function",
           "load_reward_model_role", "make_shapes_preference_pairs", "preference_pixels", "preference_source",
           "preference_split", "pretrain_tiny_unet", "read_prompts", "reward_functions", "reward_grid",
           "reward_model_scores", "rl_export", "rl_model", "rl_specs", "score_images", "shapes_prompt_split",
           "tiny_reward_model"]

REWARD_MODEL = "reward_model"
BUILTIN_REWARDS = ("color", "shapes", REWARD_MODEL)


_COLORS = ["red"]


@dataclass(frozen=True)
class RLModelSettings(ModelSettings):
    """The diffusers pipeline whose denoiser is trained; the tiny one pretrained on the shapes images first."""

    tiny_vae_steps: int = setting(100, "tiny model only: pretrain its random vae on the shapes images first (0 = no)",
                                  Range(0), when="pretrained=")
    tiny_unet_steps: int = setting(400, "tiny SD only: pretrain its random unet on the shapes images first (0 = no)",
                                   Range(0), when="pretrained=")

    def check(self) -> None:
        if self.tiny_unet_steps and not self.pretrained and self.tiny_family != "sd":
            raise FieldError("tiny_unet_steps", self.tiny_unet_steps, "pretrains the tiny SD unet only (model."
                             f"tiny_family={self.tiny_family})", "set model.tiny_unet_steps=0")


@dataclass(frozen=True)
class RewardSettings(Settings):
    """What the sampled images are scored with: weighted reward functions."""

    functions: list[str] = setting(["color", REWARD_MODEL], f"rewards summed: builtins {', '.join(BUILTIN_REWARDS)}, "
                                   "or module:function fn(prompts, images [N,3,H,W] in [0,1]) -> list",
                                   Each(Length(1)))
    weights: list[float] = setting([0.8, 0.2], "one weight per function ([] = 1 each)")
    model_steps: int = setting(300, "tiny reward model (roles.reward.model \"\"): its training steps", Range(1))

    def check(self) -> None:
        if not self.functions:
            raise FieldError("functions", [], "is empty: nothing scores the images",
                             "list a builtin (color, shapes, reward_model) or module:function")
        if self.weights and len(self.weights) != len(self.functions):
            raise FieldError("weights", list(self.weights), f"has {len(self.weights)} weights for "
                             f"{len(self.functions)} functions", "give one weight per reward function, or []")

    def check_functions(self, eval_reward: str) -> None:
        """Every function (and the evaluation reward) loads; ``reward_model`` needs the reward role."""
        for name in [*self.functions, *([eval_reward] if eval_reward else [])]:
            if name == REWARD_MODEL:
                continue
            try:
                load_reward_function(name)
            except (ValueError, ImportError) as exc:
                key = "reward.functions" if name in self.functions else "eval.reward"
                raise config_problem(key, name, f"cannot be loaded: {exc}", "use a builtin (color, shapes, "
                                     "reward_model) or an importable module:function") from None
        if eval_reward == REWARD_MODEL and REWARD_MODEL not in self.functions:
            raise config_problem("eval.reward", REWARD_MODEL, "needs the reward role, built only when "
                                 "reward.functions lists reward_model", "add reward_model to reward.functions, or "
                                 "set eval.reward=color")


@dataclass(frozen=True)
class PromptSettings(Settings):
    """Prompts sampled for rollouts and held out for evaluation."""

    train_file: str = setting("", "training prompts: .txt (one per line) or .json/.jsonl (prompt field); \"\" = the "
                                  "shapes captions not held out")
    eval_file: str = setting("", "held-out prompts (same forms); \"\" = eval.size shapes captions")
    shapes_colors: list[str] = setting(_COLORS, "the shapes captions used (train and held out) name these colours; "
                                                "[] = all six", example=["blue"])

    def check(self) -> None:
        if self.train_file and self.eval_file and self.shapes_colors != _COLORS:
            raise FieldError("shapes_colors", self.shapes_colors, "applies only to the shapes captions (a prompts "
                             "file is empty)", "drop prompts.shapes_colors")

    def split(self, eval_size: int, seed: int) -> tuple[list[str], list[str]]:
        """(training prompts, held-out prompts): the files, else the shapes captions of ``shapes_colors``."""
        train, held = shapes_prompt_split(eval_size, seed, list(self.shapes_colors))
        return (read_prompts(self.train_file) if self.train_file else train,
                read_prompts(self.eval_file) if self.eval_file else held)

    def check_files(self, eval_size: int) -> None:
        """Each prompt file given holds prompts; without both, the shapes captions split into training prompts and
        ``eval_size`` held-out ones."""
        for key, path in (("prompts.train_file", self.train_file), ("prompts.eval_file", self.eval_file)):
            try:
                if path and not read_prompts(os.path.expanduser(path)):
                    raise ValueError("it holds no prompt")
            except (OSError, ValueError) as exc:
                raise config_problem(key, path, f"cannot be read as prompts: {exc}", "give a .txt file (one prompt a "
                                     "line) or .json/.jsonl rows with a prompt field") from None
        if not (self.train_file and self.eval_file):
            try:
                shapes_prompt_split(eval_size, 0, list(self.shapes_colors))
            except ValueError as exc:
                raise config_problem("eval.size", eval_size, f"cannot split the shapes captions: {exc}",
                                     "set eval.size below the number of captions, or prompts.shapes_colors") from None


@dataclass(frozen=True)
class GRPOEval(Settings):
    """Mean reward of held-out prompts at fixed noise."""

    every: int = setting(0, "also evaluate every N steps (0 = only before and after)", Range(0))
    size: int = setting(3, "held-out shapes captions when prompts.eval_file is \"\"", Range(1))
    images_per_prompt: int = setting(8, "images per held-out prompt (fixed noise)", Range(1))
    reward: str = setting("color", "the evaluation reward (a builtin or module:function); \"\" = the training rewards")
    seed: int = setting(1234, "the held-out noise's seed", Range(0))
    grid: bool = setting(True, "grids/ of the held-out images labelled with prompt and reward (before, after)")


@dataclass(frozen=True)
class PreferenceColumns(Settings):
    prompt: str = setting("prompt", "your prompt column", Length(1))
    chosen: str = setting("chosen", "your chosen image column", Length(1))
    rejected: str = setting("rejected", "your rejected image column", Length(1))


@dataclass(frozen=True)
class PreferenceData(Settings):
    """Preference pairs (prompt, chosen, rejected)."""

    source: str = setting("", "preference pairs: a data file, save_to_disk folder or hub name; \"\" = shapes pairs")
    columns: PreferenceColumns = section(PreferenceColumns, "your column names per field")
    split: str = setting("train", "the split of a hub dataset or DatasetDict folder")
    eval_source: str = setting("", "held-out pairs (same forms); \"\" = the last eval.size rows of data.source")
    resolution: int = setting(16, "image side in pixels (resized, center-cropped)", Range(8))
    builtin_size: int = setting(256, "pairs generated for the shapes task", Range(2), when="source=")
    shapes_colors: list[str] = setting(_COLORS, "shapes pairs: the chosen image (and the prompt) has one of these "
                                                "colours; [] = all six", when="source=", example=["blue"])
    cache_dir: str = setting("", "datasets cache folder (\"\" = the default)")

    def options(self) -> dict[str, Any]:
        """How the rows are read (:func:`preference_source`'s options)."""
        c = self.columns
        return {"columns": {"prompt": c.prompt, "chosen": c.chosen, "rejected": c.rejected}, "split": self.split,
                "cache_dir": self.cache_dir or None}

    def rows(self) -> int:
        """How many pairs the training source has (before the held-out split); before any rank starts."""
        if not self.source:
            return self.builtin_size
        try:
            return len(preference_source(self.source, **self.options())[0])
        except (ValueError, FileNotFoundError) as exc:
            raise config_problem("data.source", self.source, f"cannot be used as preference pairs: {exc}",
                                 "give a file or dataset with prompt/chosen/rejected columns (data.columns)") from None


@dataclass(frozen=True)
class DPOEval(Settings):
    """Implicit reward accuracy on held-out pairs (fixed noise and timesteps)."""

    every: int = setting(0, "also evaluate every N steps (0 = only before and after)", Range(0))
    size: int = setting(32, "held-out pairs taken from data.source when data.eval_source is \"\"", Range(1))
    timesteps: int = setting(4, "evenly spaced timesteps per held-out pair", Range(1))
    seed: int = setting(1234, "the held-out noise's seed", Range(0))


# --- prompts ----------------------------------------------------------------------------------------------
def shapes_prompt_split(num_eval: int, seed: int, colors: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """The shapes captions (those naming one of ``colors``; all 54 when empty) shuffled with ``seed``:
    ``(train, held_out)`` with ``num_eval`` held out (unseen shape / background combinations)."""
    unknown = [c for c in colors if c not in SHAPES_COLORS]
    if unknown:
        raise ValueError(f"colors {unknown} are not shapes colours ({', '.join(SHAPES_COLORS)})")
    captions = [c for c in shapes_captions() if not colors or c.split()[1] in colors]
    if not 0 < num_eval < len(captions):
        raise ValueError(f"num_eval={num_eval} must be in [1, {len(captions) - 1}] ({len(captions)} shapes captions)")
    random.Random(seed).shuffle(captions)
    return captions[num_eval:], captions[:num_eval]


def read_prompts(path: str) -> list[str]:
    """Prompts from a ``.txt`` file (one per non-empty line) or ``.json``/``.jsonl`` rows with a ``prompt`` (or
    ``text``/``caption``) field."""
    with open(path, encoding="utf-8") as f:
        if path.endswith(".txt"):
            return [line.strip() for line in f if line.strip()]
        rows = json.load(f) if path.endswith(".json") else [json.loads(x) for x in f if x.strip()]
    out = []
    for i, row in enumerate(rows):
        text = next((row[k] for k in ("prompt", "text", "caption") if isinstance(row, dict) and k in row), None)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: row {i + 1} has no prompt/text/caption string")
        out.append(text)
    return out


# --- rewards ----------------------------------------------------------------------------------------------
def load_reward_function(spec: str) -> Callable[..., list[float | None]]:
    """A builtin reward (``color``, ``shapes``) or ``"module:function"`` with the signature ``fn(prompts, images,
    **kwargs) -> list[float | None]`` (images: float tensor ``[N, 3, H, W]`` in ``[0, 1]``)."""
    from . import rewards

    if spec in ("color", "shapes"):
        return rewards.color_reward if spec == "color" else rewards.shapes_reward
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"reward function {spec!r}: use a builtin ({', '.join(BUILTIN_REWARDS)}) or "
                         "'module:function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: module {module!r} has no function {name!r}")
    return fn


def reward_functions(names: Sequence[str], weights: Sequence[float], registry: EngineRegistry
                     ) -> list[tuple[str, Callable[..., Any], float]]:
    """:func:`score_images`' ``(name, function, weight)`` per reward (``reward_model``: the registry's reward
    role); ``weights`` [] = 1 each."""
    weights = [float(w) for w in weights] or [1.0] * len(names)
    return [(n, functools.partial(reward_model_scores, registry) if n == REWARD_MODEL else load_reward_function(n), w)
            for n, w in zip(names, weights)]


def score_images(functions: Sequence[tuple[str, Callable[..., Any], float]], prompts: Sequence[str],
                 images: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of every reward function on ``images`` ``[N, 3, H, W]`` in ``[0, 1]`` (``[N]`` float32) and
    each function's mean. A ``None`` (a prompt the function does not score) counts as 0 and is logged once."""
    total = torch.zeros(len(prompts))
    means = {}
    for name, fn, weight in functions:
        values = fn(list(prompts), images)
        if len(values) != len(prompts):
            raise ValueError(f"reward {name!r} returned {len(values)} values for {len(prompts)} images")
        if any(v is None for v in values):
            logger.warning("reward %r scored no value for some prompts (counted as 0)", name)
        scores = torch.tensor([0.0 if v is None else float(v) for v in values])
        means[name] = float(scores.mean())
        total += weight * scores
    return total, means


def rollout_advantages(rewards: torch.Tensor, prompts: Sequence[str], settings: Any,
                       tracker: PromptStatTracker | None = None) -> torch.Tensor:
    """This rank's advantages: :func:`group_advantages`, or with ``tracker`` DDPO's per-prompt statistics over
    every rank's rows gathered in rank order (every rank then holds the same buffers)."""
    if tracker is None:
        return group_advantages(rewards, settings.group_size, std=settings.advantage_std)
    dist = torch.distributed
    shards, rank = [(list(prompts), rewards.float().tolist())], 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        rank, mine = dist.get_rank(), shards[0]
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)
    start = sum(len(s[0]) for s in shards[:rank])
    adv = tracker.update([p for s in shards for p in s[0]], torch.tensor([r for s in shards for r in s[1]]))
    return adv[start:start + len(prompts)]


# --- the policy's conditioning and denoiser on the registry --------------------------------------------------
class PolicyModel:
    """The registry's denoiser roles, vae and text encoders as rl.py wants them: conditioning, a :data:`Denoiser`
    per role (CFG when ``guidance_scale`` > 1; FLUX takes it as its guidance input), the sampler, vae decode to
    ``[0, 1]`` and a denoising loss's input / target. ``t5_tokens``: 0 = the family's."""

    def __init__(self, registry: EngineRegistry, model_path: str, family: str, *, resolution: int,
                 guidance_scale: float = 1.0, t5_tokens: int = 0, policy: str = "policy") -> None:
        from .runs import t5_length, text_tokenizers, token_lengths

        self.registry, self.family, self.resolution = registry, family, int(resolution)
        self.text_encoders = list(family_roles(family).text_encoders)
        self.tokenizers = text_tokenizers(model_path, self.text_encoders)
        self.lengths = token_lengths(model_path, self.text_encoders, t5_length(family, t5_tokens))
        self.flow = family_roles(family).objective == "flow"
        self.guidance_scale = float(guidance_scale)
        self.policy = policy
        if self.flow:
            from diffusers import FlowMatchEulerDiscreteScheduler

            config = FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
            self.scheduler_config = dict(config)
            self.objective = FlowMatchingObjective(registry, family, config, DiffusionSettings(
                guidance_scale=self.guidance_scale), self.text_encoders, role=policy)
            self.cfg = family != "flux" and self.guidance_scale > 1
        else:
            from diffusers import DDPMScheduler

            scheduler = DDPMScheduler.from_pretrained(model_path, subfolder="scheduler")
            self.scheduler_config = dict(scheduler.config)
            self.prediction_type = str(scheduler.config.prediction_type)
            self.objective = DiffusionObjective(registry, self.text_encoders, scheduler, None, self.resolution,
                                                role=policy)
            self.cfg = self.guidance_scale > 1
        self.vae = registry.role("vae")
        self.vae_scale = 2 ** (len(self.vae.module.config.block_out_channels) - 1)
        self._negative: Conditioning | None = None

    # conditioning
    def encode(self, prompts: Sequence[str]) -> Conditioning:
        ids = prompt_input_ids(self.tokenizers, list(prompts), self.lengths)
        ids = [ids["input_ids"]] + [ids[f"input_ids_{i + 1}"] for i in range(1, len(self.tokenizers))]
        hidden, pooled = self.objective.encode_prompts(ids)
        time_ids = None
        if not self.flow and self.objective.text_time:
            time_ids = self.objective.time_ids({}, len(prompts))
        return Conditioning(hidden, pooled, time_ids)

    def negative(self) -> Conditioning:
        """The empty prompt's conditioning (the unconditional branch of CFG), encoded once."""
        if self._negative is None:
            self._negative = self.encode([""])
        return self._negative

    # the denoiser
    def predict(self, role: str, latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """One forward of ``role`` (its engine: a trainable role records autograd, a frozen one does not)."""
        r = self.registry.role(role)
        if self.flow:
            return self.objective.transformer_forward(r.engine, latents, timesteps, cond.hidden, cond.pooled, r.dtype)
        return self.objective.unet_forward(r.engine, latents, timesteps, cond, r.dtype)

    def denoiser(self, role: str, cond: Conditioning) -> Denoiser:
        """``fn(latents, timesteps) -> model output`` of ``role`` for ``cond``, with CFG when on."""
        def fn(latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
            if not self.cfg:
                return self.predict(role, latents, timesteps, cond).float()
            both = self.negative().repeat(latents.shape[0]).cat(cond)
            out = self.predict(role, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]), both).float()
            uncond, text = out.chunk(2)
            return uncond + self.guidance_scale * (text - uncond)
        return fn

    def sampler(self, num_steps: int, eta: float, noise_level: float) -> DDIMSampler | FlowSDESampler:
        """DDIM with ``eta`` (unet families, the scheduler's schedule and offset) or the flow SDE with
        ``noise_level`` over the scheduler's sigmas (SD3's shift, FLUX's resolution-dependent shift)."""
        if self.flow:
            return flow_sampler(self.scheduler_config, num_steps, noise_level, self.resolution, self.vae_scale)
        c = self.scheduler_config
        return DDIMSampler(ddim_timesteps(num_steps, int(c.get("num_train_timesteps", 1000)),
                                          int(c.get("steps_offset", 0))),
                           self.objective.alphas_cumprod, eta=eta, prediction_type=self.prediction_type)

    def latent_shape(self, batch: int) -> tuple[int, ...]:
        side = self.resolution // self.vae_scale
        return (batch, int(self.vae.module.config.latent_channels), side, side)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images ``[B, 3, H, W]`` float32 in ``[0, 1]`` on the CPU, through the vae engine."""
        config = self.vae.module.config
        z = latents.float() / float(config.scaling_factor) + float(getattr(config, "shift_factor", None) or 0.0)
        images = call_engine(self.vae.engine, "decode", z.to(self.registry.device, self.vae.dtype), return_dict=False)
        return (images[0].float().cpu() / 2 + 0.5).clamp(0, 1)

    def rollout(self, prompts: Sequence[str], sampler: DDIMSampler | FlowSDESampler, generator: torch.Generator,
                role: str = "policy") -> tuple[Any, Conditioning, torch.Tensor]:
        """Images for ``prompts`` sampled by ``role`` (in eval mode meanwhile) from noise drawn from ``generator``,
        recording every step's log-probability: (trajectory, the prompts' conditioning, images in ``[0, 1]``)."""
        from .rl import sample_with_logprobs

        cond = self.encode(prompts)
        latents = torch.randn(self.latent_shape(len(prompts)), generator=generator).to(self.registry.device)
        module = self.registry.role(role).module
        module.eval()
        try:
            trajectory = sample_with_logprobs(self.denoiser(role, cond), latents, sampler, generator)
        finally:
            module.train()
        return trajectory, cond, self.decode(trajectory.final)

    # a denoising loss (Diffusion-DPO)
    @torch.no_grad()
    def image_latents(self, pixel_values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.objective.latents(pixel_values, generator)

    def pair_predictions(self, role: str, prompts: list[str], chosen: torch.Tensor, rejected: torch.Tensor,
                         g: torch.Generator, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prediction and target ``[2B, ...]`` of ``role`` for preference pairs (chosen first): each pair shares its
        noise and its timestep position ``u`` (drawn from ``g`` when None)."""
        from .rl import paired

        latents = self.image_latents(torch.cat([chosen, rejected]), g)
        noise = paired(torch.randn(latents.shape, generator=g).to(latents.device))
        if u is None:
            u = torch.rand(len(prompts), generator=g)
        noisy, target, t = self.noisy_and_target(latents, noise, torch.cat([u, u]).to(latents.device))
        return self.predict(role, noisy, t, self.encode(prompts + prompts)), target

    @torch.no_grad()
    def pair_losses(self, role: str, prompts: list[str], chosen: torch.Tensor, rejected: torch.Tensor, *,
                    timesteps: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``role``'s mean denoising loss of each chosen and each rejected image ``([B], [B])`` over ``timesteps``
        evenly spaced positions, the noise of position k from ``seed + k`` (the same on every rank); eval mode."""
        module = self.registry.role(role).module
        was = module.training
        module.eval()
        per = []
        for k in range(timesteps):
            u = torch.full((len(prompts),), (k + 0.5) / timesteps)
            pred, target = self.pair_predictions(role, prompts, chosen, rejected, torch.Generator().manual_seed(
                seed + k), u)
            per.append(((pred.float() - target.float()) ** 2).mean(dim=tuple(range(1, pred.ndim))).cpu())
        module.train(was)
        chosen_loss, rejected_loss = torch.stack(per).mean(0).chunk(2)
        return chosen_loss, rejected_loss

    def noisy_and_target(self, latents: torch.Tensor, noise: torch.Tensor, u: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The noisy input, regression target and model timesteps at ``u`` ``[B]`` in ``[0, 1)`` (table position
        ``floor(u T)``; DDPM epsilon / v target, or flow's ``(1 - sigma) x0 + sigma noise`` and ``noise - x0``)."""
        from .math import add_noise, training_target

        n = self.objective.num_train_timesteps
        index = (u * n).long().clamp(0, n - 1)
        if self.flow:
            timesteps, sigmas = self.objective.timesteps[index], self.objective.sigmas[index].to(latents.device)
            return flow.flow_noisy_input(latents, noise, sigmas), flow.flow_target(latents, noise), timesteps
        ac = self.objective.alphas_cumprod
        index = index.to(latents.device)
        return (add_noise(latents, noise, index, ac), training_target(self.prediction_type, latents, noise, index, ac),
                index)


@torch.no_grad()
def reward_model_scores(registry: EngineRegistry, prompts: Sequence[str], images: torch.Tensor, role: str = "reward",
                        **kwargs: Any) -> list[float | None]:
    """The reward role's score (the tiny shapes reward model) for the colour each prompt names; None for a prompt
    that names none. Every rank calls it (ZeRO-3 lockstep)."""
    from .rewards import COLOR_NAMES, parse_shapes_prompt

    colors = [parse_shapes_prompt(p)["color"] for p in prompts]
    ids = torch.tensor([COLOR_NAMES.index(c) if c else 0 for c in colors])
    r = registry.role(role)
    scores = r.engine(images.to(registry.device, r.dtype), ids.to(registry.device)).float().cpu()
    return [None if c is None else float(s) for c, s in zip(colors, scores)]


def tiny_reward_model(folder: str, *, resolution: int, steps: int, seed: int, is_main: bool) -> str:
    """The tiny shapes reward model at ``folder``: trained and saved by rank 0 when it is not there yet, while the
    others wait. Collective."""
    from multiengine.engines import barrier

    from .rewards import save_tiny_reward_model, train_tiny_reward_model

    if is_main and not os.path.isfile(os.path.join(folder, "config.json")):
        save_tiny_reward_model(train_tiny_reward_model(resolution=resolution, steps=steps, seed=seed), folder)
    barrier()
    return folder


# --- preference pairs ----------------------------------------------------------------------------------------
def make_shapes_preference_pairs(out_dir: str, n: int, resolution: int = 32, seed: int = 0,
                                 colors: Sequence[str] = ()) -> str:
    """``n`` shapes preference pairs under ``out_dir`` (``pairs.jsonl``): chosen in the prompt's colour (one of
    ``colors``), rejected the same picture in another colour. Idempotent; written then renamed."""
    path = os.path.join(out_dir, "pairs.jsonl")
    wanted = {"n": n, "resolution": resolution, "seed": seed, "colors": list(colors)}
    marker = os.path.join(out_dir, "pairs.json")
    if os.path.isfile(path) and os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            if json.load(f) == wanted:
                return path
    unknown = [c for c in colors if c not in SHAPES_COLORS]
    if unknown:
        raise ValueError(f"colors {unknown} are not shapes colours ({', '.join(SHAPES_COLORS)})")
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed + 1)
    palette = list(SHAPES_COLORS)
    rows = []
    for i, row in enumerate(_shapes_rows(n, resolution, seed)):
        if colors:
            color = colors[i % len(colors)]
            row = dict(row, color=color, text=f"a {color} {row['shape']} on a {row['background']} background")
        other = dict(row, color=rng.choice([c for c in palette if c != row["color"]]))
        names = (f"{i:05d}_chosen.png", f"{i:05d}_rejected.png")
        for name, r in zip(names, (row, other)):
            _draw_shape(r, resolution).save(os.path.join(out_dir, name + ".tmp"), format="PNG")
            os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))
        rows.append({"prompt": row["text"], "chosen": names[0], "rejected": names[1]})
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)
    with open(marker, "w", encoding="utf-8") as f:
        json.dump(wanted, f)
    return path


def load_preference_rows(source: str, columns: dict[str, str], split: str = "train",
                         cache_dir: str | None = None) -> Any:
    """Preference rows of a data file, ``save_to_disk`` folder or hub name with the ``prompt``/``chosen``/``rejected``
    columns renamed from ``columns``; image cells are paths (relative to the file's folder) or images."""
    from multiengine.pipelines.sources import load_source

    ds = load_source(source, split=split, key="data.source", cache_dir=cache_dir)
    missing = [f"{field} (column {col!r})" for field, col in columns.items() if col not in ds.column_names]
    if missing:
        raise ValueError(f"data.source={source!r} has no {', '.join(missing)}; its columns: {ds.column_names}. "
                         "Set data.columns.<field> to your column names.")
    ds = ds.select_columns(list(columns.values()))
    return ds.rename_columns({v: k for k, v in columns.items() if k != v})


def preference_source(source: str, columns: dict[str, str], split: str = "train", cache_dir: str | None = None
                      ) -> tuple[Any, str]:
    """The preference rows of ``source`` (:func:`load_preference_rows`) and the folder their image paths are
    relative to."""
    source = os.path.expanduser(source)
    rows = load_preference_rows(source, columns, split, cache_dir)
    return rows, os.path.dirname(source) if os.path.isfile(source) else source


def preference_split(source: str, eval_source: str, eval_size: int, resolution: int, **load: Any) -> tuple[Any, Any]:
    """The training and the held-out pairs as :func:`preference_pixels`: the pairs of ``eval_source`` held out,
    else the last ``eval_size`` rows of ``source``; ``load``: :func:`preference_source`'s options."""
    rows, root = preference_source(source, **load)
    if eval_source:
        held = preference_pixels(*preference_source(eval_source, **load), resolution)
    else:
        n = len(rows) - eval_size
        held = preference_pixels(rows.select(range(n, len(rows))), root, resolution)
        rows = rows.select(range(n))
    return preference_pixels(rows, root, resolution), held


def preference_pixels(rows: Any, root: str, resolution: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Prompts and the chosen / rejected pixels ``[N, 3, res, res]`` in ``[-1, 1]`` (resized, center-cropped)."""
    from PIL import Image

    from .data import ImageTransform

    transform = ImageTransform(resolution, center_crop=True, random_flip=False)

    def pixels(cell: Any) -> torch.Tensor:
        if isinstance(cell, str):
            with Image.open(cell if os.path.isabs(cell) else os.path.join(root, cell)) as im:
                return transform(im.convert("RGB"))
        return transform(cell.convert("RGB"))

    prompts = [str(p) for p in rows["prompt"]]
    chosen = torch.stack([pixels(c) for c in rows["chosen"]])
    rejected = torch.stack([pixels(c) for c in rows["rejected"]])
    return prompts, chosen, rejected


# --- grids ------------------------------------------------------------------------------------------------
def reward_grid(images: torch.Tensor, prompts: Sequence[str], rewards: Sequence[float], step: int, *,
                per_prompt: int = 1, path: str = "") -> Any:
    """A grid of ``images`` ``[N, 3, H, W]`` in ``[0, 1]``, each labelled with its prompt and reward: the first
    image of each prompt (each repeated ``per_prompt`` times in a row), at most 16; saved at ``path`` if given."""
    from PIL import Image

    from .validation import image_grid

    keep = list(range(0, len(prompts), per_prompt))[:16]
    pil = [Image.fromarray((images[i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for i in keep]
    grid = image_grid(pil, prompts=[f"{prompts[i]} (reward {float(rewards[i]):.2f})" for i in keep], step=step)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        grid.save(path)
    return grid


# --- a briefly pre-trained tiny unet ---------------------------------------------------------------------------
def pretrain_tiny_unet(model_dir: str, images: str, steps: int, *, resolution: int, batch_size: int = 16,
                       lr: float = 1e-3, seed: int = 0) -> dict[str, Any]:
    """Train the tiny SD unet of ``model_dir`` on the shapes images for ``steps`` epsilon steps in this process and
    save it in place, so the RL tiny runs start from a denoiser that paints shapes. Deterministic in ``seed``,
    idempotent (``unet/pretrained.json``); returns ``{"steps", "seed", "resolution", "loss", "seconds"}``."""
    import shutil
    import time

    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from .data import ImageTransform
    from .math import add_noise

    marker = os.path.join(model_dir, "unet", "pretrained.json")
    wanted = {"steps": steps, "seed": seed, "resolution": resolution, "batch_size": batch_size, "lr": lr}
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            done = json.load(f)
        if all(done.get(k) == v for k, v in wanted.items()):
            return done
    start = time.perf_counter()
    with open(os.path.join(images, "metadata.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    from PIL import Image

    transform = ImageTransform(resolution, center_crop=True, random_flip=False)
    pixels = []
    for row in rows:
        with Image.open(os.path.join(images, row["file_name"])) as im:
            pixels.append(transform(im.convert("RGB")))
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae")
    encoder = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    alphas = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler").alphas_cumprod.float()
    with torch.no_grad():
        latents = vae.encode(torch.stack(pixels)).latent_dist.mean * float(vae.config.scaling_factor)
        ids = tokenizer([r["text"] for r in rows], padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids
        hidden = encoder(ids)[0]
    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    unet.train()
    for _ in range(steps):
        i = torch.randint(0, len(rows), (batch_size,), generator=g)
        noise = torch.randn(latents[i].shape, generator=g)
        t = torch.randint(0, alphas.shape[0], (batch_size,), generator=g)
        pred = unet(add_noise(latents[i], noise, t, alphas), t, encoder_hidden_states=hidden[i]).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = {**wanted, "loss": float(np.mean(losses[-50:])) if losses else None,
              "seconds": round(time.perf_counter() - start, 2)}
    tmp = os.path.join(model_dir, "unet.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    unet.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "pretrained.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    shutil.rmtree(os.path.join(model_dir, "unet"))
    os.replace(tmp, os.path.join(model_dir, "unet"))
    logger.info("pretrained the tiny unet for %d steps at %d px in %.1f s: loss %.4f", steps, resolution,
                result["seconds"], result["loss"])
    return result


def load_reward_model_role(path: str) -> torch.nn.Module:
    """:func:`rewards.load_tiny_reward_model` as a role factory: under ZeRO-3 the weights load into the gathered
    parameters (rank 0's copy is partitioned back)."""
    from safetensors.torch import load_file

    from .rewards import TinyShapesRewardModel

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        model = TinyShapesRewardModel(**json.load(f))
    state = load_file(os.path.join(path, "model.safetensors"))
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            model.load_state_dict(state)
    else:
        model.load_state_dict(state)
    return model.eval()


# --- the model folder and the denoiser of a diffusion RL run ------------------------------------------------
def denoiser_factory(model_path: str, denoiser: str, folder: str, variant: str | None = None
                     ) -> Callable[[], torch.nn.Module]:
    """A role's model factory for a denoiser ``folder``: ``<model_path>/<denoiser>`` loads as the pipeline's
    component (with ``variant``), any other folder as the diffusers class its config.json names."""
    import diffusers

    if folder == os.path.join(model_path, denoiser):
        return lambda: load_component(model_path, denoiser, variant)

    def load() -> torch.nn.Module:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return getattr(diffusers, json.load(f)["_class_name"]).from_pretrained(folder)
    return load


def rl_model(cfg: Any, registry: EngineRegistry, path: str, shapes: str, resolution: int) -> tuple[str, dict[str, Any]]:
    """The model folder: model.pretrained's, or the tiny ``model.tiny_family`` pipeline at ``path`` and the shapes
    images at ``shapes`` (rank 0 writes them), its vae pretrained on them (all ranks) and, for SD, its unet (rank 0
    while the others wait), with {"vae": ..., "unet": ...}: what each pre-train did (None: none). Collective."""
    from multiengine.engines import barrier

    from .data import make_shapes_dataset
    from .runs import build_tiny_model
    from .tiny import pretrain_tiny_vae

    done: dict[str, Any] = {"vae": None, "unet": None}
    m = cfg.model
    if m.pretrained:
        return m.path(), done
    if registry.is_main:
        build_tiny_model(path, cfg.seed, resolution, m.tiny_family)
        make_shapes_dataset(shapes, 136, resolution, seed=cfg.seed)
    barrier()
    if m.tiny_vae_steps:
        done["vae"] = pretrain_tiny_vae(path, shapes, m.tiny_vae_steps, seed=cfg.seed, resolution=resolution,
                                        progress=False, device=registry.device)
        barrier()
    if m.tiny_unet_steps:
        if registry.is_main:
            done["unet"] = pretrain_tiny_unet(path, shapes, m.tiny_unet_steps, resolution=resolution, seed=cfg.seed)
        barrier()
    return path, done


def rl_specs(cfg: Any, family: str, model_path: str, *, rows: int = 1, accum: int = 1, ref: bool = True) -> list[Any]:
    """The RoleSpecs of a diffusion RL run on the folder ``model_path``: the policy (``rows`` per micro-batch item,
    ``accum`` backwards per micro batch), the ref where ``ref``, the vae and the family's text encoders."""
    fr, r = family_roles(family), cfg.roles
    load = component_loader(cfg.model, model_path)
    default = {"policy": os.path.join(model_path, fr.denoiser)}
    variant = (cfg.model.variant or None) if cfg.model.pretrained else None

    def denoiser(name: str) -> Any:
        return denoiser_factory(model_path, fr.denoiser, r[name].model_path(default), variant)

    specs = [r.policy.spec(denoiser("policy"), total_steps=cfg.max_steps, seed=cfg.seed, rows=rows, accum=accum,
                           lora_targets=fr.lora_targets)]
    if ref:
        specs.append(r.ref.spec(denoiser("ref")))
    return specs + [r[n].spec(load(n)) for n in ("vae", *fr.text_encoders)]


def rl_export(registry: EngineRegistry, cfg: Any, out_dir: str, model_path: str, family: str) -> dict[str, Any]:
    """export/policy (a diffusers pipeline folder) and export/lora for a LoRA policy, under ``out_dir``."""
    from .export import export_run

    if not cfg.export.enabled:
        return {}
    fr = family_roles(family)
    lora = ("policy", fr.denoiser, fr.pipeline) if cfg.roles.policy.lora.r else None
    return export_run(registry, out_dir, model_path, {fr.denoiser: "policy", "vae": "vae",
                                                       **{n: n for n in fr.text_encoders}},
                      cfg.export, lora=lora, pipeline="policy")

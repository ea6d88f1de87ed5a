"""PPO (RLHF step 3) on the registry: rollout with a critic, per-token rewards with the k1 KL
penalty, GAE and whitening, then the actor and critic updates (the pieces live in rollout.py,
ppo.py and update.py; this class holds the settings and the state that must survive a resume)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, ema_update

from . import ppo
from .generation import GenerationSettings
from .rewards import RewardSource, RunningMoments, check_sources, reward_model
from .rollout import Experience, StepStats, make_experience, rollout_metrics, sampling_seed, step_timings
from .update import train_on_experience

__all__ = ["SUMMARY_TIMINGS", "PPOSettings", "PPOTrainer", "plot_panels"]

Judge = Callable[[str, str], float]
# the per-step timings (rollout.step_timings) whose means a run's summary reports
SUMMARY_TIMINGS = ("time/step_s", "time/generation_s", "time/experience_s", "time/train_s", "gen/tokens_per_s",
                   "gen/ms_per_token")


@dataclass
class PPOSettings:
    """Step-3 hyper-parameters; defaults as in the reference checklist."""

    rollout_batch_size: int = 8  # prompts per rank per PPO step
    mini_batch_size: int = 4  # rows per rank per forward/backward in the update
    critic_mini_batch_size: int | None = None  # the critic's, None = mini_batch_size
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    value_clip: float | None = 0.2
    dual_clip: float | None = None
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.1
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    kl_clamp: float | None = None  # clamp each token's k1 estimate in the reward to +/- this
    clip_reward: float | None = 5.0
    normalize_rewards: bool = False  # running mean/std of the score (all ranks), before clipping
    whiten_advantages: bool = True
    no_eos_penalty: float | None = None
    ptx_coef: float = 0.0
    critic_warmup_steps: int = 0
    ema_decay: float = 0.992
    shuffle_minibatches: bool = True

    def __post_init__(self) -> None:
        for name in ("mini_batch_size", "critic_mini_batch_size"):
            size = getattr(self, name)
            if size is not None and (size < 1 or self.rollout_batch_size % size):
                raise ValueError(f"rollout_batch_size={self.rollout_batch_size} must be a multiple of {name}={size}.")

    def kl_controller(self) -> ppo.FixedKLController | ppo.AdaptiveKLController:
        if self.adaptive_kl:
            return ppo.AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon)
        return ppo.FixedKLController(self.kl_coef)

    def optimizer_steps(self, max_steps: int, micro_batch_size: int, grad_accum: int) -> int:
        """Optimizer steps of a trainable role over ``max_steps`` PPO steps: each runs ``ppo_epochs`` passes over
        ``rollout_batch_size`` rows in micro batches of ``micro_batch_size``, stepping every ``grad_accum``."""
        return max_steps * self.ppo_epochs * (self.rollout_batch_size // micro_batch_size) // grad_accum


def plot_panels(sources: Sequence[RewardSource], judged: bool) -> list[tuple[str, list[str]]]:
    """The panels of a PPO run's curves: the reward (the reward model's score when that is the only source), the
    built-in task's judge (``judged``) and the KL to ref."""
    only_rm = [src.name for src in sources] == ["reward"]
    panels = [("reward-model score" if only_rm else "reward (weighted sum)", ["train/reward/mean", "eval/reward"])]
    if judged:
        panels.append(("judge score (built-in task)", ["train/judge/mean", "eval/judge"]))
    panels.append(("KL to ref (nats per answer)", ["train/kl", "eval/kl"]))
    return panels


class PPOTrainer:
    """Experience making and the PPO update over actor, ref, critic and reward sources (and ema).

    Args:
        registry: holds the roles (e.g. built with :func:`roles.build_rlhf_roles`).
        generation: sampling settings (temperature also scales the PPO log-probs).
        settings: :class:`PPOSettings`.
        eos_token_id / pad_token_id: the tokenizer's.
        seed: sampling seeds derive from ``(seed, step, rank)``, so a resumed run samples the same tokens.
        judge: optional programmatic ``judge(prompt, answer)`` logged next to the reward (``decode`` needed).
        decode: ``response_ids [B, T] -> list[str]`` (needed by reward functions and the judge).
        rewards: reward sources (:func:`rewards.reward_model` / :func:`rewards.reward_function`);
            default: the ``reward`` role. A reward model with its own tokenizer carries a ``Retokenizer``.
        critic_retokenizer: a ``Retokenizer`` from the actor's tokenizer to the critic's, when they differ:
            the critic then reads the re-encoded rows, its values taken where the text before each action ends.
        actor / ref / critic / ema: role names (``ema`` is used when the registry has it).
    """

    def __init__(
        self,
        registry: EngineRegistry,
        generation: GenerationSettings,
        settings: PPOSettings,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        judge: Judge | None = None,
        decode: Callable[[torch.Tensor], list[str]] | None = None,
        *,
        rewards: Sequence[RewardSource] | None = None,
        actor: str = "actor",
        ref: str = "ref",
        critic: str = "critic",
        ema: str = "ema",
        critic_retokenizer: Any = None,
    ) -> None:
        self.registry = registry
        self.generation = generation
        self.settings = settings
        self.eos = int(eos_token_id)
        self.pad = int(pad_token_id)
        self.seed = seed
        self.judge = judge
        self.decode = decode
        self.actor, self.ref, self.critic, self.ema = actor, ref, critic, ema
        self.critic_retokenizer = critic_retokenizer if critic_retokenizer is not None and critic_retokenizer.needed \
            else None
        self.rewards = list(rewards) if rewards is not None else [reward_model("reward")]
        check_sources(self.rewards, registry)
        for role in (actor, ref, critic):
            if role not in registry:
                raise ValueError(f"PPO needs role {role!r}; the registry has {registry.names()}.")
        if any(s.fn is not None for s in self.rewards) and decode is None:
            raise ValueError("reward functions score texts: pass decode= (response ids -> strings).")
        self.kl_ctl = settings.kl_controller()
        self.normalizer = RunningMoments() if settings.normalize_rewards else None
        self.has_ema = ema in registry

    # ---------------------------------------------------------------------------------------------
    def sampling_seed(self, step: int) -> int:
        return sampling_seed(self.seed, step, self.registry.rank)

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], step: int) -> Experience:
        """Generate, score with every role (actor and ref log-probs, critic values, reward sources),
        then per-token rewards (k1 KL penalty + clipped score on the last action), GAE and whitening.

        Args:
            batch: a :class:`PromptCollator` batch: ``input_ids`` / ``attention_mask`` ``[B, C]``,
                ``prompts`` (texts).
            step: PPO step, seeds the sampling.
        """
        s = self.settings
        exp = make_experience(
            self.registry, batch, step, generation=self.generation, eos_token_id=self.eos, pad_token_id=self.pad,
            rewards=self.rewards, decode=self.decode, actor=self.actor, ref=self.ref, critic=self.critic,
            seed=self.seed, no_eos_penalty=s.no_eos_penalty, critic_retokenizer=self.critic_retokenizer)
        t0 = time.perf_counter()
        score = exp.score
        if self.normalizer is not None:
            self.normalizer.update(score)
            score = self.normalizer.normalize(score)
        # rewards, GAE (returns before whitening), whitening over the whole rollout (all ranks)
        exp.rewards = ppo.compute_rewards(score, exp.logprobs, exp.ref_logprobs, exp.action_mask, self.kl_ctl.value,
                                          s.clip_reward, s.kl_clamp)
        advantages, exp.returns = ppo.gae(exp.rewards, exp.values, exp.action_mask, s.gamma, s.lam)
        exp.advantages = ppo.masked_whiten(advantages, exp.action_mask) if s.whiten_advantages else advantages
        exp.timings["experience_s"] += time.perf_counter() - t0
        return exp

    def train_on(self, exp: Experience, step: int, ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None,
                 stats: StepStats | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatches over one frozen rollout; actor and critic step separately.

        Returns global means (over ranks and micro-batches) of the losses and statistics (with
        ``stats``: added to it instead, ``{}`` returned).
        """
        s = self.settings
        return train_on_experience(
            self.registry, exp, step, mini_batch_size=s.mini_batch_size,
            critic_mini_batch_size=s.critic_mini_batch_size, temperature=self.generation.temperature,
            actor=self.actor, critic=self.critic, epochs=s.ppo_epochs, clip_eps=s.clip_eps, dual_clip=s.dual_clip,
            value_clip=s.value_clip, train_actor=step >= s.critic_warmup_steps, ptx_batches=ptx_batches,
            ptx_coef=s.ptx_coef, shuffle=s.shuffle_minibatches, seed=self.seed, stats=stats)

    # ---------------------------------------------------------------------------------------------
    def step(self, batch: dict[str, Any], step: int,
             ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """One PPO step: experience, update, EMA, KL-controller update. Returns the step's metrics."""
        t0 = time.perf_counter()
        exp = self.make_experience(batch, step)
        stats = StepStats()  # every scalar metric of the step, reduced over ranks once, at the end
        self.rollout_metrics(exp, stats)
        t1 = time.perf_counter()
        self.train_on(exp, step, ptx_batches, stats)
        t_train = time.perf_counter() - t1
        if self.has_ema:
            ema_update(self.registry[self.ema].module, self.registry[self.actor].module, self.settings.ema_decay)
        timings = step_timings(exp, t_train, time.perf_counter() - t0, stats)
        metrics = stats.reduce()
        n_rows = exp.sequences.shape[0] * self.registry.world_size
        self.kl_ctl.update(metrics["kl"], n_rows)
        return {**metrics, "kl_coef": self.kl_ctl.value, **timings}

    def rollout_metrics(self, exp: Experience, stats: StepStats | None = None) -> dict[str, float]:
        """Reward, KL and length statistics of a rollout, over all ranks (with ``stats``: added to it)."""
        return rollout_metrics(exp, self.judge, stats)

    # ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_ctl": self.kl_ctl.state_dict()}
        if self.normalizer is not None:
            state["normalizer"] = self.normalizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.normalizer is not None and "normalizer" in state:
            self.normalizer.load_state_dict(state["normalizer"])


"""PPO (RLHF step 3) on the registry: rollout with a critic, per-token rewards with the k1 KL penalty, GAE and
whitening, then the actor and critic updates (the pieces live in rollout.py, ppo.py and update.py; this class holds
the settings and the state that must survive a resume)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, ema_update
from multiengine.engines.settings import Range, Satisfies, Settings, setting

from . import ppo
from .losses import ROLLOUT_IS_HELP
from .rewards import RewardSource, RunningMoments, check_sources, reward_model
from .rollout import Experience, RolloutSpec, StepStats, make_experience, rollout_metrics, sampling_seed, step_timings
from .schedule import ScheduledRollouts, score_answers
from .update import train_on_experience

__all__ = ["DUAL_CLIP", "SUMMARY_TIMINGS", "PPOSettings", "PPOTrainer", "plot_panels", "summary_timings"]

# the per-step timings (rollout.step_timings) whose means a run's summary reports
SUMMARY_TIMINGS = ("time/step_s", "time/generation_s", "time/experience_s", "time/train_s", "gen/tokens_per_s",
                   "gen/ms_per_token")
ROLLOUT_SUMMARY = ("rollout/sync_s", "rollout/sync_bytes", "rollout/logprob_mismatch")  # generation.engine=vllm's
DUAL_CLIP = Satisfies(lambda c: type(c) in (int, float) and (c == 0 or c > 1), "0 (off) or > 1")


@dataclass(frozen=True)
class PPOSettings(Settings):
    """The PPO step (a recipe's ``ppo`` section)."""

    rollout_batch_size: int = setting(32, "prompts per rank per step (a multiple of roles.actor.micro_batch_size)",
                                      Range(1))
    epochs: int = setting(2, "passes over one rollout", Range(1))
    clip_eps: float = setting(0.2, "policy ratio clip", Range(0, min_exclusive=True))
    value_clip: float = setting(0.2, "0 = unclipped value loss", Range(0))
    dual_clip: float = setting(0.0, "0 = off; > 1 caps the loss of negative-advantage tokens at -dual_clip x A (3.0 = "
                                    "verl's vanilla loss, which always caps)", DUAL_CLIP)
    gamma: float = setting(1.0, "discount", Range(0, 1))
    lam: float = setting(0.95, "GAE lambda", Range(0, 1))
    kl_coef: float = setting(0.1, "beta of the k1 KL penalty in the reward", Range(0))
    adaptive_kl: bool = setting(False, "adapt beta towards kl_target (Ziegler et al.)")
    kl_target: float = setting(6.0, "target KL per answer of the adaptive controller", Range(0, min_exclusive=True),
                               when="adaptive_kl")
    kl_horizon: int = setting(10000, "horizon of the adaptive controller", Range(1), when="adaptive_kl")
    clip_reward: float = setting(5.0, "0 = no clipping", Range(0))
    whiten_advantages: bool = setting(True, "whiten advantages over the whole rollout (all ranks)")
    no_eos_penalty: float = setting(0.0, "> 0: subtracted from the score of answers without EOS", Range(0))
    ptx_coef: float = setting(0.0, "> 0: unsupervised (SFT data) loss mixed into the actor, as in DeepSpeed-Chat",
                              Range(0))
    critic_warmup_steps: int = setting(0, "first N steps train only the critic", Range(0))
    rollout_is_cap: float = setting(0.0, ROLLOUT_IS_HELP, Range(0))
    shuffle_minibatches: bool = setting(True, "seeded minibatch order")

    # what the update reads beside the fields (update.train_on_experience): PPO's objective, its token mean, and
    # the KL in the reward, not in the loss
    objective = "ppo"
    aggregation = "token_mean"
    kl_loss_coef = 0.0

    def kl_controller(self) -> ppo.FixedKLController | ppo.AdaptiveKLController:
        if self.adaptive_kl:
            return ppo.AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon)
        return ppo.FixedKLController(self.kl_coef)

    def optimizer_steps(self, max_steps: int, micro_batch_size: int, grad_accum: int) -> int:
        """Optimizer steps of a trainable role over ``max_steps`` PPO steps: each runs ``epochs`` passes over
        ``rollout_batch_size`` rows in micro batches of ``micro_batch_size``, stepping every ``grad_accum``."""
        return max_steps * self.epochs * (self.rollout_batch_size // micro_batch_size) // grad_accum


def summary_timings(engine: str) -> tuple[str, ...]:
    """The per-step figures whose means a policy recipe's summary holds (``generation.engine``: vllm adds the rollout
    engine's sync time and bytes and log-prob mismatch)."""
    return SUMMARY_TIMINGS + (ROLLOUT_SUMMARY if engine == "vllm" else ())


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

    ``spec``: the rollout's roles (``actor``, ``ref``, ``critic`` all needed), token ids, sampling, rewards (none
    given: the ``reward`` role), decode, judge and seed. ``micro_batch_size`` / ``critic_micro_batch_size`` (None =
    the actor's): each role's rows per forward/backward in the update (roles.<name>.micro_batch_size).
    ``normalize_rewards``: a running mean/std of the score over all ranks, before clipping. ``ema_decay``: update
    the ``ema`` role after every step (None = no EMA).
    """

    def __init__(self, registry: EngineRegistry, settings: PPOSettings, spec: RolloutSpec, micro_batch_size: int,
                 critic_micro_batch_size: int | None = None, *, normalize_rewards: bool = False,
                 ema_decay: float | None = None, ema: str = "ema") -> None:
        for name, size in (("actor", micro_batch_size), ("critic", critic_micro_batch_size or micro_batch_size)):
            if size < 1 or settings.rollout_batch_size % size:
                raise ValueError(f"rollout_batch_size={settings.rollout_batch_size} must be a multiple of the "
                                 f"{name}'s micro batch {size}.")
        if spec.ref is None or spec.critic is None:
            raise ValueError(f"PPO needs a ref and a critic role, got ref={spec.ref!r}, critic={spec.critic!r}.")
        spec = dataclasses.replace(spec, rewards=list(spec.rewards) or [reward_model("reward")])
        check_sources(spec.rewards, registry)
        for role in (spec.actor, spec.ref, spec.critic):
            if role not in registry:
                raise ValueError(f"PPO needs role {role!r}; the registry has {registry.names()}.")
        if any(s.fn is not None for s in spec.rewards) and spec.decode is None:
            raise ValueError("reward functions score texts: pass decode= (response ids -> strings).")
        if (ema_decay is not None) != (ema in registry):
            raise ValueError(f"ema_decay={ema_decay} and the registry's roles {registry.names()} disagree: the {ema!r} "
                             "role is updated after every step with ema_decay; pass both or neither.")
        self.registry, self.settings, self.spec = registry, settings, spec
        self.micro_batch_size, self.critic_micro_batch_size = micro_batch_size, critic_micro_batch_size
        self.ema_decay, self.ema = ema_decay, ema
        self.kl_ctl = settings.kl_controller()
        self.normalizer = RunningMoments() if normalize_rewards else None
        self.scheduled: ScheduledRollouts | None = None  # rollouts ahead of the update (schedule)

    def sampling_seed(self, step: int) -> int:
        return sampling_seed(self.spec.seed, step, self.registry.rank)

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], step: int) -> Experience:
        """Generate, score with every role (actor and ref log-probs, critic values, reward sources), then per-token
        rewards (k1 KL penalty + clipped score on the last action), GAE and whitening; ``step`` seeds the sampling."""
        return self._estimate(make_experience(self.registry, batch, step, self.spec,
                                              no_eos_penalty=self.settings.no_eos_penalty))

    def schedule(self, depth: int, prompts: Iterator[dict[str, Any]], remote: Any = None) -> None:
        """Rollouts ``depth`` steps ahead of the update (schedule.py; 0 = lockstep), drawn from ``prompts``;
        ``remote`` (a RemoteRollouts): generated on rollout ranks. :meth:`step` then takes no batch."""
        s = self.settings

        def produce(batch: dict[str, Any], index: int) -> Experience:
            return make_experience(self.registry, batch, index, self.spec, no_eos_penalty=s.no_eos_penalty)

        def score(answers: dict[str, Any]) -> Experience:
            return score_answers(self.registry, answers, self.spec, 1, s.no_eos_penalty)

        self.scheduled = ScheduledRollouts(self.registry, depth, prompts, produce, score, remote)

    def _estimate(self, exp: Experience) -> Experience:
        """Per-token rewards, GAE and whitening of a scored rollout."""
        s = self.settings
        t0 = time.perf_counter()
        score = exp.score
        if self.normalizer is not None:
            self.normalizer.update(score)
            score = self.normalizer.normalize(score)
        # rewards, GAE (returns before whitening), whitening over the whole rollout (all ranks)
        exp.rewards = ppo.compute_rewards(score, exp.logprobs, exp.ref_logprobs, exp.action_mask, self.kl_ctl.value,
                                          s.clip_reward)
        advantages, exp.returns = ppo.gae(exp.rewards, exp.values, exp.action_mask, s.gamma, s.lam)
        exp.advantages = ppo.masked_whiten(advantages, exp.action_mask) if s.whiten_advantages else advantages
        exp.timings["experience_s"] = exp.timings.get("experience_s", 0.0) + time.perf_counter() - t0
        return exp

    def train_on(self, exp: Experience, step: int, ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None,
                 stats: StepStats | None = None) -> dict[str, float]:
        """``epochs`` passes of minibatches over one frozen rollout; actor and critic step separately. Returns global
        means (over ranks and micro-batches) of the losses and statistics (with ``stats``: added to it, ``{}``)."""
        return train_on_experience(self.registry, exp, step, self.settings, self.spec, self.micro_batch_size,
                                   self.critic_micro_batch_size, train_actor=step >= self.settings.critic_warmup_steps,
                                   ptx_batches=ptx_batches, stats=stats)

    def step(self, batch: dict[str, Any] | None, step: int,
             ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """One PPO step: experience, update, EMA, KL-controller update. Returns the step's metrics. With a
        :meth:`schedule` ``batch`` is None: the queue draws the prompts."""
        t0 = time.perf_counter()
        exp = self._estimate(self.scheduled.take(step, self.spec)) if self.scheduled is not None else \
            self.make_experience(batch, step)
        stats = StepStats()  # every scalar metric of the step, reduced over ranks once, at the end
        self.rollout_metrics(exp, stats)
        t1 = time.perf_counter()
        self.train_on(exp, step, ptx_batches, stats)
        t_train = time.perf_counter() - t1
        if self.ema_decay is not None:
            ema_update(self.registry[self.ema].module, self.registry[self.spec.actor].module, self.ema_decay)
        queued = self.scheduled.finish(exp, step) if self.scheduled is not None else {}  # the batches in flight land
        timings = step_timings(exp, t_train, time.perf_counter() - t0, stats)
        metrics = stats.reduce()
        self.kl_ctl.update(metrics["kl"], exp.sequences.shape[0] * self.registry.world_size)
        return {**metrics, "kl_coef": self.kl_ctl.value, **timings, **queued}

    def rollout_metrics(self, exp: Experience, stats: StepStats | None = None) -> dict[str, float]:
        """Reward, KL and length statistics of a rollout, over all ranks (with ``stats``: added to it)."""
        return rollout_metrics(exp, self.spec.judge, stats)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_ctl": self.kl_ctl.state_dict()}
        if self.normalizer is not None:
            state["normalizer"] = self.normalizer.state_dict()
        if self.scheduled is not None:
            state["queue"] = self.scheduled.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.normalizer is not None and "normalizer" in state:
            self.normalizer.load_state_dict(state["normalizer"])
        if self.scheduled is not None and state.get("queue") is not None:
            self.scheduled.load_state_dict(state["queue"])

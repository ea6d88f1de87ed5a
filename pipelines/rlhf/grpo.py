"""Critic-free policy optimisation on the registry: GRPO, Dr. GRPO, RLOO and REINFORCE++.

Roles: a trainable ``actor``, a frozen ``ref`` (optional when ``kl_coef = 0``) and the reward
sources (reward-model roles and/or Python reward functions); no critic. Each step samples
``n_samples_per_prompt`` completions of each of a rank's prompts (a group = consecutive rows on one
rank), turns the group's rewards into advantages (advantages.py) and runs clipped policy-gradient
epochs over the rollout (update.py).

Defaults per algorithm (each can be overridden):

============  =============================  ===================  ========================
algorithm     sequence advantage             KL                   loss normalisation
============  =============================  ===================  ========================
grpo          (r - mean_g) / (std_g + eps)   k3 loss term         seq_mean_token_mean
dr_grpo       r - mean_g                     k3 loss term         seq_mean_token_sum_norm
rloo          r - mean of the other n-1      k1 in the reward     token_mean
reinforce_pp  r, then global whitening       k1 in the reward     token_mean
============  =============================  ===================  ========================
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum

from .advantages import CRITIC_FREE, critic_free_advantages
from .dynamic_sampling import DynamicSampler, collect_groups, group_row_indices, round_seed
from .generation import GenerationSettings
from .losses import LOSS_AGG_MODES
from .policy_variants import IMPORTANCE_LEVELS, overlong_penalty
from .rewards import RewardSource, RunningMoments, check_sources
from .rollout import Experience, StepStats, concat_experiences, make_experience, rollout_metrics, step_timings
from .update import train_on_experience

__all__ = ["FlatGroupWatch", "GRPOSettings", "GRPOTrainer", "judge_prompt_problem", "plot_panels"]

logger = logging.getLogger(__name__)

Judge = Callable[[str, str], float]
# a rollout maker other than make_experience (multi-turn): (prompt batch, step, sampling seed) -> Experience
# with score set (collective: the same number of forwards of every role on every rank)
Rollout = Callable[[dict[str, Any], int, int], Experience]

_KL_IN_REWARD = {"grpo": False, "dr_grpo": False, "rloo": True, "reinforce_pp": True}
_LOSS_AGG = {"grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm", "rloo": "token_mean",
             "reinforce_pp": "token_mean"}


@dataclass
class GRPOSettings:
    """Hyper-parameters of the critic-free family (``None`` = the algorithm's default, table above)."""

    algorithm: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp
    n_samples_per_prompt: int = 4
    rollout_batch_size: int = 4  # prompts per rank per step (rows = prompts x samples)
    mini_batch_size: int = 8  # rows per rank per forward/backward
    epochs: int = 1  # passes over one rollout (1: ratio = 1, the plain policy gradient)
    clip_eps: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.04  # beta (DeepSeekMath's GRPO); 0 = no KL and no ref forward
    kl_in_reward: bool | None = None  # True: -beta*k1 in the reward; False: beta*k3 loss term
    kl_clamp: float | None = None  # clamp each token's KL estimate to +/- this
    loss_agg: str | None = None
    gamma: float = 1.0  # discount of the returns-to-go (rloo, reinforce_pp with KL in the reward)
    std_eps: float = 1e-6
    clip_reward: float | None = 5.0
    normalize_rewards: bool = False  # running mean/std of the score (all ranks), before clipping
    no_eos_penalty: float | None = None
    shuffle_minibatches: bool = True
    # DAPO / GSPO variants (policy_variants.py; None = clip_eps: the symmetric clip, unchanged)
    clip_low: float | None = None
    clip_high: float | None = None
    importance_level: str = "token"  # token | sequence (GSPO)
    overlong_buffer: int = 0  # 0 = off; else the last this-many tokens before max_new_tokens ramp a penalty
    overlong_penalty: float = 1.0
    # DAPO's dynamic sampling (dynamic_sampling.py): drop groups with all-equal rewards, sample again
    dynamic_sampling: bool = False
    max_resample_rounds: int = 4
    # warn when more than this share of the groups is flat (all rewards equal) for flat_warn_steps steps in a row
    flat_warn_share: float = 0.8  # 1 = never
    flat_warn_steps: int = 5

    def __post_init__(self) -> None:
        if self.algorithm not in CRITIC_FREE:
            raise ValueError(f"algorithm={self.algorithm!r}; use one of {list(CRITIC_FREE)} (PPOTrainer for ppo).")
        n = self.n_samples_per_prompt
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}.")
        if n < 2 and self.algorithm in ("grpo", "dr_grpo", "rloo"):
            raise ValueError(f"algorithm={self.algorithm} compares completions of one prompt: n_samples_per_prompt="
                             f"{n} gives zero advantages; use >= 2 (e.g. 4), or algorithm=reinforce_pp.")
        rows = self.rollout_batch_size * n
        if self.rollout_batch_size < 1 or self.mini_batch_size < 1 or rows % self.mini_batch_size:
            raise ValueError(f"rollout_batch_size x n_samples_per_prompt = {rows} rows per rank must be a multiple of "
                             f"mini_batch_size={self.mini_batch_size}.")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}.")
        if self.loss_agg is not None and self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg={self.loss_agg!r}; use one of {list(LOSS_AGG_MODES)}.")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"kl_clamp must be > 0 (or None), got {self.kl_clamp}.")
        low = self.clip_eps if self.clip_low is None else self.clip_low
        if (self.clip_low is not None or self.clip_high is not None) and not 0.0 <= low < 1.0:
            raise ValueError(f"clip_low={low!r}: the ratio's lower bound is 1 - clip_low; use 0 <= clip_low < 1.")
        if self.clip_high is not None and self.clip_high < 0:
            raise ValueError(f"clip_high={self.clip_high!r}: the ratio's upper bound is 1 + clip_high; use >= 0 "
                             "(DAPO: 0.28).")
        if self.importance_level not in IMPORTANCE_LEVELS:
            raise ValueError(f"importance_level={self.importance_level!r}; use one of {list(IMPORTANCE_LEVELS)}.")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"overlong_buffer={self.overlong_buffer}, overlong_penalty={self.overlong_penalty}: "
                             "both >= 0 (buffer 0 = off).")
        if self.dynamic_sampling:
            DynamicSampler(self.rollout_batch_size, self.max_resample_rounds)  # range checks
        FlatGroupWatch(self.flat_warn_share, self.flat_warn_steps)  # range checks

    @property
    def resolved_kl_in_reward(self) -> bool:
        return _KL_IN_REWARD[self.algorithm] if self.kl_in_reward is None else self.kl_in_reward

    @property
    def resolved_loss_agg(self) -> str:
        return self.loss_agg or _LOSS_AGG[self.algorithm]


class FlatGroupWatch:
    """Tells when a run learns from few of its groups: a group whose answers all got the same reward has zero
    advantages, so it adds nothing to the gradient (only the KL term moves the policy).

    :meth:`update` takes a step's share of flat groups (``reward/flat_groups``) and returns a warning, with
    what to change, at the step where more than ``share`` of the groups have been flat for ``steps`` steps in
    a row (once per such streak; a step at or below ``share`` ends it), else ``None``.
    """

    def __init__(self, share: float = 0.8, steps: int = 5) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"flat_warn_share={share!r}: a share of groups in [0, 1] (1 = never warn).")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"flat_warn_steps={steps!r}: a number of steps >= 1.")
        self.share = float(share)
        self.steps = steps
        self.streak = 0

    def update(self, flat_share: float, n_samples: int | None = None, temperature: float | None = None) -> str | None:
        """Count this step; the warning text on the step a streak reaches ``steps``. ``n_samples`` and
        ``temperature`` (the current settings) are named in the advice."""
        if not flat_share > self.share:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak != self.steps:
            return None
        now_n = f", now {n_samples}" if n_samples is not None else ""
        now_t = f", now {temperature:g}" if temperature is not None else ""
        return (f"{flat_share:.0%} of the prompt groups were flat at this step, and more than {self.share:.0%} for "
                f"{self.steps} steps in a row (reward/flat_groups): every answer to such a prompt got the same "
                "reward, so its advantages are 0 and nothing is learned from it. Sample more answers per prompt "
                f"(n_samples_per_prompt{now_n}), sample at a higher temperature (temperature{now_t}), or use a "
                "denser reward (partial credit instead of 0/1, or a shaping function added with a small weight). "
                "If every answer already gets the best reward, the task is learned: stop, or train on harder "
                "prompts.")

    def state_dict(self) -> dict[str, int]:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))


class GRPOTrainer:
    """One critic-free step: rollout of ``n`` samples per prompt, group advantages, policy update.

    Args:
        registry: with a trainable ``actor``, a frozen ``ref`` (unless ``ref=None`` and ``kl_coef = 0``)
            and the reward-model roles named by ``rewards``.
        generation: sampling settings (``do_sample`` must be on: a group of identical greedy answers
            has no spread); ``max_new_tokens`` is Dr. GRPO's normalising constant.
        settings: :class:`GRPOSettings`.
        eos_token_id / pad_token_id: the tokenizer's.
        rewards: reward sources (:func:`rewards.reward_model` / :func:`rewards.reward_function`).
        decode: ``response_ids [B, T] -> list[str]`` (needed by reward functions and the judge).
        seed: sampling seeds derive from ``(seed, step, rank)`` (and the round, with dynamic sampling).
        judge: optional ``judge(prompt, answer)`` logged as ``judge/mean``.
        more_prompts: with dynamic sampling, the next batch of prompts for another round (every rank draws
            the same number); ``None`` samples the step's prompts again with the round's seed.
        rollout: ``rollout(batch, step, sampling_seed) -> Experience`` (score set) in place of the single
            completion rollout, e.g. multi-turn episodes (multiturn.py).
    """

    def __init__(
        self,
        registry: EngineRegistry,
        generation: GenerationSettings,
        settings: GRPOSettings,
        eos_token_id: int,
        pad_token_id: int,
        rewards: Sequence[RewardSource],
        decode: Callable[[torch.Tensor], list[str]] | None = None,
        *,
        actor: str = "actor",
        ref: str | None = "ref",
        seed: int = 0,
        judge: Judge | None = None,
        more_prompts: Callable[[], dict[str, Any]] | None = None,
        rollout: Rollout | None = None,
    ) -> None:
        if not generation.do_sample:
            raise ValueError("critic-free estimators compare several samples of a prompt: set do_sample=True.")
        if rollout is None or rewards:  # a custom rollout (multi-turn) may bring its own score
            check_sources(rewards, registry)
        if actor not in registry or not registry.role(actor).trainable:
            raise ValueError(f"actor role {actor!r} must be a trainable role of the registry ({registry.names()}).")
        if settings.kl_coef > 0 and (ref is None or ref not in registry):
            raise ValueError(f"kl_coef={settings.kl_coef} needs the ref role {ref!r} (registry: {registry.names()}); "
                             "build one or set kl_coef=0.")
        if any(s.fn is not None for s in rewards) and decode is None:
            raise ValueError("reward functions score texts: pass decode= (response ids -> strings).")
        self.registry = registry
        self.generation = generation
        self.settings = settings
        self.eos, self.pad = int(eos_token_id), int(pad_token_id)
        self.rewards = list(rewards)
        self.decode = decode
        self.actor = actor
        self.ref = ref if settings.kl_coef > 0 else None
        self.seed = seed
        self.judge = judge
        self.normalizer = RunningMoments() if settings.normalize_rewards else None
        self.flat_watch = FlatGroupWatch(settings.flat_warn_share, settings.flat_warn_steps)
        self.more_prompts = more_prompts
        self.rollout = rollout
        self.sampler = (DynamicSampler(settings.rollout_batch_size, settings.max_resample_rounds)
                        if settings.dynamic_sampling else None)
        self.dynamic: dict[str, float] = {}  # the last step's dynamic sampling counts (this rank)

    def _sample(self, batch: dict[str, Any], step: int, seed: int) -> Experience:
        """One rollout with its score (and the overlong penalty)."""
        s = self.settings
        if self.rollout is not None:
            exp = self.rollout(batch, step, seed)
        else:
            exp = make_experience(
                self.registry, batch, step, generation=self.generation, eos_token_id=self.eos,
                pad_token_id=self.pad, rewards=self.rewards, decode=self.decode, actor=self.actor, ref=self.ref,
                critic=None, n_samples_per_prompt=s.n_samples_per_prompt, seed=self.seed,
                no_eos_penalty=s.no_eos_penalty, sample_seed=seed)
        if s.overlong_buffer:
            penalty = overlong_penalty(exp.action_mask.sum(-1), self.generation.max_new_tokens, s.overlong_buffer,
                                       s.overlong_penalty).to(exp.score.device)
            exp.score = exp.score + penalty
            exp.reward_parts["overlong"] = penalty
        return exp

    def _dynamic_rollout(self, batch: dict[str, Any], step: int) -> Experience:
        """Rounds of rollouts until every rank holds ``rollout_batch_size`` groups with a reward spread (or the
        cap): the kept groups' rows in one Experience."""
        G, rank = self.settings.n_samples_per_prompt, self.registry.rank
        timings: dict[str, float] = {}  # every round's, kept or not

        def sample(round_: int) -> tuple[torch.Tensor, Experience]:
            prompts = batch if round_ == 0 or self.more_prompts is None else self.more_prompts()
            exp = self._sample(prompts, step, round_seed(self.seed, step, round_, rank))
            for k, v in exp.timings.items():
                timings[k] = timings.get(k, 0.0) + v
            return exp.score.reshape(-1, G), exp

        def sync(here: bool) -> bool:  # every rank samples as many rounds as the neediest
            return bool(all_reduce_sum(torch.tensor([float(here)], dtype=torch.float64)).item() > 0)

        assert self.sampler is not None
        selection, self.dynamic = collect_groups(sample, self.sampler, sync)
        parts = [exp.rows(group_row_indices(groups, G)) for exp, groups in selection]
        exp = concat_experiences(parts, self.pad, G)
        exp.timings = timings
        return exp

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], step: int) -> Experience:
        """Rollout (``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows) with rewards and
        advantages set (collective)."""
        s = self.settings
        if self.sampler is not None:
            exp = self._dynamic_rollout(batch, step)
        else:
            exp = self._sample(batch, step, round_seed(self.seed, step, 0, self.registry.rank))
        t0 = time.perf_counter()
        score = exp.score
        if self.normalizer is not None:
            self.normalizer.update(score)
            score = self.normalizer.normalize(score)
        exp.advantages, exp.rewards = critic_free_advantages(
            s.algorithm, score, exp.logprobs, exp.ref_logprobs, exp.action_mask, s.n_samples_per_prompt,
            kl_coef=s.kl_coef, kl_in_reward=s.resolved_kl_in_reward, kl_clamp=s.kl_clamp,
            clip_reward=s.clip_reward, gamma=s.gamma, std_eps=s.std_eps)
        exp.timings["experience_s"] += time.perf_counter() - t0
        return exp

    def train_on(self, exp: Experience, step: int, stats: StepStats | None = None) -> dict[str, float]:
        """``epochs`` passes of minibatches over the rollout (KL loss term unless it is in the reward).
        With ``stats``, the statistics are added to it and ``{}`` is returned."""
        s = self.settings
        kl_loss_coef = 0.0 if s.resolved_kl_in_reward else s.kl_coef
        return train_on_experience(
            self.registry, exp, step, mini_batch_size=s.mini_batch_size, temperature=self.generation.temperature,
            actor=self.actor, critic=None, epochs=s.epochs, clip_eps=s.clip_eps, dual_clip=s.dual_clip,
            clip_low=s.clip_low, clip_high=s.clip_high, importance_level=s.importance_level,
            loss_agg=s.resolved_loss_agg, horizon=self.generation.max_new_tokens, kl_coef=kl_loss_coef,
            kl_estimator="k3", kl_clamp=s.kl_clamp, shuffle=s.shuffle_minibatches, seed=self.seed, stats=stats)

    def rollout_metrics(self, exp: Experience, stats: StepStats | None = None) -> dict[str, float]:
        """Reward, KL, length and group statistics of a rollout, over all ranks (with ``stats``: added to it)."""
        return rollout_metrics(exp, self.judge, stats)

    def step(self, batch: dict[str, Any], step: int) -> dict[str, float]:
        """One step: rollout, advantages, update. Returns the step's metrics (global means)."""
        t0 = time.perf_counter()
        exp = self.make_experience(batch, step)
        stats = StepStats()  # every scalar metric of the step, reduced over ranks once, at the end
        self.rollout_metrics(exp, stats)
        if self.sampler is not None:  # global: dropped / seen groups over all ranks
            d = self.dynamic
            stats.add("dynamic/dropped_rate", [d["dynamic/groups_dropped"], d["dynamic/groups_seen"]],
                      lambda dropped, seen: dropped / seen if seen else 0.0)
            for key in ("dynamic/rounds", "dynamic/filled", "dynamic/surplus"):
                stats.add(key, [d[key], 1.0], lambda total, n: total / n)
        t1 = time.perf_counter()
        self.train_on(exp, step, stats)
        t_train = time.perf_counter() - t1
        timings = step_timings(exp, t_train, time.perf_counter() - t0, stats)
        metrics = {**stats.reduce(), "kl_coef": self.settings.kl_coef, **timings}
        if "reward/flat_groups" in metrics:  # the same global value on every rank: the streaks agree
            warning = self.flat_watch.update(metrics["reward/flat_groups"], self.settings.n_samples_per_prompt,
                                             self.generation.temperature)
            if warning and self.registry.is_main:
                logger.warning("%s", warning)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.settings.algorithm,
                "normalizer": self.normalizer.state_dict() if self.normalizer is not None else None,
                "flat_watch": self.flat_watch.state_dict(),
                "dynamic": self.sampler.state_dict() if self.sampler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("algorithm", self.settings.algorithm) != self.settings.algorithm:
            raise ValueError(f"checkpoint was written by algorithm={state['algorithm']!r}, this run is "
                             f"{self.settings.algorithm!r}.")
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.flat_watch.load_state_dict(state.get("flat_watch") or {})
        if self.sampler is not None and state.get("dynamic") is not None:
            self.sampler.load_state_dict(state["dynamic"])


def judge_prompt_problem(sources: Sequence[RewardSource], prompts: Sequence[str]) -> str | None:
    """The first of ``prompts`` that ``builtin:judge`` (a source among ``sources``) cannot score, else ``None``:
    it scores only the built-in task's prompts, so any other prompt would score 0 everywhere."""
    from . import tiny
    from .rewards import judge_reward

    if not any(src.fn is judge_reward for src in sources):
        return None
    return next((p for p in prompts if tiny.parse_prompt(p) is None), None)


def plot_panels(sources: Sequence[RewardSource], judged: bool, reward_role: str | None, ref: str | None,
                episodes: bool) -> list[tuple[str, list[str]]]:
    """The panels of a critic-free run's curves: reward (unless the judge alone is it), a reward model's score,
    the judge, KL to ref, and multi-turn episodes' success and turns."""
    from .rewards import judge_reward

    panels = []
    if [src.fn for src in sources] != [judge_reward] or not judged:  # else the judge panel has it
        panels.append(("reward (weighted sum)", ["train/reward/mean", "eval/reward"]))
    if reward_role:
        panels.append((f"reward-model score ({reward_role})", [f"train/reward/{reward_role}",
                                                                f"eval/reward/{reward_role}"]))
    if judged:
        panels.append(("judge score (built-in task)", ["train/judge/mean", "eval/judge"]))
    if ref:
        panels.append(("KL to ref (nats per answer)", ["train/kl", "eval/kl"]))
    if episodes:
        panels.append(("episodes: success, turns", ["train/multiturn/success", "eval/success",
                                                    "train/multiturn/turns", "eval/turns"]))
    return panels


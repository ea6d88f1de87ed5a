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

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum
from multiengine.engines.settings import Choice, FieldError, Range, Satisfies, Settings, setting

from .advantages import CRITIC_FREE, critic_free_advantages, overlong_penalty
from .dynamic_sampling import DynamicSampler, collect_groups, group_row_indices, round_seed
from .losses import IMPORTANCE_LEVELS, LOSS_AGG_MODES, ROLLOUT_IS_HELP
from .multiturn import BUILTIN_ENVS, MultiTurnRollouts
from .ppo_trainer import DUAL_CLIP
from .rewards import RewardSource, RunningMoments, check_sources
from .rollout import (
    Experience,
    RolloutSpec,
    StepStats,
    concat_experiences,
    make_experience,
    rollout_metrics,
    step_timings,
)
from .rollout_ranks import RemoteRollouts
from .schedule import ScheduledRollouts, score_answers
from .update import train_on_experience

__all__ = ["FlatGroupWatch", "GRPOSettings", "GRPOTrainer", "judge_prompt_problem", "plot_panels"]

logger = logging.getLogger(__name__)

# a rollout maker other than make_experience (multi-turn): (prompt batch, step, sampling seed) -> Experience
# with score set (collective: the same number of forwards of every role on every rank)
Rollout = Callable[[dict[str, Any], int, int], Experience]

_KL_IN_REWARD = {"grpo": False, "dr_grpo": False, "rloo": True, "reinforce_pp": True}
_LOSS_AGG = {"grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm", "rloo": "token_mean",
             "reinforce_pp": "token_mean"}
_ENV = Satisfies(lambda v: isinstance(v, str) and (v in ("", *BUILTIN_ENVS) or ":" in v and "builtin:" not in v),
                 f"\"\", one of {', '.join(BUILTIN_ENVS)} or module:factory")


@dataclass(frozen=True)
class GRPOSettings(Settings):
    """The critic-free estimator (a recipe's ``grpo`` section); "" / null = the algorithm's default (table above)."""

    algorithm: str = setting("grpo", "grpo | dr_grpo | rloo | reinforce_pp", Choice(*CRITIC_FREE))
    n_samples_per_prompt: int = setting(8, "completions per prompt (a group; >= 2 except reinforce_pp)", Range(1))
    rollout_batch_size: int = setting(8, "prompts per rank per step (rows = prompts x samples, a multiple of "
                                         "roles.actor.micro_batch_size)", Range(1))
    epochs: int = setting(1, "passes over one rollout (1 = ratio 1, the plain policy gradient)", Range(1))
    clip_eps: float = setting(0.2, "policy ratio clip", Range(0, min_exclusive=True))
    dual_clip: float = setting(0.0, "0 = off; > 1 caps the loss of negative-advantage tokens at -dual_clip x A (3.0 = "
                                    "verl's vanilla loss, which always caps)", DUAL_CLIP)
    kl_coef: float = setting(0.04, "beta; 0 = no KL and no ref role", Range(0))
    kl_in_reward: bool | None = setting(None, "null = the algorithm's (k3 loss for grpo/dr_grpo, k1 reward for "
                                              "rloo/reinforce_pp)", Choice(True, False), when="kl_coef")
    kl_clamp: float = setting(0.0, "0 = off; clamp each token's KL estimate to +/- this", Range(0), when="kl_coef")
    loss_aggregation: str = setting("", "\"\" = the algorithm's | token_mean (DAPO) | seq_mean_token_mean (GRPO) | "
                                        "seq_mean_token_sum_norm (Dr. GRPO)", Choice("", *LOSS_AGG_MODES))
    clip_low: float | None = setting(None, "null = clip_eps; the ratio's lower bound is 1 - clip_low",
                                     Range(0, 1, max_exclusive=True))
    clip_high: float | None = setting(None, "null = clip_low; > clip_low is DAPO's clip-higher (e.g. 0.28)", Range(0))
    importance_level: str = setting("token", "token | sequence (GSPO's length-normalised sequence ratio)",
                                    Choice(*IMPORTANCE_LEVELS))
    overlong_buffer: int = setting(0, "0 = off; DAPO's soft overlong penalty of single answers over the last N "
                                      "tokens before generation.max_new_tokens ...", Range(0), when="env=")
    overlong_penalty: float = setting(1.0, "... growing linearly to this at max_new_tokens", Range(0),
                                      when="overlong_buffer")
    dynamic_sampling: bool = setting(False, "DAPO: drop prompt groups whose rewards are all equal, sample new prompts")
    max_resample_rounds: int = setting(4, "sampling rounds per step at most (then the batch is filled with flat "
                                          "groups)", Range(1), when="dynamic_sampling")
    env: str = setting("", "\"\" = one completion per answer; builtin:arithmetic (calculator tool) or module:factory = "
                           "multi-turn episodes, the environment's reward", _ENV, example="builtin:arithmetic")
    max_turns: int = setting(3, "model turns per episode at most", Range(1), when="env")
    max_total_tokens: int = setting(48, "tokens per episode at most, prompt included", Range(2), when="env")
    gamma: float = setting(1.0, "discount of the returns-to-go", Range(0, 1))
    std_eps: float = setting(1.0e-6, "added to the group std", Range(0), when="algorithm=grpo")
    clip_reward: float = setting(5.0, "0 = no clipping", Range(0))
    no_eos_penalty: float = setting(0.0, "> 0: subtracted from the score of answers without EOS (single answers)",
                                    Range(0), when="env=")
    rollout_is_cap: float = setting(0.0, ROLLOUT_IS_HELP, Range(0))
    shuffle_minibatches: bool = setting(True, "seeded minibatch order")
    flat_warn_share: float = setting(0.8, "warn when more than this share of groups has all-equal rewards (1 = "
                                          "never) ...", Range(0, 1))
    flat_warn_steps: int = setting(5, "... for this many steps in a row", Range(1))

    def check(self) -> None:
        n = self.n_samples_per_prompt
        if n < 2 and self.algorithm in ("grpo", "dr_grpo", "rloo"):
            raise FieldError("n_samples_per_prompt", n, f"gives zero advantages with algorithm={self.algorithm}, "
                             "which compares completions of one prompt", "use >= 2 (e.g. 4), or algorithm=reinforce_pp")
        if self.objective != "ppo" and self.clip_low is None and self.clip_eps >= 1:
            raise FieldError("clip_eps", self.clip_eps, f"must be < 1 with the {self.objective} clip (its lower bound "
                             "is 1 - clip_low, clip_low null = clip_eps)", "set clip_eps or clip_low below 1")

    @property
    def resolved_kl_in_reward(self) -> bool:
        return _KL_IN_REWARD[self.algorithm] if self.kl_in_reward is None else self.kl_in_reward

    # what the update reads beside the fields (update.train_on_experience)
    @property
    def aggregation(self) -> str:
        return self.loss_aggregation or _LOSS_AGG[self.algorithm]

    @property
    def objective(self) -> str:
        """The policy loss (losses.POLICY_LOSSES): ``gspo`` (sequence ratio), ``dapo`` (clip_low / clip_high set),
        else ``ppo``'s symmetric clip."""
        if self.importance_level == "sequence":
            return "gspo"
        return "dapo" if self.clip_low is not None or self.clip_high is not None else "ppo"

    @property
    def kl_loss_coef(self) -> float:
        return 0.0 if self.resolved_kl_in_reward else self.kl_coef


class FlatGroupWatch:
    """Tells when a run learns from few of its groups: a group whose answers all got the same reward has advantages
    of exactly 0 (grpo, dr_grpo, rloo), so it adds nothing to the gradient (only the KL term moves the policy).

    :meth:`update` takes a step's share of flat groups (``reward/flat_groups``) and returns a warning, with
    what to change, at the step where more than ``share`` of the groups have been flat for ``steps`` steps in
    a row (once per such streak; a step at or below ``share`` ends it), else ``None``.
    """

    def __init__(self, share: float = 0.8, steps: int = 5) -> None:
        self.share = float(share)  # in [0, 1]; checked as GRPOSettings.flat_warn_share / flat_warn_steps
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

    ``spec``: the rollout's sampling (``do_sample`` must be on: a group of identical greedy answers has no spread;
    ``max_new_tokens`` is Dr. GRPO's normalising constant), token ids, reward sources, decode, judge, seed and roles:
    a trainable ``actor``, a frozen ``ref`` (read only when ``kl_coef > 0``); a critic is never read.
    ``micro_batch_size``: the actor's rows per forward/backward in the update (roles.actor.micro_batch_size).
    ``normalize_rewards``: a running mean/std of the score over all ranks, before clipping. ``more_prompts``: with
    dynamic sampling, the next batch of prompts for another round (every rank draws the same number); None samples
    the step's prompts again with the round's seed. ``rollout(batch, step, sampling_seed) -> Experience`` (score set)
    replaces the single-completion rollout, e.g. multi-turn episodes (multiturn.MultiTurnRollouts; needed with
    ``settings.env``).
    """

    def __init__(self, registry: EngineRegistry, settings: GRPOSettings, spec: RolloutSpec, micro_batch_size: int, *,
                 normalize_rewards: bool = False, more_prompts: Callable[[], dict[str, Any]] | None = None,
                 rollout: Rollout | None = None) -> None:
        s = settings
        if not spec.generation.do_sample:
            raise ValueError("critic-free estimators compare several samples of a prompt: set do_sample=True.")
        if s.env and rollout is None:
            raise ValueError(f"env={s.env!r} samples episodes: pass rollout=multiturn.MultiTurnRollouts(...).")
        rows = s.rollout_batch_size * s.n_samples_per_prompt
        if micro_batch_size < 1 or rows % micro_batch_size:
            raise ValueError(f"rollout_batch_size x n_samples_per_prompt = {rows} rows per rank must be a multiple of "
                             f"the actor's micro batch {micro_batch_size}.")
        if rollout is None or spec.rewards:  # a custom rollout (multi-turn) may bring its own score
            check_sources(spec.rewards, registry)
        if spec.actor not in registry or not registry.role(spec.actor).trainable:
            raise ValueError(f"actor role {spec.actor!r} must be a trainable role of the registry {registry.names()}.")
        if s.kl_coef > 0 and (spec.ref is None or spec.ref not in registry):
            raise ValueError(f"kl_coef={s.kl_coef} needs the ref role {spec.ref!r} (registry: {registry.names()}); "
                             "build one or set kl_coef=0.")
        if any(src.fn is not None for src in spec.rewards) and spec.decode is None:
            raise ValueError("reward functions score texts: pass decode= (response ids -> strings).")
        self.registry, self.settings, self.micro_batch_size = registry, s, micro_batch_size
        # one pass over the rollout (one epoch, one optimizer step) with no KL in the reward: the update's own
        # log-probs are the old ones, so the rollout runs no actor forward for them (TRL's way)
        one_pass = s.epochs == 1 and rows == micro_batch_size * registry[spec.actor].gradient_accumulation_steps() \
            and not (s.resolved_kl_in_reward and s.kl_coef > 0)
        self.spec = dataclasses.replace(spec, ref=spec.ref if s.kl_coef > 0 else None, critic=None,  # critic-free
                                        old_logprobs=not one_pass)
        if isinstance(rollout, MultiTurnRollouts):
            rollout.spec = dataclasses.replace(rollout.spec, old_logprobs=self.spec.old_logprobs)
        self.normalizer = RunningMoments() if normalize_rewards else None
        self.flat_watch = FlatGroupWatch(s.flat_warn_share, s.flat_warn_steps)
        self.more_prompts, self.rollout = more_prompts, rollout
        self.sampler = DynamicSampler(s.rollout_batch_size, s.max_resample_rounds) if s.dynamic_sampling else None
        self.dynamic: dict[str, float] = {}  # the last step's dynamic sampling counts (this rank)
        self.scheduled: ScheduledRollouts | None = None  # rollouts ahead of the update (schedule)

    def _sample(self, batch: dict[str, Any], step: int, seed: int) -> Experience:
        """One rollout with its score (and the overlong penalty)."""
        s = self.settings
        if self.rollout is not None:
            exp = self.rollout(batch, step, seed)
        else:
            exp = make_experience(self.registry, batch, step, self.spec, n_samples_per_prompt=s.n_samples_per_prompt,
                                  no_eos_penalty=s.no_eos_penalty, sample_seed=seed)
        return self._penalize(exp)

    def _penalize(self, exp: Experience) -> Experience:
        """The overlong penalty (DAPO) added to the score."""
        s = self.settings
        if s.overlong_buffer:
            penalty = overlong_penalty(exp.action_mask.sum(-1), self.spec.generation.max_new_tokens,
                                       s.overlong_buffer, s.overlong_penalty).to(exp.score.device)
            exp.score = exp.score + penalty
            exp.reward_parts["overlong"] = penalty
        return exp

    def _dynamic_rollout(self, batch: dict[str, Any], step: int) -> Experience:
        """Rounds of rollouts until every rank holds ``rollout_batch_size`` groups with a reward spread (or the
        cap): the kept groups' rows in one Experience."""
        G, rank, seed = self.settings.n_samples_per_prompt, self.registry.rank, self.spec.seed
        timings: dict[str, float] = {}  # every round's, kept or not

        def sample(round_: int) -> tuple[torch.Tensor, Experience]:
            prompts = batch if round_ == 0 or self.more_prompts is None else self.more_prompts()
            exp = self._sample(prompts, step, round_seed(seed, step, round_, rank))
            for k, v in exp.timings.items():
                timings[k] = timings.get(k, 0.0) + v
            return exp.score.reshape(-1, G), exp

        def sync(here: bool) -> bool:  # every rank samples as many rounds as the neediest
            return bool(all_reduce_sum(torch.tensor([float(here)], dtype=torch.float64)).item() > 0)

        assert self.sampler is not None
        selection, self.dynamic = collect_groups(sample, self.sampler, sync)
        exp = concat_experiences([exp.rows(group_row_indices(groups, G)) for exp, groups in selection],
                                 self.spec.pad_token_id, G)
        exp.timings = timings
        return exp

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], step: int) -> Experience:
        """Rollout (``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows) with rewards and
        advantages set (collective)."""
        return self._advantages(self._rollout(batch, step))

    def _rollout(self, batch: dict[str, Any], step: int) -> Experience:
        """A scored rollout without advantages: ``step`` seeds its sampling (the batch's index with a queue)."""
        if self.sampler is not None:
            return self._dynamic_rollout(batch, step)
        return self._sample(batch, step, round_seed(self.spec.seed, step, 0, self.registry.rank))

    def schedule(self, depth: int, prompts: Iterator[dict[str, Any]], remote: RemoteRollouts | None = None) -> None:
        """Rollouts ``depth`` steps ahead of the update (schedule.py; 0 = lockstep), drawn from ``prompts``;
        ``remote``: generated on rollout ranks. :meth:`step` then takes no batch."""
        if depth or remote is not None:  # the log-probs that generated a batch are kept apart from the update's
            self.spec = dataclasses.replace(self.spec, old_logprobs=True)
            if isinstance(self.rollout, MultiTurnRollouts):
                self.rollout.spec = dataclasses.replace(self.rollout.spec, old_logprobs=True)
        s = self.settings

        def score(answers: dict[str, Any]) -> Experience:
            return self._penalize(score_answers(self.registry, answers, self.spec, s.n_samples_per_prompt,
                                                s.no_eos_penalty))

        self.scheduled = ScheduledRollouts(self.registry, depth, prompts, self._rollout, score, remote)

    def _advantages(self, exp: Experience) -> Experience:
        t0 = time.perf_counter()
        score = exp.score
        if self.normalizer is not None:
            self.normalizer.update(score)
            score = self.normalizer.normalize(score)
        exp.advantages, exp.rewards = critic_free_advantages(score, exp.logprobs, exp.ref_logprobs, exp.action_mask,
                                                             self.settings)
        exp.timings["experience_s"] = exp.timings.get("experience_s", 0.0) + time.perf_counter() - t0
        return exp

    def train_on(self, exp: Experience, step: int, stats: StepStats | None = None) -> dict[str, float]:
        """``epochs`` passes of minibatches over the rollout (KL loss term unless it is in the reward).
        With ``stats``, the statistics are added to it and ``{}`` is returned."""
        return train_on_experience(self.registry, exp, step, self.settings, self.spec, self.micro_batch_size,
                                   stats=stats)

    def rollout_metrics(self, exp: Experience, stats: StepStats | None = None) -> dict[str, float]:
        """Reward, KL, length and group statistics of a rollout, over all ranks (with ``stats``: added to it)."""
        return rollout_metrics(exp, self.spec.judge, stats)

    def step(self, batch: dict[str, Any] | None, step: int) -> dict[str, float]:
        """One step: rollout, advantages, update. Returns the step's metrics (global means). With a :meth:`schedule`
        ``batch`` is None: the queue draws the prompts."""
        t0 = time.perf_counter()
        exp = self._advantages(self.scheduled.take(step, self.spec)) if self.scheduled is not None else \
            self.make_experience(batch, step)
        stats = StepStats()  # every scalar metric of the step, reduced over ranks once, at the end
        if self.sampler is not None:  # global: dropped / seen groups over all ranks
            d = self.dynamic
            stats.add("dynamic/dropped_rate", [d["dynamic/groups_dropped"], d["dynamic/groups_seen"]],
                      lambda dropped, seen: dropped / seen if seen else 0.0)
            for key in ("dynamic/rounds", "dynamic/filled", "dynamic/surplus"):
                stats.add(key, [d[key], 1.0], lambda total, n: total / n)
        t1 = time.perf_counter()
        self.train_on(exp, step, stats)
        t_train = time.perf_counter() - t1
        self.rollout_metrics(exp, stats)  # after the update: with one pass, the actor's log-probs come from it
        queued = {}
        if self.scheduled is not None:  # the batches in flight land; the step's generation is theirs
            queued = self.scheduled.finish(exp, step)
        timings = step_timings(exp, t_train, time.perf_counter() - t0, stats)
        metrics = {**stats.reduce(), "kl_coef": self.settings.kl_coef, **timings, **queued}
        if "reward/flat_groups" in metrics:  # the same global value on every rank: the streaks agree
            warning = self.flat_watch.update(metrics["reward/flat_groups"], self.settings.n_samples_per_prompt,
                                             self.spec.generation.temperature)
            if warning and self.registry.is_main:
                logger.warning("%s", warning)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.settings.algorithm,
                "normalizer": self.normalizer.state_dict() if self.normalizer is not None else None,
                "flat_watch": self.flat_watch.state_dict(),
                "dynamic": self.sampler.state_dict() if self.sampler is not None else None,
                **({"queue": self.scheduled.state_dict()} if self.scheduled is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("algorithm", self.settings.algorithm) != self.settings.algorithm:
            raise ValueError(f"checkpoint was written by algorithm={state['algorithm']!r}, this run is "
                             f"{self.settings.algorithm!r}.")
        if self.normalizer is not None and state.get("normalizer") is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.flat_watch.load_state_dict(state.get("flat_watch") or {})
        if self.sampler is not None and state.get("dynamic") is not None:
            self.sampler.load_state_dict(state["dynamic"])
        if self.scheduled is not None and state.get("queue") is not None:
            self.scheduled.load_state_dict(state["queue"])


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


"""DAPO's dynamic sampling (Yu et al. 2025): drop the prompt groups whose rewards are all equal (advantage exactly 0
under grpo, dr_grpo and rloo, so no policy gradient; reinforce_pp has no group baseline) and sample again until the
batch holds the wanted number of groups.

* :func:`filter_groups`: the pure test, rewards ``[n_groups, G]`` -> which groups have a spread.
* :class:`DynamicSampler`: keeps the groups that pass, round after round, until ``target_groups`` are
  kept or ``max_rounds`` rounds were sampled; counts what it dropped; ``state_dict`` for resume.
* :func:`collect_groups`: the loop that drives a sampler with a ``sample(round)`` callable.

Ranks. Groups never span ranks (advantages.py), so every rank filters its own groups. Sampling is
collective (every rank must run the same number of generations), so the loop asks ``sync`` whether *any*
rank still needs groups; a rank that is already full keeps sampling with the others and discards the
extra groups (counted as ``surplus``). :func:`round_seed` gives each round its own sampling seed, derived
from ``(seed, step, round, rank)`` only, so a resumed run samples the same tokens.

When the cap is reached with fewer groups than wanted, ``on_cap="fill"`` completes the batch with the
earliest dropped groups (flat groups: they add nothing to the policy gradient, only to the KL term, but
keep every rank's batch the same size), ``on_cap="error"`` raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .rollout import sampling_seed

__all__ = ["ON_CAP", "DynamicSampler", "GroupFilter", "collect_groups", "filter_groups", "group_row_indices",
           "round_seed"]

ON_CAP = ("fill", "error")


@dataclass
class GroupFilter:
    """Result of :func:`filter_groups`."""

    keep: torch.Tensor  # [n_groups] bool: the group's rewards are not all equal
    kept: int
    dropped: int

    @property
    def total(self) -> int:
        return self.kept + self.dropped

    @property
    def dropped_rate(self) -> float:
        return self.dropped / self.total if self.total else 0.0


def filter_groups(rewards: torch.Tensor) -> GroupFilter:
    """Which groups of ``rewards [n_groups, G]`` have non-zero variance (``max != min``, exact: a spread of
    any size gives non-zero advantages). A group of one sample (``G = 1``) is kept: it has nothing to
    compare with, and an estimator that allows ``G = 1`` (REINFORCE++) learns from it. Rewards must be
    finite."""
    if rewards.dim() != 2 or rewards.shape[1] < 1:
        raise ValueError(f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}.")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("dynamic sampling got a non-finite reward (NaN or inf); every completion needs a finite "
                         "score to decide whether its group has a spread.")
    if rewards.shape[1] == 1:
        keep = torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    else:
        keep = rewards.max(-1).values != rewards.min(-1).values
    kept = int(keep.sum())
    return GroupFilter(keep=keep, kept=kept, dropped=int(keep.numel()) - kept)


def group_row_indices(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row indices of the groups ``groups`` (``[k]`` group numbers) when a group is ``group_size``
    consecutive rows: ``[k * group_size]`` long."""
    groups = groups.long().reshape(-1, 1)
    return (groups * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)


def round_seed(seed: int, step: int, round_: int, rank: int) -> int:
    """Sampling seed of one round of one step on one rank. Round 0 is ``rollout.sampling_seed(seed, step,
    rank)`` (a run with dynamic sampling samples its first round as one without it)."""
    return (sampling_seed(seed, step, rank) + round_ * 6_700_417) % (2**63 - 1)


class DynamicSampler:
    """Accumulates the groups with a reward spread until ``target_groups`` are kept (per rank, per step).

    Per step: :meth:`begin` (clears the pending groups), then :meth:`add` once per sampling round, with the
    round's rewards ``[n_groups, G]`` and a payload (whatever the caller needs to take rows back out of it,
    e.g. the round's rollout). :attr:`needs_more` says whether this rank wants another round; :meth:`take`
    returns the selection ``[(payload, group numbers), ...]`` (the first ``target_groups`` kept groups in
    sampling order, completed with dropped ones when the cap was hit and ``on_cap="fill"``) and the step's
    metrics. Cumulative counts persist across steps (:meth:`state_dict`).

    ``target_groups``: groups per rank per step (GRPOSettings.rollout_batch_size), ``max_rounds``: sampling rounds
    per step at most (GRPOSettings.max_resample_rounds), both >= 1 (checked there); ``on_cap``: ``fill`` or
    ``error`` (module docstring).
    """

    def __init__(self, target_groups: int, max_rounds: int = 4, on_cap: str = "fill") -> None:
        if on_cap not in ON_CAP:
            raise ValueError(f"dynamic sampling on_cap={on_cap!r}; use one of {list(ON_CAP)}.")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.on_cap = on_cap
        self.totals = {"steps": 0, "rounds": 0, "groups": 0, "dropped": 0, "filled": 0}
        self.begin()

    # -- one step -----------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a step: forget the pending groups."""
        self.rounds = 0
        self._kept: list[tuple[Any, torch.Tensor]] = []
        self._flat: list[tuple[Any, torch.Tensor]] = []
        self._n_kept = 0
        self._seen = 0
        self._dropped = 0
        self._surplus = 0

    @property
    def n_kept(self) -> int:
        return min(self._n_kept, self.target_groups)

    @property
    def needs_more(self) -> bool:
        """This rank has fewer than ``target_groups`` groups and may sample another round."""
        return self._n_kept < self.target_groups and self.rounds < self.max_rounds

    def add(self, rewards: torch.Tensor, payload: Any = None) -> GroupFilter:
        """Filter one round's groups and keep those with a spread (beyond the target they count as surplus)."""
        if self.rounds >= self.max_rounds:
            raise RuntimeError(f"DynamicSampler.add after max_resample_rounds={self.max_rounds} rounds; call take().")
        result = filter_groups(rewards)
        self.rounds += 1
        self._seen += result.total
        self._dropped += result.dropped
        kept_idx = torch.nonzero(result.keep, as_tuple=False).reshape(-1).cpu()
        room = self.target_groups - self._n_kept
        if room > 0 and kept_idx.numel():
            self._kept.append((payload, kept_idx[:room]))
        self._surplus += max(kept_idx.numel() - max(room, 0), 0)
        self._n_kept += kept_idx.numel()
        flat_idx = torch.nonzero(~result.keep, as_tuple=False).reshape(-1).cpu()
        flat_room = self.target_groups - sum(int(i.numel()) for _, i in self._flat)
        if flat_room > 0 and flat_idx.numel():  # reserve for on_cap="fill"
            self._flat.append((payload, flat_idx[:flat_room]))
        return result

    def take(self) -> tuple[list[tuple[Any, torch.Tensor]], dict[str, float]]:
        """The step's selection and metrics; ends the step (the next :meth:`add` needs :meth:`begin`).

        Metrics: ``dynamic/rounds``, ``dynamic/groups_seen``, ``dynamic/groups_dropped``,
        ``dynamic/dropped_rate`` (dropped / seen this step), ``dynamic/filled`` (flat groups used to complete
        the batch), ``dynamic/surplus`` (kept groups beyond the target, discarded).

        Raises:
            ValueError: fewer than ``target_groups`` kept after ``max_rounds`` rounds with ``on_cap="error"``,
                or nothing was added.
        """
        if self.rounds == 0:
            raise RuntimeError("DynamicSampler.take before any add(): sample at least one round.")
        selection = list(self._kept)
        missing = self.target_groups - self.n_kept
        filled = 0
        if missing > 0:
            if self.on_cap == "error":
                raise ValueError(
                    f"dynamic sampling kept {self.n_kept} of {self.target_groups} prompt groups after "
                    f"max_resample_rounds={self.max_rounds} rounds ({self._dropped} of {self._seen} groups had equal "
                    "rewards). Raise max_resample_rounds, sample more answers per prompt (n_samples_per_prompt) or "
                    "at a higher temperature, use a denser reward, or set on_cap=fill.")
            for payload, idx in self._flat:
                take = idx[:missing - filled]
                if take.numel():
                    selection.append((payload, take))
                    filled += int(take.numel())
                if filled == missing:
                    break
            if filled < missing:  # the rounds returned fewer groups in all than one batch holds
                raise ValueError(f"dynamic sampling saw only {self._seen} groups in {self.rounds} rounds, fewer than "
                                 f"target_groups={self.target_groups}: each round must sample a full batch of "
                                 "prompt groups (rollout_batch_size).")
        metrics = {
            "dynamic/rounds": float(self.rounds),
            "dynamic/groups_seen": float(self._seen),
            "dynamic/groups_dropped": float(self._dropped),
            "dynamic/dropped_rate": self._dropped / self._seen if self._seen else 0.0,
            "dynamic/filled": float(filled),
            "dynamic/surplus": float(self._surplus),
        }
        for key, value in (("steps", 1), ("rounds", self.rounds), ("groups", self._seen), ("dropped", self._dropped),
                           ("filled", filled)):
            self.totals[key] += value
        self.begin()
        return selection, metrics

    @property
    def dropped_rate_total(self) -> float:
        """Dropped / seen over every step so far (resumed runs included)."""
        return self.totals["dropped"] / self.totals["groups"] if self.totals["groups"] else 0.0

    # -- resume -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The cumulative counts and settings. Checkpoints are written between steps, when no group is pending;
        the step's own rounds are re-sampled from the same seeds after a resume."""
        if self.rounds:
            raise RuntimeError("DynamicSampler.state_dict in the middle of a step (after add, before take): "
                               "checkpoint between steps.")
        return {"target_groups": self.target_groups, "max_rounds": self.max_rounds, "on_cap": self.on_cap,
                "totals": dict(self.totals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("target_groups", self.target_groups)) != self.target_groups:
            raise ValueError(f"checkpoint's dynamic sampling target_groups={state['target_groups']} differs from this "
                             f"run's {self.target_groups} (rollout_batch_size): resume with the same batch size.")
        self.totals = {k: int(v) for k, v in state["totals"].items()}
        self.begin()


def collect_groups(
    sample: Callable[[int], tuple[torch.Tensor, Any]],
    sampler: DynamicSampler,
    sync: Callable[[bool], bool] | None = None,
) -> tuple[list[tuple[Any, torch.Tensor]], dict[str, float]]:
    """Run rounds of ``sample(round) -> (rewards [n_groups, G], payload)`` into ``sampler`` until no rank needs
    more groups or the cap is reached, then :meth:`DynamicSampler.take`.

    ``sync(needs_more_here) -> needs_more_anywhere`` (e.g. an all-reduce max over ranks; ``None`` = one
    process) keeps the ranks' round counts equal. A rank that is full still samples while others are not
    (its extra groups count as surplus); the loop stops at ``sampler.max_rounds`` on every rank alike.
    """
    sampler.begin()
    for round_ in range(sampler.max_rounds):
        rewards, payload = sample(round_)
        sampler.add(rewards, payload)
        here = sampler.needs_more
        anywhere = sync(here) if sync is not None else here
        if not anywhere:
            break
    return sampler.take()

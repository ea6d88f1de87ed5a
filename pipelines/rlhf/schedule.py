"""Rollouts out of lockstep: the batches generated ahead of the trainer, their versions, and their checkpoint.

Batch ``i`` is trained at step ``i`` (steps count from 0: the policy trained at step ``s`` is version ``s``, the
number of updates behind it). With ``depth`` k (``generation.schedule``: sync 0, one_step_off 1, async
``max_staleness``) the batch of step ``s + k`` is launched at step ``s``, before the update, with version ``s``'s
weights, and lands after the update; so a trained sample is ``min(s, k)`` versions older than the policy that trains
on it, never more (the rollouts wait for the trainer's weights). ``launch(prompts, index, version)`` starts a batch
(on the trainer ranks: generates and scores it at once; with rollout ranks: sends the prompts) and ``land(handle)``
returns its :class:`Experience`, or with rollout ranks the answers received (scored when the batch is taken, with
that step's weights). The prompt stream is drawn in the order of the batches, so depth 0 is exactly the lockstep
run.

The queue's state (landed batches not yet trained, counters, the ledger of trained samples) goes into every
checkpoint; a checkpoint is taken between steps, when nothing is in flight, so a run killed at any moment resumes to
the same samples, versions and weights (generation is seeded by the batch index, its weights are the checkpoint's).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.packing import lm_forward

from .rollout import Experience, RolloutSpec, make_experience
from .scoring import role_logprobs, role_values, scoring_mode

__all__ = ["RolloutQueue", "ScheduledRollouts", "experience_state", "refresh", "restore_experience", "score_answers",
           "staleness_metrics"]

_TIMINGS = ("generation_s", "experience_s", "generation_steps", "sync_s", "sync_bytes")


def experience_state(exp: Experience) -> dict[str, Any]:
    """An :class:`Experience` as plain data (tensors, lists, numbers) for a checkpoint."""
    return {f.name: getattr(exp, f.name) for f in dataclasses.fields(exp)}


def restore_experience(state: dict[str, Any]) -> Experience:
    return Experience(**state)


def _rows(landed: Any) -> int:
    return int(landed.sequences.shape[0] if isinstance(landed, Experience) else landed["response"].shape[0])


def _timings(landed: Any) -> dict[str, float]:
    return landed.timings if isinstance(landed, Experience) else landed["timings"]


class RolloutQueue:
    """The batches between the rollouts and the trainer (see the module doc). ``prompts``: the run's prompt stream
    (one batch per launch); ``launch(prompts, index, version) -> handle``, ``land(handle)`` -> an
    :class:`Experience` or a plain dict with ``response`` and ``timings`` (answers from rollout ranks, scored by the
    trainer when it takes them)."""

    def __init__(self, depth: int, prompts: Iterator[dict[str, Any]], launch: Callable[[dict[str, Any], int, int], Any],
                 land: Callable[[Any], Any], rank: int = 0) -> None:
        self.depth, self.prompts, self.launch, self.land, self.rank = depth, prompts, launch, land, rank
        self.pending: dict[int, tuple[Any, int]] = {}  # index -> (handle, version)
        self.landed: dict[int, tuple[Any, int]] = {}  # index -> (Experience or answers, version)
        self.next_launch = 0  # the next batch index to launch
        self.next_train = 0  # the next batch index to train
        self.generated = 0  # rows landed
        self.trained = 0  # rows handed to the trainer
        self.ledger = ""  # a hash chained over (index, rank, version, rows) of every trained batch, in order
        self.work: dict[str, float] = {}  # this step's generation timings (every batch launched or landed in it)

    def _launch(self, version: int) -> None:
        index = self.next_launch
        self.pending[index] = (self.launch(next(self.prompts), index, version), version)
        self.next_launch += 1

    def _land(self, index: int) -> None:
        handle, version = self.pending.pop(index)
        t0 = time.perf_counter()
        landed = self.land(handle)
        self.work["wait_s"] = self.work.get("wait_s", 0.0) + time.perf_counter() - t0
        for key, value in _timings(landed).items():
            if key in _TIMINGS:
                self.work[key] = self.work.get(key, 0.0) + value
        self.landed[index] = (landed, version)
        self.generated += _rows(landed)

    def take(self, step: int) -> tuple[Any, int]:
        """Step ``step``'s batch and the version that generated it: first launches every batch up to ``step +
        depth`` (with this version's weights; those before ``step + depth`` land at once: the start of a run, or
        depth 0)."""
        if step != self.next_train:
            raise RuntimeError(f"rollout queue: step {step} asks for batch {step}, the next untrained one is "
                               f"{self.next_train} (a batch would be skipped or trained twice)")
        self.work = {}
        while self.next_launch <= step + self.depth:
            index = self.next_launch
            self._launch(step)
            if index < step + self.depth or self.depth == 0:
                self._land(index)
        landed, version = self.landed.pop(step)
        self.next_train += 1
        self.trained += _rows(landed)
        entry = f"{self.ledger}|{step}:{self.rank}:{version}:{_rows(landed)}"
        self.ledger = hashlib.sha256(entry.encode()).hexdigest()
        return landed, version

    def finish(self) -> dict[str, float]:
        """After the update: every batch in flight lands; returns the step's generation timings (the batches
        launched or landed in it: on the trainer ranks, the generation done in the step)."""
        for index in sorted(self.pending):
            self._land(index)
        return {**{k: 0.0 for k in ("generation_s", "experience_s", "generation_steps", "wait_s")}, **self.work}

    def counts(self) -> dict[str, float]:
        return {"rollout/generated_rows": float(self.generated), "rollout/trained_rows": float(self.trained),
                "rollout/in_flight_rows": float(self.generated - self.trained)}

    def state_dict(self) -> dict[str, Any]:
        if self.pending:  # checkpoints are taken between steps, after finish()
            raise RuntimeError(f"rollout queue: batches {sorted(self.pending)} are in flight at a checkpoint")
        landed = {str(i): {"version": v, **({"experience": experience_state(x)} if isinstance(x, Experience)
                                            else {"answers": x})} for i, (x, v) in self.landed.items()}
        return {"next_launch": self.next_launch, "next_train": self.next_train, "generated": self.generated,
                "trained": self.trained, "ledger": self.ledger, "landed": landed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_launch, self.next_train = int(state["next_launch"]), int(state["next_train"])
        self.generated, self.trained = int(state["generated"]), int(state["trained"])
        self.ledger = str(state["ledger"])
        self.landed = {int(i): (restore_experience(e["experience"]) if "experience" in e else e["answers"],
                                int(e["version"])) for i, e in state["landed"].items()}


def score_answers(registry: EngineRegistry, answers: dict[str, Any], spec: RolloutSpec, n_samples: int = 1,
                  no_eos_penalty: float = 0.0) -> Experience:
    """A rollout rank's answers (RemoteRollouts.land) scored on the trainer ranks: :func:`make_experience` on them."""
    return make_experience(registry, answers["batch"], answers["index"], spec, n_samples_per_prompt=n_samples,
                           no_eos_penalty=no_eos_penalty, sampled=(answers["response"], answers["rollout_logprobs"]))


@torch.no_grad()
def refresh(registry: EngineRegistry, exp: Experience, spec: RolloutSpec, version: int) -> None:
    """A batch scored with other weights than version ``version``'s (a stale one, or one scored when it landed):
    the log-probs that generated it become its rollout log-probs (unless the sampler's are there), and the actor's
    (and the critic's values) are taken again with the current weights, the proximal policy of the update."""
    if exp.scored_version == version:
        return
    action = exp.action_mask.float()
    if exp.rollout_logprobs is None:
        exp.rollout_logprobs = exp.logprobs
    C, temperature = exp.context_length, spec.generation.temperature
    exp.logprobs = role_logprobs(registry, spec.actor, exp.sequences, exp.attention_mask, C, temperature,
                                 exp.routing) * action
    if spec.critic is not None and exp.values is not None and exp.critic_sequences is not None:
        with scoring_mode(registry, spec.critic) as engine:  # a critic with its own tokenizer: its rows
            full = lm_forward(engine, exp.critic_sequences, exp.critic_attention_mask).float()
        exp.values = full.gather(1, exp.critic_index) * action
    elif spec.critic is not None and exp.values is not None:
        exp.values = role_values(registry, spec.critic, exp.sequences, exp.attention_mask, C) * action
    exp.scored_version = version


def staleness_metrics(exp: Experience, version: int) -> dict[str, float]:
    """The versions of a trained batch against the policy's (the same on every trainer rank: one schedule)."""
    versions = exp.versions.double()
    stale = version - versions
    return {"rollout/version_min": float(versions.min()), "rollout/version_max": float(versions.max()),
            "rollout/staleness_mean": float(stale.mean()), "rollout/staleness_max": float(stale.max())}


class ScheduledRollouts:
    """A trainer's rollouts through a :class:`RolloutQueue` (GRPOTrainer, PPOTrainer: ``schedule``). ``produce(batch,
    index)``: a batch generated and scored on the trainer ranks; ``remote`` (a RemoteRollouts): generated on rollout
    ranks instead, the answers scored by ``score(answers)`` when taken."""

    def __init__(self, registry: EngineRegistry, depth: int, prompts: Iterator[dict[str, Any]],
                 produce: Callable[[dict[str, Any], int], Experience], score: Callable[[dict[str, Any]], Experience],
                 remote: Any = None) -> None:
        self.registry, self.score, self.remote = registry, score, remote
        if remote is None:
            self.queue = RolloutQueue(depth, prompts, lambda batch, index, _: produce(batch, index), lambda exp: exp,
                                      registry.rank)
        else:
            self.queue = RolloutQueue(depth, prompts, remote.launch, remote.land, registry.rank)

    def take(self, step: int, spec: RolloutSpec) -> Experience:
        """Step ``step``'s batch, scored (answers from rollout ranks: here, with the current weights) and, when other
        weights scored it, its log-probs taken again with the current ones (:func:`refresh`)."""
        landed, version = self.queue.take(step)
        t0 = time.perf_counter()
        if isinstance(landed, Experience):
            exp = landed
            exp.scored_version = version if exp.scored_version is None else exp.scored_version
        else:
            exp = self.score(landed)
            exp.scored_version = step
        exp.versions = torch.full((exp.sequences.shape[0],), version, dtype=torch.long)
        refresh(self.registry, exp, spec, step)
        self.queue.work["experience_s"] = self.queue.work.get("experience_s", 0.0) + time.perf_counter() - t0
        return exp

    def finish(self, exp: Experience, step: int) -> dict[str, float]:
        """After the update: the batches in flight land; ``exp.timings`` become the step's generation work; returns
        the step's staleness, counts and wait."""
        exp.timings = self.queue.finish()
        return {**staleness_metrics(exp, step), **self.queue.counts(), "time/wait_s": exp.timings["wait_s"]}

    def state_dict(self) -> dict[str, Any]:
        return self.queue.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.queue.load_state_dict(state)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

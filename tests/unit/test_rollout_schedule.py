"""The rollout queue's arithmetic (which weights generate which batch, resume) and the rank layout's rules."""

from __future__ import annotations

import itertools

import pytest
import torch
from multiengine.engines.placement import RankLayout, layout_problem
from multiengine.pipelines.rlhf.generation import RolloutGenerationSettings
from multiengine.pipelines.rlhf.rollout import Experience
from multiengine.pipelines.rlhf.schedule import RolloutQueue, staleness_metrics


def _exp(rows: int, tag: float) -> Experience:
    return Experience(sequences=torch.full((rows, 3), tag), attention_mask=torch.ones(rows, 3), context_length=1,
                      action_mask=torch.ones(rows, 2, dtype=torch.bool), logprobs=None, score=torch.zeros(rows),
                      timings={"generation_s": 1.0, "experience_s": 0.5, "generation_steps": 2.0})


class _Run:
    """A fake trainer around a queue: records at which version each batch index was launched."""

    def __init__(self, depth: int, start: int = 0) -> None:
        self.launched: dict[int, int] = {}
        self.prompts = itertools.count(start)
        self.queue = RolloutQueue(depth, self.prompts, self.launch, lambda exp: exp, rank=0)

    def launch(self, prompt: int, index: int, version: int) -> Experience:
        assert prompt == index  # prompts are drawn in batch order
        self.launched[index] = version
        return _exp(4, index)

    def steps(self, first: int, last: int) -> list[tuple[int, int]]:
        out = []
        for step in range(first, last):
            exp, version = self.queue.take(step)
            assert int(exp.sequences[0, 0]) == step  # the batch of this step
            out.append((step, version))
            self.queue.finish()
        return out


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_batch_s_is_generated_by_version_s_minus_depth(depth):
    run = _Run(depth)
    trained = run.steps(0, 8)
    # the first depth+1 batches come from the starting weights, then each is depth versions old
    assert trained == [(s, max(0, s - depth)) for s in range(8)]
    assert run.launched == {i: max(0, i - depth) for i in range(8 + depth)}
    counts = run.queue.counts()
    assert counts == {"rollout/generated_rows": 4.0 * (8 + depth), "rollout/trained_rows": 32.0,
                      "rollout/in_flight_rows": 4.0 * depth}


def test_staleness_metrics_count_versions_behind_the_policy():
    exp = _exp(3, 0)
    exp.versions = torch.tensor([4, 4, 2])
    assert staleness_metrics(exp, 5) == {"rollout/version_min": 2.0, "rollout/version_max": 4.0,
                                         "rollout/staleness_mean": pytest.approx(5 / 3),  # 1, 1, 3
                                         "rollout/staleness_max": 3.0}


def test_a_resumed_queue_trains_the_same_batches_with_the_same_versions_and_ledger():
    straight = _Run(2)
    expected = straight.steps(0, 7)
    first = _Run(2)
    head = first.steps(0, 3)
    state = first.queue.state_dict()
    # a new run: its prompt stream resumes where the checkpoint's was (the stream is checkpointed too)
    second = _Run(2, start=first.queue.next_launch)
    second.queue.load_state_dict(state)
    tail = second.steps(3, 7)
    assert head + tail == expected
    assert second.queue.ledger == straight.queue.ledger
    assert second.queue.counts() == straight.queue.counts()


def test_a_skipped_or_repeated_batch_is_refused():
    run = _Run(1)
    run.steps(0, 2)
    with pytest.raises(RuntimeError, match="trained twice"):
        run.queue.take(1)
    with pytest.raises(RuntimeError, match="skipped"):
        run.queue.take(3)


def test_no_checkpoint_with_batches_in_flight():
    run = _Run(1)
    run.queue.take(0)  # batch 1 launched, not landed
    with pytest.raises(RuntimeError, match="in flight"):
        run.queue.state_dict()
    run.queue.finish()
    assert set(run.queue.state_dict()["landed"]) == {"1"}


def test_the_step_reports_the_generation_done_in_it():
    run = _Run(1)
    run.queue.take(0)  # batches 0 and 1 launched (colocated: generated at launch), 0 landed
    work = run.queue.finish()
    assert work["generation_s"] == 2.0 and work["generation_steps"] == 4.0
    run.queue.take(1)
    assert run.queue.finish()["generation_s"] == 1.0


def test_schedule_depths():
    assert [RolloutGenerationSettings(schedule=s).depth for s in ("sync", "one_step_off")] == [0, 1]
    assert RolloutGenerationSettings(schedule="async", max_staleness=4).depth == 4


@pytest.mark.parametrize("ranks, world, problem", [
    ([1], 2, None), ([6, 7], 8, None), ([3], 4, None),
    ([0], 2, "last ranks"), ([0, 1], 2, "no rank to train"), ([1], 1, "at least 2 ranks"),
    ([3, 4], 5, "2 rollout ranks, which do not divide the 3 trainer ranks"), ([1, 1], 2, "twice"),
])
def test_rollout_ranks_must_be_the_last_and_divide_the_trainers(ranks, world, problem):
    found = layout_problem(ranks, world)
    assert (found is None) if problem is None else (problem in found)


def test_each_rollout_rank_serves_as_many_trainer_ranks():
    layout = RankLayout(rank=0, world=8, rollout=(6, 7))
    assert layout.trainers == (0, 1, 2, 3, 4, 5)
    assert [layout.server_of(t) for t in layout.trainers] == [6, 7, 6, 7, 6, 7]
    assert layout.clients_of(6) == [0, 2, 4] and layout.clients_of(7) == [1, 3, 5]

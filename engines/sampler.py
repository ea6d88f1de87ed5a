"""Deterministic, resumable, distributed data order: a sampler and an endless batch stream over it.

Both are checkpointable: register them with ``registry.add_state(name, obj)`` and
``save_checkpoint``/``load_checkpoint`` keep their position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["ShardedBatches", "ShardedEpochSampler", "shard_batches"]


class ShardedEpochSampler(torch.utils.data.Sampler[int]):
    """Deterministic, resumable, distributed sampler. Epoch ``e``'s order is ``randperm(n)`` seeded with ``seed + e``
    (``range(n)`` without shuffle), cut to a multiple of ``world_size`` (every rank the same steps: no collective
    hangs); rank ``r`` takes ``order[r::world_size]``. ``position`` counts what this rank yielded this epoch and
    iteration starts there (a prefetching DataLoader runs ahead: pass ``state_dict(consumed=...)``). A new iteration
    after a consumed epoch moves to the next one by itself, lazily, so a checkpoint taken meanwhile stays right."""

    def __init__(self, n: int, world_size: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {world_size=}, {rank=}")
        if n < world_size:
            raise ValueError(f"dataset of {n} samples cannot feed {world_size} ranks (each needs >= 1)")
        self.n = n
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Samples per rank per epoch (the full epoch, regardless of ``position``)."""
        return self.n // self.world_size

    def indices(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch``."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = len(self) * self.world_size
        return order[:total][self.rank :: self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; resets ``position`` only when the epoch changes (keeps a resumed position)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def __iter__(self) -> Iterator[int]:
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        epoch = self.epoch
        for index in self.indices(epoch)[self.position :]:
            if self.epoch != epoch:  # set_epoch/load_state_dict was called mid-iteration
                return
            self.position += 1
            yield index

    def state_dict(self, consumed: int | None = None) -> dict[str, int | bool]:
        """The epoch, position and setup; ``consumed``: samples of this epoch actually trained on (a prefetching
        DataLoader's sampler runs ahead)."""
        position = self.position if consumed is None else int(consumed)
        if not 0 <= position <= len(self):
            raise ValueError(f"consumed={consumed} outside [0, {len(self)}]")
        return {"epoch": self.epoch, "position": position, "n": self.n, "world_size": self.world_size,
                "rank": self.rank, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``epoch``/``position``; raises ``ValueError`` if the data/sharding setup differs."""
        for key in ("n", "world_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                                 "resuming would visit different samples")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"position {position} outside [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.position = position


class ShardedBatches:
    """Endless, resumable batches of ``batch_size`` rows of this rank's shard of ``rows`` (anything indexable with a
    length) through ``collate`` (rows -> batch): a :class:`ShardedEpochSampler`, whose state is its state."""

    def __init__(self, rows: Sequence[Any], collate: Callable[[list[Any]], Any], batch_size: int,
                 world_size: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        self.rows = rows
        self.collate = collate
        self.batch_size = batch_size
        self.sampler = ShardedEpochSampler(len(rows), world_size, rank, seed=seed, shuffle=shuffle)
        if len(self.sampler) < batch_size:
            raise ValueError(f"{len(rows)} rows give {len(self.sampler)} per rank on {world_size} ranks, fewer than"
                             f" a batch of {batch_size}: use more data or a smaller batch.")
        self._it: Iterator[int] | None = None

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        index: list[int] = []
        while len(index) < self.batch_size:
            if self._it is None:
                self._it = iter(self.sampler)
            try:
                index.append(next(self._it))
            except StopIteration:
                self._it = None  # the next iter() moves the sampler to the next epoch
        return self.collate([self.rows[i] for i in index])

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._it = None


def shard_batches(rows: Sequence[Any], collate: Callable[[list[Any]], Any], batch_size: int, world_size: int = 1,
                  rank: int = 0, limit: int = 0) -> list[Any]:
    """A fixed evaluation set: the first ``limit`` rows (all when 0), dealt round-robin over ranks (the
    tail that does not divide evenly is dropped, so every rank runs the same number of forwards) and
    batched in order."""
    n = len(rows) if not limit else min(limit, len(rows))
    per_rank = n // world_size
    mine = list(range(rank, per_rank * world_size, world_size))
    return [collate([rows[i] for i in mine[j:j + batch_size]]) for j in range(0, len(mine), batch_size)]

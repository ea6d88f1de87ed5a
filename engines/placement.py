"""Roles on their own ranks: a job's trainer ranks and rollout ranks, and the bridge between them.

A job of ``W`` processes whose last ``R`` ranks are rollout ranks splits before any process group exists
(:func:`split_world`): the trainer ranks ``0..W-R-1`` form the default group (every DeepSpeed engine, checkpoint and
metric reduction lives there, as in a job of ``W-R`` ranks), and each rollout rank runs a generation engine of its
own. The :class:`Bridge` is a gloo process group over all ``W`` processes (its own rendezvous, never the default
group): requests and replies go point to point over it, and the actor's weights go from trainer rank 0 to every
rollout rank by broadcast on a second group (trainer rank 0 + the rollout ranks), one layer at a time, gathered from
ZeRO-3 shards while they are sent (:func:`vllm_rollout.stream_units`), so no rank holds the whole model at once.
Tensors cross the bridge in host memory (gloo).
"""

from __future__ import annotations

import datetime
import io
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["BRIDGE_PORT_ENV", "Bridge", "RankLayout", "WeightStats", "split_world"]

BRIDGE_PORT_ENV = "MULTIENGINE_BRIDGE_PORT"  # the bridge's rendezvous port (the launcher picks a free one)


@dataclass(frozen=True)
class RankLayout:
    """Where a job's processes go: global ``rank`` of ``world``, the rollout ranks (the last ones)."""

    rank: int
    world: int
    rollout: tuple[int, ...]

    @property
    def trainers(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.world) if r not in self.rollout)

    @property
    def is_rollout(self) -> bool:
        return self.rank in self.rollout

    def server_of(self, trainer: int) -> int:
        """The rollout rank that generates trainer rank ``trainer``'s rollouts (round robin)."""
        return self.rollout[trainer % len(self.rollout)]

    def clients_of(self, rollout: int) -> list[int]:
        """The trainer ranks rollout rank ``rollout`` generates for, in rank order."""
        return [t for t in self.trainers if self.server_of(t) == rollout]


def layout_problem(rollout: Sequence[int], world: int) -> str | None:
    """Why ``rollout`` ranks cannot split a job of ``world`` processes, or None."""
    ranks = sorted(set(rollout))
    if len(ranks) != len(rollout):
        return "names a rank twice"
    if world < 2:
        return f"needs at least 2 ranks (the job has {world}): one to train, one to generate"
    if len(ranks) >= world:
        return f"leaves no rank to train (the job has {world} ranks)"
    if ranks != list(range(world - len(ranks), world)):
        return (f"must be the job's last ranks (of {world}: {list(range(world - len(ranks), world))}), so the "
                "trainer ranks keep ranks 0..N-1")
    trainers = world - len(ranks)
    if trainers % len(ranks):
        return f"has {len(ranks)} rollout ranks, which do not divide the {trainers} trainer ranks (each serves as many)"
    return None


def split_world(rollout: Sequence[int]) -> RankLayout:
    """This process's place in a job whose ``rollout`` ranks generate (call before any process group): a trainer
    rank sees a world of the trainer ranks (``WORLD_SIZE``), a rollout rank a world of its own."""
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    problem = layout_problem(rollout, world)
    if problem is not None:
        raise ValueError(f"rollout ranks {list(rollout)}: {problem}")
    layout = RankLayout(rank, world, tuple(sorted(rollout)))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault(BRIDGE_PORT_ENV, str(int(env.get("MASTER_PORT", "29500")) + 1))
    if layout.is_rollout:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    else:
        trainers = len(layout.trainers)
        env.update(WORLD_SIZE=str(trainers), LOCAL_WORLD_SIZE=str(min(int(env.get("LOCAL_WORLD_SIZE", trainers)),
                                                                      trainers)))
    return layout


@dataclass
class WeightStats:
    """One weight broadcast: tensors and bytes sent, seconds."""

    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _payload(obj: object) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _object(data: torch.Tensor) -> object:
    """A message back from its bytes: tensors, numbers, strings, dtypes and containers only (no pickled code)."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


class Bridge:
    """The process groups between trainer and rollout ranks (gloo, CPU tensors; every process of the job makes one).
    ``send``/``recv``: a message of tensors, numbers, strings, dtypes, lists, tuples and dicts to one rank (read
    back as torch.load(weights_only=True) reads: no code travels); ``broadcast_weights``: named
    tensors from trainer rank 0 to every rollout rank."""

    def __init__(self, layout: RankLayout, timeout_s: float | None = None) -> None:
        self.layout = layout
        timeout = datetime.timedelta(seconds=timeout_s or 1800.0)
        env = os.environ
        self._store = dist.TCPStore(env["MASTER_ADDR"], int(env[BRIDGE_PORT_ENV]), layout.world, layout.rank == 0,
                                    timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("bridge", self._store), layout.rank, layout.world,
                                           timeout)
        members = [layout.trainers[0], *layout.rollout]
        self.weights = None
        if layout.rank in members:  # trainer rank 0 (the root, 0) and the rollout ranks
            self.weights = dist.ProcessGroupGloo(dist.PrefixStore("weights", self._store), members.index(layout.rank),
                                                 len(members), timeout)

    # --- point to point ---------------------------------------------------------------------------
    def send(self, obj: object, dst: int) -> None:
        data = _payload(obj)
        self.group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.group.send([data], dst, 1).wait()

    def recv(self, src: int) -> object:
        size = torch.zeros(1, dtype=torch.int64)
        self.group.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.group.recv([data], src, 1).wait()
        return _object(data)

    # --- weights ----------------------------------------------------------------------------------
    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        assert self.weights is not None
        self.weights.broadcast([tensor], opts).wait()

    def _broadcast_obj(self, obj: object = None) -> object:
        root = self.layout.rank == self.layout.trainers[0]
        data = _payload(obj) if root else None
        size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64)
        self._broadcast(size)
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return _object(data)

    def send_weights(self, units: Iterable[list[tuple[str, torch.Tensor]]]) -> WeightStats:
        """Trainer rank 0: each unit's ``(name, tensor)`` pairs to every rollout rank (one header and one flat
        buffer per unit), then the end mark. The other trainer ranks iterate the same units without sending (ZeRO-3
        gathers them together)."""
        stats, t0 = WeightStats(), time.perf_counter()
        for unit in units:
            tensors = [t.detach().to("cpu").contiguous() for _, t in unit]
            header = [(name, tuple(t.shape), t.dtype) for (name, _), t in zip(unit, tensors)]
            self._broadcast_obj(header)
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else \
                torch.empty(0, dtype=torch.uint8)
            self._broadcast(flat)
            stats.tensors, stats.bytes = stats.tensors + len(tensors), stats.bytes + flat.numel()
        self._broadcast_obj(None)
        stats.seconds = time.perf_counter() - t0
        return stats

    def receive_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """A rollout rank: the named tensors of one broadcast, as they arrive."""
        while True:
            header = self._broadcast_obj()
            if header is None:
                return
            flat = torch.empty(sum(_nbytes(shape, dtype) for _, shape, dtype in header), dtype=torch.uint8)
            self._broadcast(flat)
            offset = 0
            for name, shape, dtype in header:
                n = _nbytes(shape, dtype)
                yield name, flat[offset:offset + n].view(dtype).reshape(shape)
                offset += n


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()

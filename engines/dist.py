"""Process-group setup that works under deepspeed, torchrun, accelerate launch and plain python."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> DistEnv:
    """Rank and world size from the launcher's variables (RANK/WORLD_SIZE/LOCAL_RANK, which
    deepspeed, torchrun and accelerate all set; OMPI_* for mpirun); plain python is rank 0 of 1."""
    env = os.environ
    rank = int(env.get("RANK", env.get("OMPI_COMM_WORLD_RANK", 0)))
    world = int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1)))
    local = int(env.get("LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))
    return DistEnv(rank=rank, local_rank=local, world_size=world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # a broken install counts as absent: the torch backend still runs
        return False
    return True


def default_backend() -> str:
    """gloo on CPU, nccl on CUDA: accelerate on CPU otherwise leaves each process believing it is alone."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(use_deepspeed: bool, backend: str | None = None, timeout_s: float | None = None) -> DistEnv:
    """Initialise the default process group once (also for a single process, so ZeRO works the same).

    timeout_s: collective timeout (torch's default, 30 minutes, when None)."""
    # DeepSpeed calls torch collectives that torch 2.13 marks deprecated, once per bucket: noise for users.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+.? is deprecated", category=FutureWarning)
    env = read_env()
    if dist.is_available() and dist.is_initialized():
        return DistEnv(rank=dist.get_rank(), local_rank=env.local_rank, world_size=dist.get_world_size())
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if env.world_size > 1:
            raise RuntimeError(
                "WORLD_SIZE>1 but MASTER_PORT is not set: launch with deepspeed, torchrun or accelerate launch."
            )
        os.environ["MASTER_PORT"] = str(_free_port())
    backend = backend or default_backend()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=float(timeout_s))}
    if use_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **timeout)
    else:
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, **timeout)
    logger.info("process group up: rank %d of %d (%s)", env.rank, env.world_size, backend)
    return env


def device_for(local_rank: int, use_deepspeed: bool) -> torch.device:
    if use_deepspeed:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name(local_rank)
        return torch.device(name if ":" in name or name == "cpu" else f"{name}:{local_rank}")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the process group cleanly: a barrier first, so no rank tears down gloo while a peer is
    still inside a collective (that peer then aborts in C++: "terminate called without an active
    exception"), then destroy it."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over all ranks, with one all-reduce (float64). Every rank must call it with the
    same keys; without a process group the values come back as they are."""
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over all ranks, with one all-reduce (float64); see :func:`sum_over_ranks`."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {k: v / world for k, v in sum_over_ranks(values).items()}

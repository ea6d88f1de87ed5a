"""Process-group setup that works under deepspeed, torchrun, accelerate launch and plain python."""

from __future__ import annotations

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


def export_local_size() -> None:
    """Set ``LOCAL_SIZE`` (processes on this node) when the launcher did not.

    DeepSpeed's CPU accelerator takes its device count from ``LOCAL_SIZE``, which only DeepSpeed's
    own launcher exports; without it every ``device_count()`` runs ``numactl --hardware`` in a
    subprocess, and ZeRO-3 asks once per gradient bucket it reduces (dozens of launches per step).
    torchrun and accelerate export the same number as ``LOCAL_WORLD_SIZE``, mpirun as
    ``OMPI_COMM_WORLD_LOCAL_SIZE``; a plain single process is 1. Other accelerators ignore it.
    """
    env = os.environ
    if "LOCAL_SIZE" in env:
        return
    local = env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local is None and int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1))) == 1:
        local = "1"
    if local is not None:
        env["LOCAL_SIZE"] = str(local)


def init_distributed(use_deepspeed: bool, backend: str | None = None) -> DistEnv:
    """Initialise the default process group once (also for a single process, so ZeRO works the same)."""
    # DeepSpeed calls torch collectives that torch 2.13 marks deprecated, once per bucket: noise for users.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+.? is deprecated", category=FutureWarning)
    if use_deepspeed:
        export_local_size()
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
    if use_deepspeed:
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    else:
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size)
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

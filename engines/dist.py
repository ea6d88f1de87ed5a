"""Process-group setup that works under deepspeed, torchrun, accelerate launch and plain python."""

from __future__ import annotations

import datetime
import logging
import math
import os
import signal
import socket
import sys
import threading
import traceback
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


def free_port() -> int:
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
    """Set ``LOCAL_SIZE`` from ``LOCAL_WORLD_SIZE`` (mpirun's, or 1): without it DeepSpeed's CPU accelerator runs
    ``numactl --hardware`` per ``device_count()``, dozens of subprocesses per ZeRO-3 step."""
    env = os.environ
    if "LOCAL_SIZE" in env:
        return
    local = env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local is None and int(env.get("WORLD_SIZE", env.get("OMPI_COMM_WORLD_SIZE", 1))) == 1:
        local = "1"
    if local is not None:
        env["LOCAL_SIZE"] = str(local)


_timeout_s: float | None = None  # what this process's group was created with (None: the defaults)
_destroyed = 0  # default groups this process has destroyed (shutdown); the next one gets fresh store keys


def _launched() -> bool:
    """Started by a launcher (torchrun, deepspeed, accelerate, mpirun), not as a plain process."""
    return any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK"))


def init_distributed(use_deepspeed: bool, backend: str | None = None, timeout_s: float | None = None) -> DistEnv:
    """Initialise the default process group once (also alone, so ZeRO works the same). ``timeout_s``: how long a
    collective may wait for the other ranks (None: torch's and DeepSpeed's defaults, 30 and 10 minutes)."""
    global _timeout_s
    # DeepSpeed calls torch collectives that torch 2.13 marks deprecated, once per bucket: noise for users.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+.? is deprecated", category=FutureWarning)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        from .config import ConfigError

        raise ConfigError(f"timeout_s={timeout_s!r}: give a number of seconds > 0 (or None for the defaults).")
    if use_deepspeed:
        export_local_size()
    env = read_env()
    if dist.is_available() and dist.is_initialized():
        if timeout_s is not None and timeout_s != _timeout_s:
            logger.warning("process group already initialised (timeout %s s); timeout_s=%s is ignored",
                           _timeout_s, timeout_s)
        return DistEnv(rank=dist.get_rank(), local_rank=env.local_rank, world_size=dist.get_world_size())
    if _launched():
        watch_launcher()
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world_size))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # A world of one needs no rendezvous: an in-memory store instead of a TCP one (a port found "free"
    # can be taken by another process before it listens; a MASTER_PORT inherited from a parent may be
    # in use).
    alone = env.world_size == 1
    if "MASTER_PORT" not in os.environ:
        if env.world_size > 1:
            raise RuntimeError(
                "WORLD_SIZE>1 but MASTER_PORT is not set: launch with deepspeed, torchrun or accelerate launch."
            )
        os.environ["MASTER_PORT"] = str(free_port())  # for libraries that read it; nothing listens on it
    backend = backend or default_backend()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=float(timeout_s))}
    if alone:  # DeepSpeed adopts the existing group
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **timeout)
    elif _destroyed:  # a group after a destroyed one (close, then a new registry): DeepSpeed adopts it too
        dist.init_process_group(backend=backend, store=_fresh_store(env, timeout), rank=env.rank,
                                world_size=env.world_size, **timeout)
    if use_deepspeed:
        # DeepSpeed may JIT-build an op during its start (on CPU: the shared-memory comm op); a lock
        # left by a killed build would make it wait for ever.
        from .jit_locks import remove_stale_locks

        remove_stale_locks()
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, **timeout)
        from .deepspeed_adapter import bound_group_timeouts

        bound_group_timeouts(timeout.get("timeout"))
        release_shm_buffers(env.rank, env.world_size)
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, **timeout)
    _timeout_s = timeout_s
    logger.info("process group up: rank %d of %d (%s%s)", env.rank, env.world_size, backend,
                "" if timeout_s is None else f", collective timeout {timeout_s:g} s")
    return env


def _fresh_store(env: DistEnv, timeout: dict) -> dist.Store:
    """The launcher's store under keys of this group's own: torch numbers groups from 0 again after a destroy, and
    a rank that read a destroyed group's address of its peer from the store waited on it for ever."""
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, **timeout))
    return dist.PrefixStore(f"multiengine-group-{_destroyed}", store)


# --- DeepSpeed's shared-memory all-reduce buffers on CPU ------------------------------------------
def _shm_buffer_path(rank: int) -> str:
    """The file DeepSpeed's CPU comm op creates for ``rank`` when every rank is on one host."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return os.path.join("/dev/shm", f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


def release_shm_buffers(rank: int, world_size: int) -> None:
    """Unlink this rank's shared-memory all-reduce buffer once every rank has mapped it: DeepSpeed never removes
    them (~70 MB per rank and job), and many short jobs fill /dev/shm. The mappings stay valid."""
    if torch.cuda.is_available() or os.environ.get("LOCAL_SIZE") != str(world_size):
        return  # no shm buffers: GPU comm, or ranks on several hosts
    if world_size > 1:
        dist.barrier()  # every rank has opened every other rank's buffer by now
    try:
        os.unlink(_shm_buffer_path(rank))
    except OSError:
        pass


# --- a rank whose launcher is gone ---------------------------------------------------------------
_watch_lock = threading.Lock()
_watching: int | None = None


def watch_launcher(poll_s: float = 1.0) -> None:
    """Exit when the parent (the launcher) dies, so no orphaned rank keeps training after the job was stopped.
    Idempotent; MULTIENGINE_WATCH_LAUNCHER=0 turns it off."""
    global _watching
    if os.environ.get("MULTIENGINE_WATCH_LAUNCHER", "1") == "0" or not hasattr(os, "getppid"):
        return
    with _watch_lock:
        if _watching == os.getpid():
            return
        _watching = os.getpid()
    parent = os.getppid()
    if parent <= 1:
        return

    def watch() -> None:
        import time

        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:  # re-parented: the launcher died
                msg = (f"rank {os.environ.get('RANK', '?')}: launcher (pid {parent}) is gone; "
                       "exiting so no orphaned rank keeps running")
                logger.error(msg)
                sys.stderr.write(f"error: {msg}\n")  # the user's one line, even with logging not set up
                sys.stderr.flush()
                os._exit(128 + signal.SIGHUP)  # works even while the main thread is inside a collective

    threading.Thread(target=watch, name="multiengine-launcher-watch", daemon=True).start()


# --- collective timeouts -------------------------------------------------------------------------
# gloo: "Timed out waiting 10000ms for recv operation"; NCCL: "Watchdog caught collective operation
# timeout"; the store: "... timed out after N seconds".
_TIMEOUT_MARKERS = ("Timed out waiting", "Watchdog caught collective operation timeout", "timed out after")


def collective_timeout_message(exc: BaseException) -> str | None:
    """One line naming the collective that timed out, where it was called from and the timeout (None for any other
    exception)."""
    text = f"{type(exc).__name__}: {exc}"
    timeout_types = tuple(t for t in (getattr(dist, "DistBackendError", None), getattr(dist, "DistError", None),
                                      RuntimeError) if t is not None)
    if not isinstance(exc, timeout_types) or not any(m in text for m in _TIMEOUT_MARKERS):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.path.dirname(torch.__file__)
    ds_dir = os.sep + "deepspeed" + os.sep

    def wrapper(f: traceback.FrameSummary) -> bool:  # decorators that only pass the call through
        return f.filename.startswith(torch_dir) or f.filename.endswith(
            (os.path.join("deepspeed", "utils", "nvtx.py"), os.sep + "typing_extensions.py"))

    c10d = [f for f in frames if f.filename.endswith(os.path.join("distributed", "distributed_c10d.py"))]
    inner = [f for f in frames if not wrapper(f)]
    if c10d:
        op = c10d[-1].name
    elif inner:
        f = inner[-1]
        op = f"{f.name} in {_short_path(f.filename)}:{f.lineno} (waiting on an asynchronous collective)"
    else:
        op = "(unknown)"
    user = [f for f in inner if ds_dir not in f.filename]
    where = f", reached from {_short_path(user[-1].filename)}:{user[-1].lineno} ({user[-1].name})" if user else ""
    limit = f"{_timeout_s:g} s" if _timeout_s is not None else "the default timeout"
    return (f"collective {op}{where}, timed out after {limit}: another rank stopped responding "
            "(stopped, hung, or far slower than this one)")


def _short_path(path: str) -> str:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `multiengine` is
    if path.startswith(package + os.sep):
        return os.path.join("multiengine", os.path.relpath(path, package))
    marker = "site-packages" + os.sep
    if marker in path:
        return path[path.rindex(marker) + len(marker):]
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def device_for(local_rank: int, use_deepspeed: bool) -> torch.device:
    if use_deepspeed:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name(local_rank)
        return torch.device(name if ":" in name or name == "cpu" else f"{name}:{local_rank}")
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the process group: a barrier first (a peer still inside a collective when gloo is torn down aborts
    in C++: "terminate called without an active exception"), then destroy it."""
    global _destroyed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        from .deepspeed_adapter import destroy_groups

        if not destroy_groups():
            dist.destroy_process_group()
        _destroyed += 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """A float64 CPU copy of ``values`` summed over all ranks (float64: means of many small numbers stay
    exact enough). Collective when a process group exists; NCCL gets a device copy."""
    out = values.detach().to(dtype=torch.float64).clone()
    if dist.is_available() and dist.is_initialized():
        if out.device.type == "cpu" and dist.get_backend() == "nccl":
            out = out.cuda()
        dist.all_reduce(out)
    return out.cpu()


def global_moments(x: torch.Tensor) -> tuple[float, float, float]:
    """Mean, population std and count of the entries of ``x`` across all ranks (one all-reduce)."""
    x = x.detach().to(torch.float64).reshape(-1).cpu()
    stats = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)]))
    total, total_sq, n = stats.tolist()
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(total_sq / max(n, 1.0) - mean * mean, 0.0)), n


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over all ranks, with one all-reduce (float64). Every rank must call it with the
    same keys; without a process group the values come back as they are."""
    keys = sorted(values)
    if not keys:
        return {}
    t = all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, t.tolist()))


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over all ranks, with one all-reduce (float64); see :func:`sum_over_ranks`."""
    world = world_size()
    return {k: v / world for k, v in sum_over_ranks(values).items()}

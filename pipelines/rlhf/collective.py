"""Small cross-rank reductions for RLHF statistics (float64, one all-reduce each).

Every function here is collective when ``torch.distributed`` is initialised: all ranks must call it
the same number of times. Without a process group they reduce over this process only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["all_reduce_mean", "all_reduce_sum", "global_moments", "world_size"]


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if _dist() else 1


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a CPU float64 copy, so means of many small numbers stay exact enough)."""
    out = values.detach().to(dtype=torch.float64).clone()
    if _dist():
        if out.device.type == "cpu" and dist.get_backend() == "nccl":
            out = out.cuda()
        dist.all_reduce(out)
    return out.cpu()


def all_reduce_mean(value: float | torch.Tensor) -> float:
    """Mean of a scalar over ranks."""
    t = torch.as_tensor(value, dtype=torch.float64).reshape(1)
    return float(all_reduce_sum(t)[0]) / world_size()


def global_moments(x: torch.Tensor) -> tuple[float, float, float]:
    """Mean, population std and count of the entries of ``x`` across all ranks (one all-reduce)."""
    x = x.detach().to(torch.float64).reshape(-1).cpu()
    stats = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)]))
    total, total_sq, n = stats.tolist()
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(total_sq / max(n, 1.0) - mean * mean, 0.0)), n

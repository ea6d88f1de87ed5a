"""Per-role, per-rank accounting of model states (parameters, gradients, optimizer state)."""

from __future__ import annotations

import math
import os
import resource
from typing import Any

import torch


def _param_counts(module: torch.nn.Module) -> tuple[int, int, int, int]:
    """(total numel, partition numel held here, persistent numel held here, bytes held here); ZeRO-3: ds_tensor is
    the partition, ds_persist parameters are whole on every rank."""
    total = partition = persistent = nbytes = 0
    for p in module.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_numel
            partition += p.ds_tensor.numel()
            nbytes += p.ds_tensor.numel() * p.ds_tensor.element_size()
            if getattr(p, "ds_persist", False):
                persistent += p.ds_numel
                nbytes += p.ds_numel * p.ds_tensor.element_size()
        else:
            total += p.numel()
            partition += p.numel()
            nbytes += p.numel() * p.element_size()
    return total, partition, persistent, nbytes


def _tensor_bytes(obj: Any, seen: set[int], exclude: set[int]) -> int:
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0:
            return 0
        key = obj.data_ptr()
        if key in seen or key in exclude:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen, exclude) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen, exclude) for v in obj)
    return 0


def optimizer_state_bytes(engine: Any) -> int:
    """Bytes of optimizer state held on this rank, measured: the base optimizer's state tensors
    plus its master (fp32) parameter partitions when those are not the model's own parameters."""
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return 0
    base = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO/BF16 wrappers keep the torch optimizer here
    if not isinstance(base, torch.optim.Optimizer):
        return 0
    model_ptrs = {p.data_ptr() for p in engine.module.parameters() if p.numel() > 0}
    seen: set[int] = set()
    total = _tensor_bytes(list(base.state.values()), seen, model_ptrs)
    for group in base.param_groups:
        total += _tensor_bytes(group["params"], seen, model_ptrs)
    # ZeRO-3 swaps its fp32 master partitions into param_groups only during step(): count them here.
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        total += _tensor_bytes(getattr(opt, attr, None), seen, model_ptrs)
    return total


def moe_params(module: torch.nn.Module) -> Any:
    """planner.MoeCounts of a live model (whole sizes of ZeRO-3 partitions), None for a dense one."""
    from .planner import moe_counts

    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return moe_counts(((n, getattr(p, "ds_numel", p.numel())) for n, p in module.named_parameters()),
                      config.to_dict())


def role_memory(role: Any, world_size: int) -> dict[str, Any]:
    module = role.module
    total, partition, persistent, nbytes = _param_counts(module)
    moe = moe_params(module)
    moe_note = (f"MoE top {moe.top_k} of {moe.experts}: {moe.active:,} active, experts "
                f"{100 * moe.expert_share:.0f}% of the weights" if moe else "")
    trainable_numel = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)
    element = torch.tensor([], dtype=role.dtype).element_size()
    if not role.trainable:
        grad_numel = 0
    elif role.stage >= 2:
        grad_numel = math.ceil(trainable_numel / world_size)  # reduce-scattered: only our partition
    else:
        grad_numel = trainable_numel
    offload = role.config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    return {
        "role": role.name,
        "stage": role.stage,
        "requested_stage": role.requested_stage,
        "trainable": role.trainable,
        "dtype": str(role.dtype).replace("torch.", ""),  # of the weights held
        "compute_dtype": str(getattr(role, "compute_dtype", role.dtype)).replace("torch.", ""),
        "params_total": total,
        "params_local": partition,
        "params_persistent": persistent,
        "params_active": moe.active if moe else total,  # used per token: top_k of the experts (MoE)
        "expert_share": moe.expert_share if moe else 0.0,
        "local_fraction": (partition / total) if total else 0.0,
        "param_bytes": nbytes,
        "param_device": "cpu" if offload == "cpu" else str(next(iter(module.parameters()), torch.empty(0)).device),
        "grad_bytes": grad_numel * element,
        "optimizer_bytes": optimizer_state_bytes(role.engine) if role.trainable else 0,
        # how its token-sequence passes run: activations scale with real tokens (packed) or the token budget
        "note": "; ".join(filter(None, [role.note, moe_note, "packed" if role.spec.packed else "",
                                        f"token budget {role.spec.token_budget}" if role.spec.token_budget else ""])),
    }


def gather_memory(registry: Any) -> list[dict[str, Any]]:
    """Per rank: the registry's per-role memory rows and the process's peak RSS (and CUDA peak), as a
    list indexed by rank. Collective: every rank must call it."""
    import torch.distributed as dist

    mine: dict[str, Any] = {"rank": registry.rank, "roles": list(registry.memory_report()),
                            "peak_rss_bytes": peak_rss_bytes()}
    if torch.cuda.is_available():
        mine["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if registry.world_size == 1 or not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * registry.world_size
    dist.all_gather_object(out, mine)
    return out


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class MemoryReport(list):
    """A list of per-role dicts that prints as a table."""

    def totals(self) -> dict[str, int]:
        keys = ("params_total", "params_local", "param_bytes", "grad_bytes", "optimizer_bytes")
        return {k: sum(row[k] for row in self) for k in keys}

    def __str__(self) -> str:
        header = ("role", "stage", "trainable", "params here / total", "params", "grads", "optim", "note")
        rows = [header]
        for r in self:
            rows.append((
                r["role"], str(r["stage"]), "yes" if r["trainable"] else "no",
                f"{r['params_local']:,} / {r['params_total']:,} ({100 * r['local_fraction']:.0f}%)",
                _fmt_bytes(r["param_bytes"]), _fmt_bytes(r["grad_bytes"]), _fmt_bytes(r["optimizer_bytes"]),
                r["note"],
            ))
        t = self.totals()
        rows.append(("total", "", "", f"{t['params_local']:,} / {t['params_total']:,}", _fmt_bytes(t["param_bytes"]),
                     _fmt_bytes(t["grad_bytes"]), _fmt_bytes(t["optimizer_bytes"]), ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

"""A plain-PyTorch stand-in for DeepSpeedEngine, so the same RoleSpecs and pipelines run without
DeepSpeed. It honours the role's config where PyTorch can: micro batch, gradient accumulation,
clipping and dtype. A frozen role's weights are cast to the dtype (as DeepSpeed holds them); a
trainable bf16/fp16 role keeps fp32 weights and runs its forward under ``torch.autocast`` in that
dtype, which computes with the same rounded weights DeepSpeed's bf16/fp16 copy holds while the
optimizer updates fp32 values, as DeepSpeed's fp32 master copy does (fp16 adds a GradScaler)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from .safe_io import load_tree, save_tree

_STATE_FILE = "torch_engine"  # + .json / .safetensors


class TorchEngine(torch.nn.Module):
    """The subset of DeepSpeedEngine's API that multiengine pipelines use."""

    def __init__(self, module: torch.nn.Module, config: dict[str, Any], device: torch.device,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler: Any = None, world_size: int = 1) -> None:
        super().__init__()
        self.module, self.config, self.device = module.to(device), config, device
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self._gas = int(config["gradient_accumulation_steps"])
        from .config import config_dtype

        dtype = config_dtype(config)
        self.autocast_dtype = dtype if optimizer is not None and dtype != torch.float32 else None
        self._scaler = torch.amp.GradScaler(device.type) if optimizer is not None and dtype == torch.float16 else None
        self._clip = float(config.get("gradient_clipping", 0.0) or 0.0)
        self.micro_steps = 0
        self.global_steps = 0
        self._boundary: bool | None = None
        self._ddp: torch.nn.Module | None = None
        if optimizer is not None and world_size > 1:
            self._ddp = torch.nn.parallel.DistributedDataParallel(self.module)

    # DeepSpeedEngine-compatible surface -------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is None:
            return (self._ddp or self.module)(*args, **kwargs)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            return (self._ddp or self.module)(*args, **kwargs)

    def gradient_clipping(self) -> float:
        return self._clip

    def bfloat16_enabled(self) -> bool:
        return self.autocast_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.autocast_dtype == torch.float16

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config["train_micro_batch_size_per_gpu"])

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def train_batch_size(self) -> int:
        return int(self.config["train_batch_size"])

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._gas == 0 if self._boundary is None else self._boundary

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """As DeepSpeed's: the caller says which micro-batch ends an optimizer step (None: every ``gas``-th)."""
        self._boundary = is_boundary

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        # Same scaling as DeepSpeed (scale_wrt_gas): the summed micro-batch grads average.
        scaled = loss / self._gas
        (self._scaler.scale(scaled) if self._scaler is not None else scaled).backward()
        return loss

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            if self._scaler is not None:
                self._scaler.unscale_(self.optimizer)
            if self._clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self._clip)
            if self._scaler is not None:
                self._scaler.step(self.optimizer)
                self._scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.global_steps += 1
        self.micro_steps += 1

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer else []

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any] | None = None) -> None:
        """Rank 0 writes torch_engine.json + .safetensors (replicas are identical): no pickle, so a
        checkpoint from elsewhere cannot run code when loaded."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        save_tree(
            {
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                "global_steps": self.global_steps,
                "micro_steps": self.micro_steps,
                "client_state": client_state or {},
            },
            os.path.join(save_dir, tag, _STATE_FILE),
            what="torch engine state",
        )

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str, dict[str, Any]]:
        path = os.path.join(load_dir, tag, _STATE_FILE)
        state = load_tree(path)
        self.module.load_state_dict({k: v.to(self.device) for k, v in state["module"].items()})
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])  # moves state to the parameters' device
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.global_steps = state["global_steps"]
        self.micro_steps = state["micro_steps"]
        return path, state["client_state"]

"""EngineRegistry: a map from role name to its engine and what built it.

Every role, frozen ones included, goes through its own `deepspeed.initialize` with its own
config. Nothing global survives from one role's build to the next (see zero_scope.py).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint as _ckpt
from . import memory as _memory
from .config import (
    AUTO,
    ConfigError,
    config_dtype,
    find_auto,
    load_ds_config,
    model_hidden_size,
    model_param_counts,
    resolve_batch_keys,
    resolve_bucket_sizes,
    validate_ds_config,
    zero_stage,
)
from .dist import DistEnv, deepspeed_available, device_for, init_distributed, shutdown
from .torch_backend import TorchEngine
from .zero_scope import role_build_scope

logger = logging.getLogger(__name__)

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class RoleSpec:
    """What a role is built from.

    model:        called inside this role's build scope (zero.Init for stage 3), returns the module.
    ds_config:    a dict (e.g. from train_ds_config / eval_ds_config) or a DeepSpeed JSON path.
    optimizer:    factory taking the trainable parameters; required for trainable roles only.
    lr_scheduler: optional factory taking the optimizer.
    trainable:    defaults to "has an optimizer"; a trainable role without one, or a frozen role
                  with one, is an error.
    hidden_size:  width for "auto" ZeRO bucket sizes when the model exposes none.
    stateful:     a frozen role whose weights change during training (an EMA copy): saved in
                  checkpoints as this rank's partitions instead of being rebuilt from source.
    gather_forward: a frozen ZeRO-3 role gathers all its parameters once per forward call (one
                  collective) instead of layer by layer; it still holds 1/N between calls. Worth it
                  for small frozen models called once per step (a VAE, a text encoder).
    """

    name: str
    model: ModelFactory
    ds_config: dict[str, Any] | str
    optimizer: OptimizerFactory | None = None
    lr_scheduler: SchedulerFactory | None = None
    trainable: bool | None = None
    hidden_size: int | None = None
    stateful: bool = False
    gather_forward: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(f"role name {self.name!r} must be an identifier (letters, digits, '_').")
        if not callable(self.model):
            raise ConfigError(f"role '{self.name}': model must be a callable returning a module, got {self.model!r}.")
        has_ds_optimizer = isinstance(self.ds_config, dict) and "optimizer" in self.ds_config
        has_optimizer = self.optimizer is not None or has_ds_optimizer
        if self.trainable is None:
            self.trainable = has_optimizer
        if self.trainable and not has_optimizer:
            raise ConfigError(
                f"role '{self.name}': trainable=True but no optimizer; pass optimizer=lambda params: ..."
                " or trainable=False for a frozen role."
            )
        if not self.trainable and has_optimizer:
            raise ConfigError(
                f"role '{self.name}': trainable=False but an optimizer was given; frozen roles get no"
                " optimizer: drop optimizer= (and the config's 'optimizer' section) or set trainable=True."
            )
        if self.lr_scheduler is not None and not self.trainable:
            raise ConfigError(f"role '{self.name}': lr_scheduler given for a frozen role; drop it.")
        if self.gather_forward and self.trainable:
            raise ConfigError(f"role '{self.name}': gather_forward is for frozen roles; a trainable one needs its"
                              " ZeRO-3 hooks for the backward pass.")


@dataclass
class Role:
    """A built role: its engine plus what built it."""

    spec: RoleSpec
    engine: Any  # DeepSpeedEngine or TorchEngine
    config: dict[str, Any]  # the resolved config the engine was built with
    requested_stage: int
    note: str = ""
    backend: str = "deepspeed"
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def trainable(self) -> bool:
        return bool(self.spec.trainable)

    @property
    def stage(self) -> int:
        return zero_stage(self.config) if self.backend == "deepspeed" else 0

    @property
    def dtype(self) -> torch.dtype:
        return config_dtype(self.config)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module


def _gathered_forward(forward: Callable[..., Any], params: list[torch.nn.Parameter]) -> Callable[..., Any]:
    """Run forward with all parameters gathered by one collective; the ZeRO-3 hooks then find every
    parameter present and fetch nothing. Released (back to 1/N) when the call returns."""
    import functools

    import deepspeed

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with deepspeed.zero.GatheredParameters(params):
            return forward(*args, **kwargs)

    return run


class UnknownRoleError(KeyError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        known = list(known)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        super().__init__(f"unknown role '{name}'; roles are {known}.{hint}")

    def __str__(self) -> str:
        return str(self.args[0])


class EngineRegistry:
    """Named engines, one per model role, each with its own config.

    backend: "deepspeed", "torch", or "auto" (DeepSpeed when it imports, else plain PyTorch).
    """

    def __init__(self, backend: str = "auto", dist_backend: str | None = None) -> None:
        if backend not in ("auto", "deepspeed", "torch"):
            raise ConfigError(f"backend={backend!r}; use 'auto', 'deepspeed' or 'torch'.")
        if backend == "auto":
            backend = "deepspeed" if deepspeed_available() else "torch"
        if backend == "deepspeed" and not deepspeed_available():
            raise ConfigError("backend='deepspeed' but deepspeed does not import; install it or use backend='torch'.")
        self.backend = backend
        self.env: DistEnv = init_distributed(use_deepspeed=backend == "deepspeed", backend=dist_backend)
        self.device = device_for(self.env.local_rank, backend == "deepspeed")
        self._specs: dict[str, RoleSpec] = {}
        self._roles: dict[str, Role] = {}

    # --- the map ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def add(self, spec: RoleSpec) -> RoleSpec:
        if spec.name in self._specs:
            raise ConfigError(f"role '{spec.name}' was already added; role names must be unique.")
        self._specs[spec.name] = spec
        return spec

    def names(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def role(self, name: str) -> Role:
        if name not in self._specs:
            raise UnknownRoleError(name, self._specs)
        if name not in self._roles:
            raise RuntimeError(f"role '{name}' was added but not built yet; call registry.build().")
        return self._roles[name]

    def __getitem__(self, name: str) -> Any:
        return self.role(name).engine

    def roles(self) -> list[Role]:
        return [self._roles[n] for n in self._specs if n in self._roles]

    def trainable_roles(self) -> list[Role]:
        return [r for r in self.roles() if r.trainable]

    def stateful_frozen_roles(self) -> list[Role]:
        return [r for r in self.roles() if not r.trainable and r.spec.stateful]

    # --- building -----------------------------------------------------------------------------
    def resolve_config(self, spec: RoleSpec) -> tuple[dict[str, Any], int, str]:
        """The role's config with batch keys resolved and the stage it will really be built at."""
        config = load_ds_config(spec.ds_config)
        validate_ds_config(spec.name, config)
        requested = zero_stage(config)
        note = ""
        if not spec.trainable and requested in (1, 2):
            # DeepSpeed refuses ZeRO-1/2 without an optimizer; they would shard nothing here anyway.
            config["zero_optimization"] = {"stage": 0}
            note = f"frozen: stage {requested} requested, built at stage 0 (ZeRO-1/2 split only grads/optimizer)"
        if config.get("fp16", {}).get("enabled") and self.device.type == "cpu":
            raise ConfigError(
                f"role '{spec.name}': fp16.enabled=true, but DeepSpeed's CPU accelerator has no fp16;"
                " use dtype='bf16' or 'fp32'."
            )
        resolve_batch_keys(spec.name, config, self.world_size)
        return config, requested, note

    def build(self) -> EngineRegistry:
        """Build every role added since the last build, in the order they were added."""
        for name, spec in self._specs.items():
            if name not in self._roles:
                self._roles[name] = self._build_role(spec)
        return self

    def _build_role(self, spec: RoleSpec) -> Role:
        config, requested, note = self.resolve_config(spec)
        stage = zero_stage(config)
        use_ds = self.backend == "deepspeed"
        # zero.Init only needs the stage, dtype and offload device; buckets are sized from the model after.
        init_config = copy.deepcopy(config)
        resolve_bucket_sizes(init_config, None)
        with role_build_scope(init_config, stage, use_ds):
            model = spec.model()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"role '{spec.name}': model() returned {type(model).__name__}, not a torch.nn.Module.")
        total, trainable = model_param_counts(model)
        resolve_bucket_sizes(config, spec.hidden_size or model_hidden_size(model), num_params=total,
                             trainable_params=trainable if spec.trainable else None)
        leftover = find_auto(config)
        if leftover:
            raise ConfigError(f"role '{spec.name}': cannot resolve \"auto\" for {leftover}; give numbers.")

        if spec.trainable:
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()

        if use_ds:
            engine = self._deepspeed_engine(spec, model, config)
        else:
            engine = self._torch_engine(spec, model, config)
        if not spec.trainable:
            # Frozen roles never build an autograd graph, whoever calls them.
            engine.forward = torch.no_grad()(engine.forward)
            if spec.gather_forward and use_ds and stage == 3:
                engine.forward = _gathered_forward(engine.forward, list(model.parameters()))
        role = Role(spec=spec, engine=engine, config=config, requested_stage=requested, note=note,
                    backend=self.backend)
        if self.is_main:
            logger.info("built role '%s': stage %d, %s, %s%s", spec.name, role.stage, role.dtype,
                        "trainable" if spec.trainable else "frozen", f" ({note})" if note else "")
        return role

    def _deepspeed_engine(self, spec: RoleSpec, model: torch.nn.Module, config: dict[str, Any]) -> Any:
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad] if spec.trainable else None
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=params,
                optimizer=spec.optimizer if spec.trainable else None,
                lr_scheduler=spec.lr_scheduler,
                config=config,
            )
        except (ValueError, AssertionError, TypeError) as exc:
            raise ConfigError(f"role '{spec.name}': DeepSpeed rejected the config: {exc}") from exc
        return engine

    def _torch_engine(self, spec: RoleSpec, model: torch.nn.Module, config: dict[str, Any]) -> TorchEngine:
        dtype = config_dtype(config)
        if not spec.trainable and dtype != torch.float32:
            model = model.to(dtype)
        optimizer = scheduler = None
        if spec.trainable:
            model = model.to(self.device)
            optimizer = spec.optimizer([p for p in model.parameters() if p.requires_grad])
            scheduler = spec.lr_scheduler(optimizer) if spec.lr_scheduler else None
        return TorchEngine(model, config, self.device, optimizer, scheduler, self.world_size)

    # --- using the engines ----------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, *names: str, modifier_rank: int | None = None) -> Iterator[None]:
        """Full parameters of these roles for the duration of the block (once, not per layer).

        All ranks must enter it. With modifier_rank set, changes made on that rank are kept and
        re-partitioned on exit. Roles below stage 3 already hold full parameters: no-op for them.
        """
        roles = [self.role(n) for n in names] if names else self.roles()
        with contextlib.ExitStack() as stack:
            for role in roles:
                if role.backend == "deepspeed" and role.stage == 3:
                    import deepspeed

                    params = list(role.module.parameters())
                    stack.enter_context(deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank))
            yield

    def memory_report(self) -> _memory.MemoryReport:
        """Per role: stage, trainable, parameters on this rank / total, bytes of params, grads, optimizer state."""
        return _memory.MemoryReport([_memory.role_memory(r, self.world_size) for r in self.roles()])

    def save_checkpoint(self, save_dir: str, client_state: dict[str, Any] | None = None, tag: str | None = None,
                        keep_last: int | None = None) -> str:
        """Atomically write every trainable role's engine state, a manifest and client state (+RNG).
        All ranks must call it. Returns the checkpoint folder."""
        return _ckpt.save(self, save_dir, client_state or {}, tag=tag, keep_last=keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> dict[str, Any]:
        """Restore every trainable role, RNG states; returns the client state that was saved."""
        return _ckpt.load(self, load_dir, tag=tag)

    def export(self, out_dir: str, roles: Iterable[str] | None = None) -> dict[str, str]:
        """Consolidated full weights per role: save_pretrained for HF models, safetensors otherwise."""
        return _ckpt.export(self, out_dir, list(roles) if roles is not None else self.names())

    def close(self) -> None:
        """End of the run, on every rank: drop the engines and leave the process group cleanly."""
        self._roles.clear()
        shutdown()

    def describe(self) -> dict[str, Any]:
        """The resolved config of every role (for summary.json)."""
        return {
            r.name: {"stage": r.stage, "requested_stage": r.requested_stage, "trainable": r.trainable,
                     "dtype": str(r.dtype).replace("torch.", ""), "note": r.note, "config": r.config}
            for r in self.roles()
        }


__all__ = ["AUTO", "EngineRegistry", "Role", "RoleSpec", "UnknownRoleError"]

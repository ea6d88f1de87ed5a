"""EngineRegistry: a map from role name to its engine and what built it. Every role, frozen ones included, goes
through its own `deepspeed.initialize` with its own config; nothing global survives one role's build (zero_scope.py).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import checkpoint as _ckpt
from . import deepspeed_adapter as ds
from . import export as _export
from . import memory as _memory
from . import nonfinite as _nonfinite
from .config import (
    AUTO,
    ConfigError,
    config_dtype,
    deepspeed_clipping_default,
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
from .moe import set_leaf_modules
from .partition import hooks_detached, whole_parameters
from .roles import RoleSpec, set_gradient_checkpointing
from .seeding import generator as _generator
from .seeding import role_seed, seed_everything
from .torch_backend import TorchEngine
from .zero_scope import role_build_scope

logger = logging.getLogger(__name__)

# Client-state key under which registered objects (samplers, controllers) are checkpointed.
_STATES_KEY = "_registry_states"


@dataclass
class Role:
    """A built role: its engine plus what built it."""

    spec: RoleSpec
    engine: Any  # DeepSpeedEngine or TorchEngine
    config: dict[str, Any]  # the resolved config the engine was built with
    requested_stage: int
    note: str = ""
    backend: str = "deepspeed"

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
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes in (the config's)."""
        return config_dtype(self.config)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are held in: the config's under DeepSpeed (the fp32 master copy lives in its
        optimizer); fp32 for a trainable role on the torch backend, which autocasts its forward."""
        if self.backend == "torch" and self.trainable:
            return torch.float32
        return self.compute_dtype

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module


def _gathered_forward(forward: Callable[..., Any], params: list[torch.nn.Parameter]) -> Callable[..., Any]:
    """Forward with all parameters gathered by one coalesced collective (the ZeRO-3 hooks find them present and
    fetch nothing), released to 1/N when it returns."""
    import functools

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with whole_parameters(params):
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


class JointLossError(RuntimeError):
    """A loss that reaches several trainable roles was passed to one engine's backward."""


class EngineRegistry:
    """Named engines, one per model role, each with its own config. ``backend``: deepspeed, torch or auto (DeepSpeed
    when it imports); ``dist_backend``: gloo/nccl (default by device); ``seed``: ``seed_everything(seed, rank)`` and
    the base of ``generator()`` (model factories run under a seed the same on every rank either way);
    ``timeout_s``: the collective timeout. Creates the default process group (or reuses an existing one)."""

    def __init__(self, backend: str = "auto", dist_backend: str | None = None, seed: int | None = None,
                 timeout_s: float | None = None) -> None:
        if backend not in ("auto", "deepspeed", "torch"):
            raise ConfigError(f"backend={backend!r}; use 'auto', 'deepspeed' or 'torch'.")
        if backend == "auto":
            backend = "deepspeed" if deepspeed_available() else "torch"
        if backend == "deepspeed" and not deepspeed_available():
            raise ConfigError("backend='deepspeed' but deepspeed does not import; install it or use backend='torch'.")
        self.backend = backend
        self.env: DistEnv = init_distributed(use_deepspeed=backend == "deepspeed", backend=dist_backend,
                                             timeout_s=timeout_s)
        self.device = device_for(self.env.local_rank, backend == "deepspeed")
        self.seed = seed
        if seed is not None:
            seed_everything(seed, self.env.rank)
        self._specs: dict[str, RoleSpec] = {}
        self._roles: dict[str, Role] = {}
        self._states: dict[str, Any] = {}
        self._restored_from: str | None = None  # the checkpoint load_checkpoint read (add_state is refused after)
        self._gather_depth: dict[str, int] = {}
        self._param_owner: dict[int, str] = {}
        self._nonfinite_guards: dict[str, Any] = {}
        self._nonfinite_queue: list[_nonfinite.NonFiniteUpdate] = []
        self._rollouts: dict[str, Any] = {}

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

    # --- randomness and state ----------------------------------------------------------------------
    def generator(self, step: int, salt: str = "", rank: int | None = None) -> torch.Generator:
        """A CPU generator for (seed, salt, step, rank): reproducible per step and distinct per rank (pass
        ``rank=0`` on every rank for a draw all ranks must share). Independent of the global RNG."""
        return _generator("registry", self.seed or 0, salt, step, self.rank if rank is None else rank)

    def add_state(self, name: str, obj: Any) -> Any:
        """Checkpoint ``obj`` (with ``state_dict()``/``load_state_dict()``: a sampler, a KL controller) per rank
        with every ``save_checkpoint``; ``load_checkpoint`` restores it, so afterwards it is refused."""
        if self._restored_from is not None:
            raise ConfigError(f"add_state('{name}', ...) after load_checkpoint({self._restored_from!r}): the "
                              "checkpoint was read already, so it would start fresh instead of where the run was; "
                              "register it before load_checkpoint (a recipe: in build(), which runs before resume)")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(f"add_state('{name}', ...): {type(obj).__name__} has no state_dict/load_state_dict.")
        if name in self._states:
            raise ConfigError(f"add_state: a state named '{name}' is already registered.")
        self._states[name] = obj
        return obj

    # --- building -----------------------------------------------------------------------------
    def resolve_config(self, spec: RoleSpec) -> tuple[dict[str, Any], int, str]:
        """The role's config with batch keys resolved and the stage it will really be built at."""
        config = load_ds_config(spec.ds_config)
        validate_ds_config(spec.name, config)
        requested = zero_stage(config)
        notes = []
        if not spec.trainable and requested in (1, 2):
            # DeepSpeed refuses ZeRO-1/2 without an optimizer; they would shard nothing here anyway.
            config["zero_optimization"] = {"stage": 0}
            notes.append(f"frozen: stage {requested} requested, built at stage 0 (ZeRO-1/2 split only grads/optimizer)")
        if self.backend == "torch" and requested:
            notes.append(f"torch backend: stage {requested} requested, but plain PyTorch has no ZeRO; every rank holds"
                         " the whole model" + (" (DDP)" if spec.trainable else ""))
        if self.backend == "torch" and spec.trainable and config_dtype(config) != torch.float32:
            name = str(config_dtype(config)).replace("torch.", "")
            notes.append(f"torch backend: fp32 weights, forward autocast to {name}")
        if config.get("fp16", {}).get("enabled") and self.device.type == "cpu":
            raise ConfigError(f"role '{spec.name}': fp16.enabled=true, but DeepSpeed's CPU accelerator has no fp16;"
                              " use dtype='bf16' or 'fp32'.")
        if spec.trainable and "gradient_clipping" not in config:
            # a user's own config without the key: what DeepSpeed will do, stated for the torch backend and summary
            config["gradient_clipping"] = deepspeed_clipping_default()
        resolve_batch_keys(spec.name, config, self.world_size)
        return config, requested, "; ".join(notes)

    def build(self) -> EngineRegistry:
        """Build every role added since the last build, in the order they were added."""
        for name, spec in self._specs.items():
            if name not in self._roles:
                role = self._build_role(spec)
                self._roles[name] = role
                if role.trainable:
                    for p in role.module.parameters():
                        self._param_owner[id(p)] = name
                    self._guard_backward(role)
                    self._nonfinite_guards[name] = _nonfinite.install_guard(
                        name, role.engine, self.backend, self.world_size, self._nonfinite_queue)
        return self

    def nonfinite_updates(self) -> list[_nonfinite.NonFiniteUpdate]:
        """The updates skipped since the last call for a NaN/inf loss or gradient norm (nonfinite.py); the same on
        every rank."""
        out, self._nonfinite_queue[:] = list(self._nonfinite_queue), []
        return out

    def _build_role(self, spec: RoleSpec) -> Role:
        config, requested, note = self.resolve_config(spec)
        stage = zero_stage(config)
        use_ds = self.backend == "deepspeed"
        # zero.Init only needs the stage, dtype and offload device; buckets are sized from the model after.
        init_config = copy.deepcopy(config)
        resolve_bucket_sizes(init_config, None)
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        # The same seed on every rank: random weights agree without a broadcast; the caller's RNG is left alone.
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(role_seed(self.seed or 0, spec.name))
            try:
                with role_build_scope(init_config, stage, use_ds):
                    model = spec.model()
            except ConfigError:
                raise
            except Exception as exc:
                what = f"{type(exc).__name__}: {exc}"
                raise RuntimeError(f"role '{spec.name}': its model factory failed: {what}") from exc
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"role '{spec.name}': model() returned {type(model).__name__}, not a torch.nn.Module.")
        total, trainable = model_param_counts(model)
        resolve_bucket_sizes(config, spec.hidden_size or model_hidden_size(model), num_params=total,
                             trainable_params=trainable if spec.trainable else None)
        leftover = find_auto(config)
        if leftover:
            raise ConfigError(f"role '{spec.name}': cannot resolve \"auto\" for {leftover}; give numbers.")

        if spec.trainable:
            if not any(p.requires_grad for p in model.parameters()):
                raise ConfigError(f"role '{spec.name}': trainable, but no parameter of its model requires grad.")
            model.train()
        else:
            model.requires_grad_(False)
            model.eval()

        if use_ds and stage == 3:  # expert blocks with one module per expert: gathered whole, however ranks route
            set_leaf_modules(model)
        engine = (self._deepspeed_engine if use_ds else self._torch_engine)(spec, model, config)
        engine.packed_sequences, engine.token_budget = spec.packed, spec.token_budget  # read by packing.py's callers
        engine.router_aux_coef = spec.router_aux_coef  # read by moe.aux_term
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
            engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config,
                                              optimizer=spec.optimizer if spec.trainable else None,
                                              lr_scheduler=spec.lr_scheduler)
        except (ValueError, AssertionError, TypeError) as exc:
            raise ConfigError(f"role '{spec.name}': DeepSpeed rejected the config: {exc}") from exc
        ds.check(engine if spec.trainable else None)  # the internals registry.backward and gathers use
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

    # --- whole weights: gathers and generation ---------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, *names: str, modifier_rank: int | None = None) -> Iterator[None]:
        """Full parameters of these roles (all when none are named) for the block, gathered once in one coalesced
        all-gather, with each ZeRO-3 role's hooks detached (its forward runs on whole weights, no communication);
        back to 1/N on exit. All ranks enter it; do not train inside it. Read-only, unless ``modifier_rank``: that
        rank's changes are broadcast and re-partitioned on exit. Below stage 3, or nested, it is a no-op."""
        roles = [self.role(n) for n in names] if names else self.roles()
        with contextlib.ExitStack() as stack:
            params: list[torch.nn.Parameter] = []
            for role in roles:
                if role.backend != "deepspeed" or role.stage != 3 or self._gather_depth.get(role.name):
                    continue
                stack.enter_context(self._depth(role.name))
                stack.enter_context(hooks_detached(role.engine))
                params.extend(role.module.parameters())
            stack.enter_context(whole_parameters(params, modifier_rank=modifier_rank))
            yield

    @contextlib.contextmanager
    def _depth(self, name: str) -> Iterator[None]:
        self._gather_depth[name] = self._gather_depth.get(name, 0) + 1
        try:
            yield
        finally:
            self._gather_depth[name] -= 1

    @contextlib.contextmanager
    def generation(self, name: str, gather: bool = True) -> Iterator[torch.nn.Module]:
        """The role's module ready for ``generate`` for the block: a ZeRO-3 role gathered once (``gathered``: every
        token on whole local weights, one full copy per rank meanwhile), or with ``gather=False`` fetched layer by
        layer (pass ``synced_gpus=True`` to ``generate`` on several ranks). Eval mode, gradient checkpointing off (it
        forces ``use_cache=False``) and torch's own ``F.linear``, all restored on exit. All ranks enter it."""
        role = self.role(name)
        module = role.module
        was_training = module.training
        had_checkpointing = set_gradient_checkpointing(module, False)
        module.eval()
        try:
            with self.gathered(name) if gather else contextlib.nullcontext(), ds.plain_linear():
                yield module
        finally:
            module.train(was_training)
            if had_checkpointing:
                set_gradient_checkpointing(module, True)

    def add_rollout(self, name: str, engine: Any) -> None:
        """An inference engine that generates for role ``name`` (vllm_rollout.VLLMRollout): synced from the role by
        :meth:`rollout`, shown in :meth:`memory_report`, closed with the registry."""
        engine.version = None  # synced from this role before its first rollout
        self._rollouts[name] = engine

    def rollout(self, name: str) -> Any | None:
        """Role ``name``'s rollout engine holding the role's current weights (synced when it stepped since the last
        sync, or was loaded from a checkpoint; collective), or None."""
        engine = self._rollouts.get(name)
        if engine is not None and engine.version != int(self.role(name).engine.global_steps):
            engine.sync(self.role(name).module, int(self.role(name).engine.global_steps))
        return engine

    # --- a loss over several trainable roles -----------------------------------------------------------
    def _roles_reached(self, loss: torch.Tensor) -> set[str]:
        """Trainable roles whose parameters the autograd graph of ``loss`` reaches."""
        found: set[str] = set()
        seen: set[int] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            variable = getattr(fn, "variable", None)
            if variable is not None and id(variable) in self._param_owner:
                found.add(self._param_owner[id(variable)])
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        return found

    def _guard_backward(self, role: Role) -> None:
        """``registry[name].backward(loss)`` refuses a loss that also reaches other trainable roles: it would give
        them gradients, and their own backward would run the graph again (ZeRO fails on re-partitioned parameters)."""
        engine = role.engine
        original = engine.backward

        def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if len(self._param_owner) and len({*self._param_owner.values()}) > 1 and loss.grad_fn is not None:
                others = sorted(self._roles_reached(loss) - {role.name})
                if others:
                    names = [role.name, *others]
                    raise JointLossError(
                        f"registry['{role.name}'].backward(loss): this loss also depends on trainable role(s) {others}."
                        f" Call registry.backward(loss, roles={names}) once (then registry.step(roles={names}))"
                        " instead of one engine's backward per role; or, if they should pass gradients on without"
                        f" learning from it (a GAN's generator step), registry.backward(loss, roles=['{role.name}'],"
                        f" through={others}).")
            with self._bystanders_quiet({role.name}):
                return original(loss, *args, **kwargs)

        engine.backward = backward

    def backward(self, loss: torch.Tensor, roles: Sequence[str] | None = None, retain_graph: bool = False,
                 through: Sequence[str] = ()) -> None:
        """One backward pass of a loss that depends on several trainable roles (any mix of stages, both backends):
        each role's gradients as its own ``engine.backward`` would give them (divided by its accumulation steps and
        fp16 loss scale, reduced as its stage reduces them); then ``registry.step(roles)``. All ranks call it.
        ``roles``: default every trainable role the loss reaches. ``through``: trainable roles it only flows
        through (a GAN's discriminator in the generator step): their parameters get no gradient, at any stage."""
        through = list(through)
        for name in through:
            if not self.role(name).trainable:
                raise ConfigError(f"registry.backward: through=['{name}'] is frozen; frozen roles never take "
                                  "gradients, so leave it out of through.")
        reached = self._roles_reached(loss) if loss.grad_fn is not None else set()
        names = (list(roles) if roles is not None
                 else [r.name for r in self.trainable_roles() if r.name in reached and r.name not in through])
        if not names:
            raise ConfigError("registry.backward: the loss reaches no trainable role (is it detached?).")
        both = sorted(set(names) & set(through))
        if both:
            raise ConfigError(f"registry.backward: role(s) {both} are in both roles and through; a role either "
                              "learns from this loss (roles) or only passes gradients on (through).")
        targets = [self.role(n) for n in names]
        frozen = [r.name for r in targets if not r.trainable]
        if frozen:
            raise ConfigError(f"registry.backward: role(s) {frozen} are frozen; list trainable roles only.")
        unlisted = sorted(reached - set(names) - set(through))
        if unlisted:
            raise JointLossError(f"registry.backward(roles={names}): the loss also reaches trainable role(s)"
                                 f" {unlisted}; list them in roles to train them on it too, in through=... to pass"
                                 " gradients through them without updating them, or detach their outputs.")
        for role in targets:
            _nonfinite.note_loss(self._nonfinite_guards.get(role.name), loss)
        factors = [self._loss_factor(r) for r in targets]
        hooks: list[Any] = []
        scaled = loss
        if len(set(factors)) == 1:
            scaled = loss * factors[0]
        else:
            # Different accumulation steps (or fp16 loss scales): scale each role's gradients on arrival.
            for role, factor in zip(targets, factors):
                for p in role.module.parameters():
                    if p.requires_grad:
                        hooks.append(p.register_hook(lambda g, f=factor: g * f))
        # Gradients accumulate into the listed roles' parameters only: autograd skips every other leaf,
        # so a role passed through keeps its .grad and its ZeRO reduction hooks never fire.
        inputs = [p for r in targets for p in r.module.parameters() if p.requires_grad] if through else None
        try:
            with self._bystanders_quiet(set(names)):
                if self.backend == "deepspeed":
                    ds.joint_backward(scaled, [r.engine for r in targets], retain_graph, inputs)
                else:
                    scaled.backward(retain_graph=retain_graph, inputs=inputs)
        finally:
            for hook in hooks:
                hook.remove()

    @contextlib.contextmanager
    def _bystanders_quiet(self, learning: set[str]) -> Iterator[None]:
        """For one backward pass: every trainable DeepSpeed role that does not learn from it ignores the gradient
        passing through its outputs (deepspeed_adapter.prologue_skipped)."""
        with ds.prologue_skipped([r.engine for r in self.trainable_roles()
                                  if r.name not in learning and r.backend == "deepspeed"]):
            yield

    @staticmethod
    def _loss_factor(role: Role) -> float:
        """What ``engine.backward`` multiplies the loss by: 1 / accumulation steps (x the fp16 loss scale)."""
        factor = 1.0 / role.engine.gradient_accumulation_steps()
        return factor * ds.loss_scale(role.engine) if role.backend == "deepspeed" else factor

    def step(self, roles: Sequence[str] | None = None) -> None:
        """``engine.step()`` of each listed trainable role (default all): each at its own accumulation boundary."""
        for name in roles if roles is not None else [r.name for r in self.trainable_roles()]:
            role = self.role(name)
            if not role.trainable:
                raise ConfigError(f"registry.step: role '{name}' is frozen; it has no optimizer.")
            role.engine.step()

    # --- reports, checkpoints, exports -------------------------------------------------------------------
    def memory_report(self) -> _memory.MemoryReport:
        """Per role: stage, trainable, parameters on this rank / total, bytes of params, grads, optimizer state."""
        return _memory.MemoryReport([*(_memory.role_memory(r, self.world_size) for r in self.roles()),
                                     *(engine.memory(f"rollout ({name})") for name, engine in self._rollouts.items())])

    def save_checkpoint(self, save_dir: str, client_state: dict[str, Any] | None = None, tag: str | None = None,
                        keep_last: int | None = None) -> str:
        """Atomically write every trainable role's state, a manifest, client state, RNG and the ``add_state``
        objects; all ranks call it. Returns the folder."""
        state = dict(client_state or {})
        if self._states:
            state[_STATES_KEY] = {name: obj.state_dict() for name, obj in self._states.items()}
        return _ckpt.save(self, save_dir, state, tag=tag, keep_last=keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> dict[str, Any]:
        """Restore every trainable role, RNG states and registered objects; returns the client state."""
        state = dict(_ckpt.load(self, load_dir, tag=tag))
        saved = state.pop(_STATES_KEY, {})
        missing = sorted(set(self._states) - set(saved))
        if missing:
            raise _ckpt.CheckpointError(f"checkpoint in {load_dir!r} has no state for {missing} (registered with"
                                        " add_state); it was written by a run that did not register them.")
        for name, obj in self._states.items():
            obj.load_state_dict(saved[name])
        for engine in self._rollouts.values():
            engine.version = None  # synced again before its next rollout
        self._restored_from = load_dir
        return state

    def export(self, out_dir: str, roles: Iterable[str] | None = None, dtype: str | None = None) -> dict[str, str]:
        """Full weights of each role in ``out_dir/<role>/`` (export.save_role: atomic, LoRA merged, ``dtype`` casts
        floating weights); all ranks call it."""
        import os

        names = list(roles) if roles is not None else self.names()
        return {name: _export.save_role(self, name, os.path.join(out_dir, name), dtype=dtype)["model"]
                for name in names}

    def close(self) -> None:
        """End of the run, on every rank: drop the engines and leave the process group cleanly."""
        for engine in self._rollouts.values():
            engine.close()
        self._rollouts.clear()
        self._roles.clear()
        self._param_owner.clear()
        shutdown()

    def describe(self) -> dict[str, Any]:
        """The resolved config of every role (for summary.json)."""
        return {
            r.name: {"stage": r.stage, "requested_stage": r.requested_stage, "trainable": r.trainable,
                     "dtype": str(r.dtype).replace("torch.", ""),
                     "compute_dtype": str(r.compute_dtype).replace("torch.", ""),
                     "lora": r.spec.lora is not None, "note": r.note, "config": r.config}
            for r in self.roles()
        }


__all__ = ["AUTO", "EngineRegistry", "JointLossError", "Role", "RoleSpec", "UnknownRoleError"]

"""Role builders: where a role lives (:class:`Placement`), how it trains (:class:`OptimSpec`) and its LoRA
(:class:`LoraSpec`), turned by :func:`trainable_role` / :func:`frozen_role` into the :class:`RoleSpec` the registry
builds from::

    actor = trainable_role("actor", lambda: AutoModelForCausalLM.from_pretrained(path), Placement(stage=3),
                           OptimSpec(lr=1e-5), micro_batch_size=4, lora=LoraSpec(rank=8))
    ref = frozen_role("ref", lambda: AutoModelForCausalLM.from_pretrained(path), Placement(offload_params=True))
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .config import ConfigError, eval_ds_config, train_ds_config
from .deepspeed_adapter import zero_init_paused
from .optim import OPTIMIZERS, build_optimizer, resolve_optimizer
from .settings import DECODER_LORA_TARGETS, DTYPES, OPTIMIZER_CHECKS

logger = logging.getLogger(__name__)

__all__ = ["LoraSpec", "OptimSpec", "Placement", "RoleSpec", "apply_lora", "frozen_role", "is_lora",
           "set_gradient_checkpointing", "torch_dtype", "trainable_role"]

def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (the names the config factories take)."""
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}; use one of {list(DTYPES)}.")
    return getattr(torch, DTYPES[name])


@dataclass(frozen=True)
class Placement:
    """Where a role lives: ZeRO stage, dtype and offload (``offload_optimizer``: trainable roles, stepped on the host
    by DeepSpeed's CPU Adam). ``gather_forward``: a frozen ZeRO-3 role gathered by one collective per forward instead
    of layer by layer (1/N between calls): worth it for small models called once per step (a VAE, a reward model)."""

    stage: int = 3
    dtype: str = "bf16"
    offload_params: bool = False
    offload_optimizer: bool = False
    gather_forward: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"stage={self.stage!r} is not a ZeRO stage; use 0, 1, 2 or 3.")
        torch_dtype(self.dtype)
        if self.offload_params and self.stage != 3:
            raise ConfigError(f"offload_params=True needs stage=3 (got stage={self.stage}): only ZeRO-3 partitions"
                              " parameters.")


_OPTIMIZERS = ("auto", *OPTIMIZERS)


def _constant(_step: int) -> float:
    return 1.0


def lr_factor(step: int, *, name: str, warmup: int, total: int) -> float:
    """The learning-rate factor of transformers' ``constant_with_warmup``, ``linear`` and ``cosine`` (one half-wave)
    schedules at optimizer step ``step``, float for float as theirs (``tests/unit/test_engines_config.py``)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if name == "constant_with_warmup":
        return 1.0
    if name == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


@dataclass(frozen=True)
class OptimSpec:
    """An optimizer and its learning-rate schedule in optimizer steps. ``name``: auto (optim.resolve_optimizer), adamw,
    ds_adam (DeepSpeed's CPU Adam / FusedAdam) or sgd; ``scheduler``: a ``transformers.get_scheduler`` name;
    ``max_grad_norm``: the gradient clipping norm, 0.0 = off."""

    name: str = "auto"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    scheduler: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in _OPTIMIZERS:
            raise ConfigError(f"optimizer name={self.name!r}; use one of {list(_OPTIMIZERS)}.")
        for key, checks in OPTIMIZER_CHECKS.items():  # the recipe keys' own checks (engines.settings)
            value = getattr(self, key)
            for problem, check in ((c.problem(value), c) for c in checks):
                if problem:
                    raise ConfigError(f"{key}={value!r} {problem}; fix: {check.fix(key, value)}.")
        if self.total_steps < 0:
            raise ConfigError(f"total_steps={self.total_steps} must be >= 0.")

    def optimizer_factory(self, offload: bool = False) -> Callable[[Iterable[torch.nn.Parameter]], Any]:
        name = resolve_optimizer(self.name, offload)

        def build(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
            try:
                return build_optimizer(name, params, lr=self.lr, betas=self.betas, eps=self.eps,
                                       weight_decay=self.weight_decay, offload=offload)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

        return build

    def scheduler_factory(self) -> Callable[[torch.optim.Optimizer], Any]:
        def build(optimizer: torch.optim.Optimizer) -> Any:
            # the common schedules built as transformers builds them, without importing transformers.optimization
            # (it imports peft: seconds in every rank)
            if self.scheduler == "constant":
                return torch.optim.lr_scheduler.LambdaLR(optimizer, _constant)
            if self.scheduler in ("constant_with_warmup", "linear", "cosine"):
                return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
                    lr_factor, name=self.scheduler, warmup=self.warmup_steps, total=max(self.total_steps, 1)))
            from transformers import get_scheduler

            # DeepSpeed steps the scheduler once per optimizer step, so both counts are optimizer steps.
            return get_scheduler(self.scheduler, optimizer, num_warmup_steps=self.warmup_steps,
                                 num_training_steps=max(self.total_steps, 1))

        return build


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters through peft: only they train (plus what a composite model keeps trainable). ``alpha`` None =
    rank; ``init``: peft's ``init_lora_weights`` (True: kaiming A, zero B; "gaussian": diffusers' scripts');
    ``task_type`` None: from the model class (CAUSAL_LM for *ForCausalLM, SEQ_CLS for *ForSequenceClassification)."""

    rank: int = 8
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DECODER_LORA_TARGETS
    init: bool | str = True
    task_type: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"LoRA rank={self.rank} must be >= 1.")
        if not self.target_modules:
            raise ConfigError("LoRA target_modules is empty: name the layers to adapt (e.g. ['q_proj', 'v_proj']).")

    def peft_config(self, task_type: str | None = None) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha if self.alpha is not None else self.rank,
                          lora_dropout=self.dropout, target_modules=list(self.target_modules),
                          init_lora_weights=self.init, task_type=task_type or self.task_type)


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class RoleSpec:
    """What a role is built from: ``model()`` (run in the role's build scope: zero.Init at stage 3), its DeepSpeed
    config (a dict or a JSON path), an optimizer factory (trainable roles only; ``trainable`` defaults to having one)
    and a scheduler factory. ``hidden_size``: the width for "auto" buckets when the model has none. ``stateful``: a
    frozen role whose weights change (an EMA), checkpointed as its partitions. ``gather_forward``: a frozen ZeRO-3
    role gathered whole once per forward (one collective; 1/N between calls). ``packed``: its token-sequence passes
    run packed (packing.py; the family must be in ``PACKABLE_FAMILIES``); ``token_budget``: tokens per micro-batch of
    the updates that size them by tokens (0 = rows); ``router_aux_coef``: an MoE policy's router auxiliary loss
    coefficient (moe.aux_term; 0 = off). ``placement``, ``lora``, ``optim``,
    ``gradient_checkpointing``: what the role builders below were asked for, for reports and exports."""

    name: str
    model: Callable[[], torch.nn.Module]
    ds_config: dict[str, Any] | str
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    trainable: bool | None = None
    hidden_size: int | None = None
    stateful: bool = False
    gather_forward: bool = False
    placement: Placement | None = None
    lora: LoraSpec | None = None
    optim: OptimSpec | None = None
    gradient_checkpointing: bool = False
    packed: bool = False
    token_budget: int = 0
    router_aux_coef: float = 0.0

    def describe(self) -> dict[str, Any]:
        """What this spec builds, as plain data: the DeepSpeed config, placement, optimizer, LoRA, checkpointing."""
        def plain(x: Any) -> Any:
            return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x

        return {"name": self.name, "ds_config": self.ds_config, "trainable": self.trainable,
                "stateful": self.stateful, "gather_forward": self.gather_forward, "placement": plain(self.placement),
                "lora": plain(self.lora), "optim": plain(self.optim),
                "gradient_checkpointing": self.gradient_checkpointing, "packed": self.packed,
                "token_budget": self.token_budget, "router_aux_coef": self.router_aux_coef}

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
            raise ConfigError(f"role '{self.name}': trainable=True but no optimizer; pass optimizer=lambda params: ..."
                              " or trainable=False for a frozen role.")
        if not self.trainable and has_optimizer:
            raise ConfigError(f"role '{self.name}': trainable=False but an optimizer was given; frozen roles get no "
                              "optimizer: drop optimizer= (and the config's 'optimizer' section) or set "
                              "trainable=True.")
        if self.lr_scheduler is not None and not self.trainable:
            raise ConfigError(f"role '{self.name}': lr_scheduler given for a frozen role; drop it.")
        if self.gather_forward and self.trainable:
            raise ConfigError(f"role '{self.name}': gather_forward is for frozen roles; a trainable one needs its"
                              " ZeRO-3 hooks for the backward pass.")


def is_lora(module: torch.nn.Module) -> bool:
    return any("lora_" in name for name, _ in module.named_parameters())


def _is_diffusers_model(model: torch.nn.Module) -> bool:
    return any(c.__module__.startswith("diffusers.") and c.__name__ == "ModelMixin" for c in type(model).__mro__)


def _task_type(model: torch.nn.Module) -> str | None:
    name = type(model).__name__
    if name.endswith("ForCausalLM"):
        return "CAUSAL_LM"
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    return None


def apply_lora(model: torch.nn.Module, lora: LoraSpec, seed: int = 0,
               dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Freeze ``model`` and add LoRA adapters; returns the model to train (peft may wrap it). Created with ZeRO-3
    paused (peft cannot init empty shards) from an RNG seeded with ``seed``, the same on every rank. A model with its
    own ``apply_lora(lora, seed)`` (a body + value head) decides what trains; diffusers models get ``add_adapter``
    (what ``load_lora_weights`` reads back), transformers models ``peft.get_peft_model``."""
    if hasattr(model, "apply_lora"):
        out = model.apply_lora(lora, seed)
    else:
        model.requires_grad_(False)
        with zero_init_paused(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if _is_diffusers_model(model):
                model.add_adapter(lora.peft_config())
                out = model
            else:
                from peft import get_peft_model

                out = get_peft_model(model, lora.peft_config(_task_type(model)))
    if dtype is not None:
        for name, p in out.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(dtype)
    return out


def set_gradient_checkpointing(module: torch.nn.Module, enabled: bool) -> bool:
    """Switch activation (gradient) checkpointing on or off for a transformers or diffusers model (also
    through a peft wrapper, or a composite with a ``body``); returns the previous state."""
    target = getattr(module, "body", module)
    was = any(getattr(m, "gradient_checkpointing", False) is True for m in target.modules())
    if enabled == was:
        return was
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*; diffusers has its own
    # names. Non-reentrant checkpointing also works when no input requires grad (LoRA on a frozen base).
    if enabled:
        if hasattr(target, "activation_checkpointing_enable"):
            target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(target, "gradient_checkpointing_enable"):
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(target, "enable_gradient_checkpointing"):
            target.enable_gradient_checkpointing()
        else:
            raise ConfigError(f"{type(target).__name__} has no gradient checkpointing switch.")
    elif hasattr(target, "activation_checkpointing_disable"):
        target.activation_checkpointing_disable()
    elif hasattr(target, "gradient_checkpointing_disable"):
        target.gradient_checkpointing_disable()
    elif hasattr(target, "disable_gradient_checkpointing"):
        target.disable_gradient_checkpointing()
    return was


def _factory(model: Callable[[], torch.nn.Module], lora: LoraSpec | None, gradient_checkpointing: bool, seed: int,
             dtype: torch.dtype) -> Callable[[], torch.nn.Module]:
    if lora is None and not gradient_checkpointing:
        return model

    def build() -> torch.nn.Module:
        module = model()
        if gradient_checkpointing:
            set_gradient_checkpointing(module, True)
        if lora is not None:
            module = apply_lora(module, lora, seed, dtype)
        return module

    return build


def trainable_role(name: str, model: Callable[[], torch.nn.Module], placement: Placement | None = None,
                   optim: OptimSpec | None = None, *, micro_batch_size: int = 1, grad_accum: int = 1,
                   lora: LoraSpec | None = None, gradient_checkpointing: bool = False, seed: int = 0,
                   hidden_size: int | None = None) -> RoleSpec:
    """A trainable role: its optimizer and schedule, placement, accumulation and clipping; LoRA (only adapters
    train) and gradient checkpointing applied after ``model()``."""
    placement, optim = placement or Placement(), optim or OptimSpec()
    if placement.gather_forward:
        raise ConfigError(f"role '{name}': gather_forward is for frozen roles; a trainable one needs its ZeRO-3"
                          " hooks for the backward pass.")
    config = train_ds_config(stage=placement.stage, dtype=placement.dtype, micro_batch_size=micro_batch_size,
                             grad_accum=grad_accum, offload_optimizer=placement.offload_optimizer,
                             offload_params=placement.offload_params, gradient_clipping=optim.max_grad_norm)
    return RoleSpec(name, _factory(model, lora, gradient_checkpointing, seed, torch_dtype(placement.dtype)), config,
                    optimizer=optim.optimizer_factory(placement.offload_optimizer),
                    lr_scheduler=optim.scheduler_factory(), hidden_size=hidden_size, placement=placement, lora=lora,
                    optim=optim, gradient_checkpointing=gradient_checkpointing)


def frozen_role(name: str, model: Callable[[], torch.nn.Module], placement: Placement | None = None, *,
                stateful: bool = False, lora: LoraSpec | None = None, seed: int = 0,
                hidden_size: int | None = None) -> RoleSpec:
    """A frozen role: no optimizer, no gradients, eval mode. ``stateful``: its weights change anyway (an EMA; saved
    in checkpoints); ``lora``: the adapter layout of a LoRA trainable role (an EMA of one)."""
    placement = placement or Placement()
    if placement.offload_optimizer:
        raise ConfigError(f"role '{name}': offload_optimizer=True, but a frozen role has no optimizer; drop it.")
    config = eval_ds_config(stage=placement.stage, dtype=placement.dtype, offload_params=placement.offload_params)
    return RoleSpec(name, _factory(model, lora, False, seed, torch_dtype(placement.dtype)), config,
                    stateful=stateful, gather_forward=placement.gather_forward and placement.stage == 3,
                    hidden_size=hidden_size, placement=placement, lora=lora)

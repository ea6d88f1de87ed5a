"""The four (five) RLHF roles on the engine registry, each its own DeepSpeed engine.

* ``actor``  - trainable causal LM (the policy), from the SFT weights;
* ``ref``    - frozen causal LM loaded from the *same SFT folder* as the actor (never a deepcopy: a
  deepcopy of a ZeRO-3 partitioned model copies empty shards and the partitioning bookkeeping);
* ``critic`` - trainable :class:`ScalarHeadModel` (value per position), from the reward model as in
  DeepSpeed-Chat, or any causal-LM folder with a fresh head;
* ``reward`` - frozen :class:`ScalarHeadModel` scoring the last real token;
* ``ema``    - optional frozen, stateful copy of the actor at the actor's stage, updated on local
  partitions by :func:`multiengine.engines.ema_update`.

Defaults follow DeepSpeed-Chat: ``ref`` at the actor's stage, ``reward`` at the critic's; any
combination is allowed (a frozen role asked for ZeRO-1/2 is built at stage 0 by the registry, which
says so in its memory report). A stage-3 role's factory runs inside the registry's build scope
(``zero.Init`` + ``HfDeepSpeedConfig``), so ``from_pretrained`` loads partitioned weights and the
value head is initialised under ``GatheredParameters(modifier_rank=0)`` (see models.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config, zero_init_paused

from .models import ScalarHeadModel

logger = logging.getLogger(__name__)

__all__ = [
    "LoraSettings",
    "OptimSettings",
    "Placement",
    "actor_spec",
    "build_rlhf_roles",
    "critic_spec",
    "disable_dropout",
    "ema_spec",
    "is_lora",
    "load_causal_lm",
    "load_scalar_model",
    "ref_spec",
    "reward_spec",
    "set_gradient_checkpointing",
    "torch_dtype",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16`` (the names train_ds_config takes)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r}; use one of {sorted(_DTYPES)}.")
    return _DTYPES[name]


@dataclass
class Placement:
    """Where a role lives: ZeRO stage, dtype and offload. ``offload_optimizer`` only for trainable roles;
    ``gather_forward`` only for frozen ZeRO-3 roles (ref, reward): all parameters gathered by one
    collective per forward call instead of layer by layer, 1/N between calls (the registry's option)."""

    stage: int = 2
    dtype: str = "bf16"
    offload_params: bool = False
    offload_optimizer: bool = False
    gather_forward: bool = False


@dataclass
class OptimSettings:
    """AdamW + an lr schedule from ``transformers.get_scheduler`` (counted in optimizer steps)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    scheduler: str = "constant"  # constant | constant_with_warmup | linear | cosine
    warmup_steps: int = 0
    total_steps: int = 1000
    max_grad_norm: float | None = 1.0


@dataclass
class LoraSettings:
    """LoRA adapters via peft; only adapters train (plus the value head of a critic)."""

    rank: int = 8
    alpha: float | None = None  # None: alpha = rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")

    def peft_config(self, task_type: str | None) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha if self.alpha is not None else self.rank,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type=task_type,
        )


# --------------------------------------------------------------------------------------------------
# model loading (runs inside the registry's per-role build scope)
# --------------------------------------------------------------------------------------------------


def _config_without_dropout(path: str) -> Any:
    """The model config with every dropout probability (and layerdrop) set to 0.

    PPO compares log-probs of the same tokens under actor, old actor and ref: dropout would make the
    ratio != 1 at step 0 and the KL noisy (checklist item 12). Done on the config because many models
    (OPT included) apply dropout functionally from config floats, not through nn.Dropout modules.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for key, value in config.to_dict().items():
        if ("dropout" in key or key == "layerdrop") and isinstance(value, float) and value != 0.0:
            setattr(config, key, 0.0)
    return config


def disable_dropout(module: torch.nn.Module) -> torch.nn.Module:
    """Set ``p = 0`` on every ``nn.Dropout`` (the config route misses modules outside the config)."""
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return module




def set_gradient_checkpointing(module: torch.nn.Module, enabled: bool) -> bool:
    """Switch HF activation (gradient) checkpointing on/off (through a peft wrapper, or the body of a
    ScalarHeadModel); returns the old state."""
    target = module.body if hasattr(module, "body") else module
    # the state, read the same way in every transformers version (no deprecated property)
    was = any(getattr(m, "gradient_checkpointing", False) is True for m in target.modules())
    if enabled == was:
        return was
    # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*; older versions
    # only have the former. peft wrappers forward both to the base model.
    if enabled:
        if hasattr(target, "activation_checkpointing_enable"):
            # non-reentrant: works with frozen inputs (LoRA) without enable_input_require_grads
            target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(target, "gradient_checkpointing_enable"):
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(target, "activation_checkpointing_disable"):
        target.activation_checkpointing_disable()
    elif hasattr(target, "gradient_checkpointing_disable"):
        target.gradient_checkpointing_disable()
    return was


def is_lora(module: torch.nn.Module) -> bool:
    return any("lora_" in name for name, _ in module.named_parameters())


def load_causal_lm(
    path: str,
    dtype: torch.dtype | None = None,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with dropout off, optional LoRA and checkpointing.

    Inside a stage-3 build scope this loads partitioned. With ``lora`` the base is frozen and only the
    adapters have ``requires_grad`` (so the registry hands only them to the optimizer).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, config=_config_without_dropout(path), dtype=dtype)
    disable_dropout(model)
    if gradient_checkpointing:
        set_gradient_checkpointing(model, True)
    if lora is not None:
        from peft import get_peft_model

        model.requires_grad_(False)
        with zero_init_paused(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, lora.peft_config("CAUSAL_LM"))
        if dtype is not None:
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(dtype)
    return model


def load_scalar_model(
    path: str,
    zero3: bool,
    dtype: torch.dtype | None = None,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
) -> ScalarHeadModel:
    """A reward model / critic: :meth:`ScalarHeadModel.from_pretrained` with dropout off.

    With ``lora`` the body is frozen, peft adapters are injected into it, and the adapters plus the
    value head train (a frozen random head could not learn values).
    """
    model = ScalarHeadModel.from_pretrained(path, zero3=zero3, dtype=dtype, head_seed=seed,
                                            config=_config_without_dropout(path))
    disable_dropout(model)
    if gradient_checkpointing:
        set_gradient_checkpointing(model, True)
    if lora is not None:
        from peft import get_peft_model

        model.body.requires_grad_(False)
        with zero_init_paused(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.body = get_peft_model(model.body, lora.peft_config(None))
        model.value_head.requires_grad_(True)
        if dtype is not None:
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.data = p.data.to(dtype)
    return model


# --------------------------------------------------------------------------------------------------
# role specs
# --------------------------------------------------------------------------------------------------


def _optimizer_factory(opt: OptimSettings, cpu_adam: bool) -> Callable[[Iterable[torch.nn.Parameter]], Any]:
    def build(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        params = list(params)
        if cpu_adam:
            # An offloaded optimizer steps on the host: DeepSpeed's vectorised CPU Adam (AdamW mode).
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                    weight_decay=opt.weight_decay, adamw_mode=True)
        return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

    return build


def _scheduler_factory(opt: OptimSettings) -> Callable[[torch.optim.Optimizer], Any]:
    def build(optimizer: torch.optim.Optimizer) -> Any:
        from transformers import get_scheduler

        return get_scheduler(opt.scheduler, optimizer, num_warmup_steps=opt.warmup_steps,
                             num_training_steps=max(opt.total_steps, 1))

    return build


def _train_config(p: Placement, micro_batch_size: int, grad_accum: int, opt: OptimSettings) -> dict[str, Any]:
    return train_ds_config(stage=p.stage, dtype=p.dtype, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                           offload_optimizer=p.offload_optimizer, offload_params=p.offload_params,
                           gradient_clipping=opt.max_grad_norm)


def actor_spec(
    path: str,
    placement: Placement,
    optim: OptimSettings,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    name: str = "actor",
) -> RoleSpec:
    """The trainable policy (also step 1's model)."""
    dtype = torch_dtype(placement.dtype)
    return RoleSpec(
        name,
        lambda: load_causal_lm(path, dtype, lora, gradient_checkpointing, seed),
        _train_config(placement, micro_batch_size, grad_accum, optim),
        optimizer=_optimizer_factory(optim, placement.offload_optimizer),
        lr_scheduler=_scheduler_factory(optim),
    )


def ref_spec(path: str, placement: Placement, name: str = "ref") -> RoleSpec:
    """The frozen reference policy: the SFT folder loaded again (a LoRA actor's base weights)."""
    dtype = torch_dtype(placement.dtype)
    return RoleSpec(name, lambda: load_causal_lm(path, dtype),
                    eval_ds_config(stage=placement.stage, dtype=placement.dtype,
                                   offload_params=placement.offload_params),
                    gather_forward=placement.gather_forward)


def ema_spec(path: str, placement: Placement, lora: LoraSettings | None = None, seed: int = 0,
             name: str = "ema") -> RoleSpec:
    """A frozen, stateful copy of the actor built like it (same stage, same LoRA wrapping), so
    ``ema_update`` can run on matching local partitions."""
    dtype = torch_dtype(placement.dtype)
    return RoleSpec(name, lambda: load_causal_lm(path, dtype, lora, False, seed),
                    eval_ds_config(stage=placement.stage, dtype=placement.dtype,
                                   offload_params=placement.offload_params),
                    stateful=True)


def critic_spec(
    path: str,
    placement: Placement,
    optim: OptimSettings,
    micro_batch_size: int = 1,
    grad_accum: int = 1,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    name: str = "critic",
) -> RoleSpec:
    """The trainable value model (LM body + value head); also step 2's model under the name ``reward``."""
    dtype = torch_dtype(placement.dtype)
    return RoleSpec(
        name,
        lambda: load_scalar_model(path, placement.stage == 3, dtype, lora, gradient_checkpointing, seed),
        _train_config(placement, micro_batch_size, grad_accum, optim),
        optimizer=_optimizer_factory(optim, placement.offload_optimizer),
        lr_scheduler=_scheduler_factory(optim),
    )


def reward_spec(path: str, placement: Placement, name: str = "reward") -> RoleSpec:
    """The frozen reward model."""
    dtype = torch_dtype(placement.dtype)
    return RoleSpec(name, lambda: load_scalar_model(path, placement.stage == 3, dtype),
                    eval_ds_config(stage=placement.stage, dtype=placement.dtype,
                                   offload_params=placement.offload_params),
                    gather_forward=placement.gather_forward)


@dataclass
class RLHFRoles:
    """What :func:`build_rlhf_roles` built (the placements actually requested per role)."""

    placements: dict[str, Placement] = field(default_factory=dict)
    lora: dict[str, LoraSettings | None] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


def build_rlhf_roles(
    registry: EngineRegistry,
    actor_path: str,
    reward_path: str,
    critic_path: str | None = None,
    *,
    actor: Placement,
    critic: Placement,
    ref: Placement | None = None,
    reward: Placement | None = None,
    ema: Placement | None = None,
    actor_optim: OptimSettings,
    critic_optim: OptimSettings,
    micro_batch_size: int = 1,
    actor_grad_accum: int = 1,
    critic_grad_accum: int = 1,
    actor_lora: LoraSettings | None = None,
    critic_lora: LoraSettings | None = None,
    actor_gradient_checkpointing: bool = False,
    critic_gradient_checkpointing: bool = False,
    seed: int = 0,
) -> RLHFRoles:
    """Add and build actor, ref, critic, reward (and ema) on ``registry``.

    ``ref=None`` follows the actor's placement (stage, dtype, parameter offload); ``reward=None``
    follows the critic's; ``critic_path=None`` initialises the critic from the reward model
    (DeepSpeed-Chat). ``ema`` (placement or None) must share the actor's stage for the local update.
    """
    ref = ref or Placement(actor.stage, actor.dtype, actor.offload_params)
    reward = reward or Placement(critic.stage, critic.dtype, critic.offload_params)
    critic_path = critic_path or reward_path
    if ema is not None and ema.stage != actor.stage:
        raise ValueError(f"ema stage {ema.stage} != actor stage {actor.stage}: the EMA updates local partitions,"
                         " so it must be sharded like the actor.")
    registry.add(actor_spec(actor_path, actor, actor_optim, micro_batch_size, actor_grad_accum, actor_lora,
                            actor_gradient_checkpointing, seed))
    registry.add(ref_spec(actor_path, ref))
    registry.add(critic_spec(critic_path, critic, critic_optim, micro_batch_size, critic_grad_accum, critic_lora,
                             critic_gradient_checkpointing, seed))
    registry.add(reward_spec(reward_path, reward))
    placements = {"actor": actor, "ref": ref, "critic": critic, "reward": reward}
    if ema is not None:
        registry.add(ema_spec(actor_path, ema, actor_lora, seed))
        placements["ema"] = ema
    registry.build()
    return RLHFRoles(placements=placements, lora={"actor": actor_lora, "critic": critic_lora},
                     paths={"actor": actor_path, "ref": actor_path, "critic": critic_path, "reward": reward_path})

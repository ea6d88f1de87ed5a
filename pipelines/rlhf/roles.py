"""The RLHF roles' models, each built on its own engine by the recipes (``cfg.roles.<name>.spec(factory)``):
causal LMs (``actor``, ``ref``: the SFT folder loaded again, never a deepcopy of a partitioned model; a teacher, a
student) and scalar-head models (``critic``, ``reward``), all loaded with dropout off; and :func:`build_rlhf_roles`,
the PPO roles at given placements."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from multiengine.engines import EngineRegistry, LoraSpec, OptimSpec, Placement, frozen_role, torch_dtype, trainable_role

from .models import ScalarHeadModel

logger = logging.getLogger(__name__)

__all__ = ["RLHFRoles", "build_rlhf_roles", "causal_lm", "disable_dropout", "load_causal_lm", "load_scalar_model",
           "scalar_model"]


def _config_without_dropout(path: str) -> Any:
    """The model config with every dropout probability (and layerdrop) 0: PPO compares log-probs of the same tokens
    under actor, old actor and ref (dropout would make the ratio != 1 at step 0), and many models (OPT) apply dropout
    functionally from config floats, not through nn.Dropout modules."""
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


def load_causal_lm(path: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with dropout off; inside a stage-3 build scope it loads
    partitioned."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, config=_config_without_dropout(path), dtype=dtype)
    return disable_dropout(model)


def load_scalar_model(path: str, zero3: bool, dtype: torch.dtype | None = None, seed: int = 0) -> ScalarHeadModel:
    """A reward model / critic: :meth:`ScalarHeadModel.from_pretrained` with dropout off."""
    model = ScalarHeadModel.from_pretrained(path, zero3=zero3, dtype=dtype, head_seed=seed,
                                            config=_config_without_dropout(path))
    return disable_dropout(model)


def causal_lm(path: str, dtype: str = "fp32") -> Callable[[], torch.nn.Module]:
    """The model factory of a causal-LM role (the policy, the ref, a teacher or student): the folder's model with
    dropout off, loaded in ``dtype`` (the role's), partitioned when built inside a stage-3 scope."""
    return lambda: load_causal_lm(path, torch_dtype(dtype))


def scalar_model(path: str, dtype: str = "fp32", zero3: bool = False, seed: int = 0) -> Callable[[], torch.nn.Module]:
    """The model factory of a scalar-head role (a reward model, a critic): LM body + value head, dropout off."""
    return lambda: load_scalar_model(path, zero3, torch_dtype(dtype), seed)


@dataclass
class RLHFRoles:
    """What :func:`build_rlhf_roles` built (the placements actually requested per role)."""

    placements: dict[str, Placement] = field(default_factory=dict)
    lora: dict[str, LoraSpec | None] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


def build_rlhf_roles(
    registry: EngineRegistry,
    actor_path: str,
    reward_path: str | None,
    critic_path: str,
    *,
    actor: Placement,
    critic: Placement,
    ref: Placement,
    reward: Placement | None = None,
    ema: Placement | None = None,
    actor_optim: OptimSpec,
    critic_optim: OptimSpec,
    micro_batch_size: int = 1,
    critic_micro_batch_size: int | None = None,
    actor_grad_accum: int = 1,
    critic_grad_accum: int = 1,
    actor_lora: LoraSpec | None = None,
    critic_lora: LoraSpec | None = None,
    actor_gradient_checkpointing: bool = False,
    critic_gradient_checkpointing: bool = False,
    seed: int = 0,
    extra_rewards: Sequence[tuple[str, str, Placement]] = (),
) -> RLHFRoles:
    """Add and build actor, ref, critic, reward (and ema) on ``registry``, each at the placement given (the
    recipe resolves which role follows which).

    ``reward_path=None`` builds no ``reward`` role (rewards from functions only); ``reward`` is then unused.
    ``critic_micro_batch_size``: the critic's rows per forward/backward (``None`` = ``micro_batch_size``).
    ``ema`` (placement or None) must share the actor's stage for the local update. ``extra_rewards`` adds more
    frozen reward models as ``(role, path, placement)``.
    """
    if reward_path is not None and reward is None:
        raise ValueError("reward_path given without a reward placement.")
    if ema is not None and ema.stage != actor.stage:
        raise ValueError(f"ema stage {ema.stage} != actor stage {actor.stage}: the EMA updates local partitions,"
                         " so it must be sharded like the actor.")
    registry.add(trainable_role("actor", causal_lm(actor_path, actor.dtype), actor, actor_optim,
                                micro_batch_size=micro_batch_size, grad_accum=actor_grad_accum, lora=actor_lora,
                                gradient_checkpointing=actor_gradient_checkpointing, seed=seed))
    registry.add(frozen_role("ref", causal_lm(actor_path, ref.dtype), ref))
    registry.add(trainable_role("critic", scalar_model(critic_path, critic.dtype, critic.stage == 3, seed), critic,
                                critic_optim, micro_batch_size=critic_micro_batch_size or micro_batch_size,
                                grad_accum=critic_grad_accum, lora=critic_lora,
                                gradient_checkpointing=critic_gradient_checkpointing, seed=seed))
    placements = {"actor": actor, "ref": ref, "critic": critic}
    paths = {"actor": actor_path, "ref": actor_path, "critic": critic_path}
    if reward_path is not None:
        registry.add(frozen_role("reward", scalar_model(reward_path, reward.dtype, reward.stage == 3), reward))
        placements["reward"], paths["reward"] = reward, reward_path
    if ema is not None:
        registry.add(frozen_role("ema", causal_lm(actor_path, ema.dtype), ema, stateful=True, lora=actor_lora,
                                 seed=seed))
        placements["ema"] = ema
    for name, path, place in extra_rewards:
        registry.add(frozen_role(name, scalar_model(path, place.dtype, place.stage == 3), place))
        placements[name], paths[name] = place, path
    registry.build()
    return RLHFRoles(placements=placements, lora={"actor": actor_lora, "critic": critic_lora}, paths=paths)

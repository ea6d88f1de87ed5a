"""The RLHF roles on the engine registry, each its own DeepSpeed engine.

* ``actor``  - trainable causal LM (the policy), from the SFT weights;
* ``ref``    - frozen causal LM loaded from the *same SFT folder* as the actor (never a deepcopy: a
  deepcopy of a ZeRO-3 partitioned model copies empty shards and the partitioning bookkeeping);
* ``critic`` - trainable :class:`ScalarHeadModel` (value per position), from the reward model as in
  DeepSpeed-Chat, or any causal-LM folder with a fresh head;
* ``reward`` - frozen :class:`ScalarHeadModel` scoring the last real token;
* ``ema``    - optional frozen, stateful copy of the actor at the actor's stage, updated on local
  partitions by :func:`multiengine.engines.ema_update`.

Placement, optimizer and LoRA use the engines' one vocabulary (:class:`Placement`, :class:`OptimSpec`,
:class:`LoraSpec`, :func:`trainable_role`, :func:`frozen_role`); this module adds only what is RLHF's:
loading with dropout off and the scalar-head models. Which role follows which placement (DeepSpeed-Chat:
``ref`` the actor's, ``reward`` the critic's) is the recipe's declaration; these functions take it resolved.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from multiengine.engines import (
    EngineRegistry,
    LoraSpec,
    OptimSpec,
    Placement,
    RoleSpec,
    frozen_role,
    torch_dtype,
    trainable_role,
)

from .models import ScalarHeadModel

logger = logging.getLogger(__name__)

__all__ = [
    "RLHFRoles",
    "actor_spec",
    "build_rlhf_roles",
    "critic_spec",
    "disable_dropout",
    "ema_spec",
    "load_causal_lm",
    "load_scalar_model",
    "ref_spec",
    "reward_spec",
]


def _config_without_dropout(path: str) -> Any:
    """The model config with every dropout probability (and layerdrop) set to 0.

    PPO compares log-probs of the same tokens under actor, old actor and ref: dropout would make the
    ratio != 1 at step 0 and the KL noisy. Done on the config because many models (OPT included)
    apply dropout functionally from config floats, not through nn.Dropout modules.
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


def actor_spec(path: str, placement: Placement, optim: OptimSpec, micro_batch_size: int = 1, grad_accum: int = 1,
               lora: LoraSpec | None = None, gradient_checkpointing: bool = False, seed: int = 0,
               name: str = "actor") -> RoleSpec:
    """The trainable policy (also step 1's model)."""
    dtype = torch_dtype(placement.dtype)
    return trainable_role(name, lambda: load_causal_lm(path, dtype), placement, optim,
                          micro_batch_size=micro_batch_size, grad_accum=grad_accum, lora=lora,
                          gradient_checkpointing=gradient_checkpointing, seed=seed)


def ref_spec(path: str, placement: Placement, name: str = "ref") -> RoleSpec:
    """The frozen reference policy: the SFT folder loaded again (a LoRA actor's base weights)."""
    dtype = torch_dtype(placement.dtype)
    return frozen_role(name, lambda: load_causal_lm(path, dtype), placement)


def ema_spec(path: str, placement: Placement, lora: LoraSpec | None = None, seed: int = 0,
             name: str = "ema") -> RoleSpec:
    """A frozen, stateful copy of the actor built like it (same stage, same LoRA wrapping), so
    ``ema_update`` can run on matching local partitions."""
    dtype = torch_dtype(placement.dtype)
    return frozen_role(name, lambda: load_causal_lm(path, dtype), placement, stateful=True, lora=lora, seed=seed)


def critic_spec(path: str, placement: Placement, optim: OptimSpec, micro_batch_size: int = 1, grad_accum: int = 1,
                lora: LoraSpec | None = None, gradient_checkpointing: bool = False, seed: int = 0,
                name: str = "critic") -> RoleSpec:
    """The trainable value model (LM body + value head); also step 2's model under the name ``reward``."""
    dtype = torch_dtype(placement.dtype)
    return trainable_role(name, lambda: load_scalar_model(path, placement.stage == 3, dtype, seed), placement, optim,
                          micro_batch_size=micro_batch_size, grad_accum=grad_accum, lora=lora,
                          gradient_checkpointing=gradient_checkpointing, seed=seed)


def reward_spec(path: str, placement: Placement, name: str = "reward") -> RoleSpec:
    """The frozen reward model."""
    dtype = torch_dtype(placement.dtype)
    return frozen_role(name, lambda: load_scalar_model(path, placement.stage == 3, dtype), placement)


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
    registry.add(actor_spec(actor_path, actor, actor_optim, micro_batch_size, actor_grad_accum, actor_lora,
                            actor_gradient_checkpointing, seed))
    registry.add(ref_spec(actor_path, ref))
    registry.add(critic_spec(critic_path, critic, critic_optim, critic_micro_batch_size or micro_batch_size,
                             critic_grad_accum, critic_lora,
                             critic_gradient_checkpointing, seed))
    placements = {"actor": actor, "ref": ref, "critic": critic}
    paths = {"actor": actor_path, "ref": actor_path, "critic": critic_path}
    if reward_path is not None:
        registry.add(reward_spec(reward_path, reward))
        placements["reward"], paths["reward"] = reward, reward_path
    if ema is not None:
        registry.add(ema_spec(actor_path, ema, actor_lora, seed))
        placements["ema"] = ema
    for name, path, place in extra_rewards:
        registry.add(reward_spec(path, place, name=name))
        placements[name], paths[name] = place, path
    registry.build()
    return RLHFRoles(placements=placements, lora={"actor": actor_lora, "critic": critic_lora}, paths=paths)

"""The RLHF roles' models, each built on its own engine by the recipes (``cfg.roles.<name>.spec(factory)``):
causal LMs (``actor``, ``ref``: the SFT folder loaded again, never a deepcopy of a partitioned model; a teacher, a
student) and scalar-head models (``critic``, ``reward``), all loaded with dropout off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from multiengine.engines import torch_dtype

from .models import ScalarHeadModel

__all__ = ["causal_lm", "disable_dropout", "load_causal_lm", "load_scalar_model", "scalar_model"]


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

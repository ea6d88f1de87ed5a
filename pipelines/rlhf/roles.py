"""The RLHF roles' models, each built on its own engine by the recipes (``cfg.roles.<name>.spec(factory)``):
causal LMs (``actor``, ``ref``: the SFT folder loaded again, never a deepcopy of a partitioned model; a teacher, a
student) and scalar-head models (``critic``, ``reward``), all loaded with dropout off; and what the recipes call to
set them up: their folders and tokenizers (the tiny assets where left empty), adding them to the registry, export."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from multiengine.engines import EngineRegistry, frozen_role, save_role, torch_dtype

from .models import ScalarHeadModel

__all__ = ["add_lm_role", "add_reward_roles", "add_rollout", "causal_lm", "disable_dropout", "export_role",
           "load_causal_lm", "load_scalar_model", "role_folder", "router_aux_coef", "scalar_model", "tiny_assets"]


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


def attention(dtype: torch.dtype | None) -> dict[str, str]:
    """On a GPU with flash-attention installed and a 16-bit dtype, its kernels (packed passes take its
    variable-length path from the restarted position ids); else transformers' default (sdpa)."""
    import importlib.util

    fast = torch.cuda.is_available() and dtype in (torch.bfloat16, torch.float16)
    return {"attn_implementation": "flash_attention_2"} if fast and importlib.util.find_spec("flash_attn") else {}


def load_causal_lm(path: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with dropout off (flash-attention where :func:`attention` finds it);
    inside a stage-3 build scope it loads partitioned."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, config=_config_without_dropout(path), dtype=dtype,
                                                 **attention(dtype))
    return disable_dropout(model)


def load_scalar_model(path: str, zero3: bool, dtype: torch.dtype | None = None, seed: int = 0) -> ScalarHeadModel:
    """A reward model / critic: :meth:`ScalarHeadModel.from_pretrained` with dropout off."""
    model = ScalarHeadModel.from_pretrained(path, zero3=zero3, dtype=dtype, head_seed=seed,
                                            config=_config_without_dropout(path), **attention(dtype))
    return disable_dropout(model)


def causal_lm(path: str, dtype: str = "fp32") -> Callable[[], torch.nn.Module]:
    """The model factory of a causal-LM role (the policy, the ref, a teacher or student): the folder's model with
    dropout off, loaded in ``dtype`` (the role's), partitioned when built inside a stage-3 scope."""
    return lambda: load_causal_lm(path, torch_dtype(dtype))


def scalar_model(path: str, dtype: str = "fp32", zero3: bool = False, seed: int = 0) -> Callable[[], torch.nn.Module]:
    """The model factory of a scalar-head role (a reward model, a critic): LM body + value head, dropout off."""
    return lambda: load_scalar_model(path, zero3, torch_dtype(dtype), seed)


def tiny_assets(registry: EngineRegistry, root: str, cfg: Any, *models: str) -> dict[str, str]:
    """The embedded default (built-in data, tokenizer, random tiny OPT of ``cfg.tiny``) under ``root`` when
    ``cfg.data`` is the built-in data or one of ``models`` (model folders) is left empty, else ``{}``."""
    from .runs import prepare_tiny_assets

    if not (cfg.data.builtin or not all(models)):
        return {}
    return prepare_tiny_assets(root, registry, cfg.seed, cfg.tiny)


def role_folder(role: Any, assets: dict[str, str], path: str = "") -> tuple[str, Any]:
    """``role``'s folder (``path``: what the recipe resolved or trained for it; else ``role.model``; else the tiny
    model) and its tokenizer (``role.tokenizer``, else the folder's, else the tiny tokenizer)."""
    from ..checks import role_tokenizer

    path = path or role.model or assets["model"]
    tiny_tok = role_tokenizer("", assets["tokenizer"]) if assets else None
    return path, role_tokenizer(role.tokenizer_path(), path, tiny_tok, what=f"roles.{role.name}.model")


def packs(packing: str, path: str, key: str) -> bool:
    """Whether a role with ``packing`` (auto | packed | padded, the key ``key``) runs packed on the model at ``path``:
    auto packs the families that pack (engines.packing); packed on another family is refused, naming it."""
    if packing == "padded":
        return False
    from multiengine.engines.packing import PACKABLE_FAMILIES, family_packs
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if packing == "packed" and not family_packs(config):
        raise ValueError(f"{key}=packed: the {config.model_type} model {path} cannot pack (these families pack: "
                         f"{', '.join(sorted(PACKABLE_FAMILIES))}); set {key}=auto or padded")
    return family_packs(config)


def add_lm_role(registry: EngineRegistry, role: Any, path: str, seed: int, scalar: bool = False, **spec: Any) -> None:
    """Add ``role`` (a ``roles.<name>`` section) on ``path``: a causal LM, or with ``scalar`` an LM body + value head,
    packed as ``role.packing`` says; ``spec``: its ``.spec`` arguments (``total_steps``, ``rows``, ...)."""
    dtype = role.effective_dtype
    model = scalar_model(path, dtype, role.effective_stage == 3, seed if role.trainable else 0) if scalar \
        else causal_lm(path, dtype)
    built = role.spec(model, seed=seed, **spec)
    built.packed = packs(role.packing, path, f"roles.{role.name}.packing")
    built.router_aux_coef = router_aux_coef(role, path)
    registry.add(built)


def router_aux_coef(role: Any, path: str) -> float:
    """The router auxiliary-loss coefficient of a policy role on the model at ``path``: its
    ``router_aux_loss_coef``, or for -1 the model config's (0 for a dense model or a role without the key)."""
    routed = getattr(getattr(role, "_decl", None), "routed", False)  # a policy (recipes/language/roles.Role)
    coef = getattr(role, "router_aux_loss_coef", 0.0) if routed else 0.0
    if coef != -1.0:
        return float(coef)
    from multiengine.engines.moe import moe_shape
    from transformers import AutoConfig

    shape = moe_shape(AutoConfig.from_pretrained(path))
    return shape.aux_coef if shape is not None else 0.0


def add_reward_roles(registry: EngineRegistry, models: list[Any], packing: str = "auto") -> None:
    """Add the reward-model roles ``models`` (``RewardSettings.sources``'), each at its own placement, packed as
    ``packing`` (``roles.reward.packing``) says."""
    for m in models:
        p = m.placement
        spec = frozen_role(m.role, scalar_model(m.path, p.dtype, p.stage == 3), p)
        spec.packed = packs(packing, m.path, "roles.reward.packing")
        registry.add(spec)


def add_rollout(registry: EngineRegistry, cfg: Any, path: str, seq_len: int, role: str = "actor") -> None:
    """With generation.engine=vllm: roles.rollout's vLLM engine on every rank, started from ``path`` (``role``'s
    initial folder) and synced from ``role`` before each rollout that follows an optimizer step."""
    if cfg.generation.engine != "vllm" or cfg.roles.rollout.ranks:  # rollout ranks build their own
        return
    from multiengine.engines.vllm_rollout import VLLMRollout

    settings = cfg.roles.rollout.engine_settings(seq_len, cfg.seed)
    registry.add_rollout(role, VLLMRollout(path, settings, registry.device.type))


def export_role(registry: EngineRegistry, export: Any, root: str, tokenizer: Any, role: str = "actor") -> dict:
    """``{role: ...}``: ``role`` saved to ``root/<role>`` with ``tokenizer`` when ``export.enabled``, else ``{}``."""
    return {role: save_role(registry, role, os.path.join(root, role), tokenizer=tokenizer)} if export.enabled else {}

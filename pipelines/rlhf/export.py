"""Exports of RLHF roles as Hugging Face folders.

* a causal LM (actor, ema) -> ``save_pretrained`` folder + tokenizer: loads with
  ``AutoModelForCausalLM.from_pretrained`` and generates. A LoRA actor writes the merged weights there
  and the adapter in peft format under ``<folder>/adapter`` (``PeftModel.from_pretrained(base, ...)``).
* a scalar-head model (reward, critic) -> :meth:`ScalarHeadModel.save_pretrained` folder + tokenizer,
  which loads as a reward model or as a critic in step 3.

Every rank must call these (ZeRO-3 weights are gathered collectively); rank 0 writes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.dist import barrier

from .models import VALUE_HEAD_FILE, ScalarHeadModel
from .roles import LoraSettings, is_lora, load_causal_lm, load_scalar_model

logger = logging.getLogger(__name__)

__all__ = ["export_causal_lm", "export_scalar_model", "gathered_state_dict"]


def gathered_state_dict(registry: EngineRegistry, role: str) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of a role's weights on rank 0 (None elsewhere); collective under ZeRO-3."""
    state = None
    with registry.gathered(role):
        if registry.is_main:
            state = {k: v.detach().to("cpu").clone() for k, v in registry.role(role).module.state_dict().items()}
    return state


def _save_tokenizer(tokenizer: Any, out: str) -> None:
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def export_causal_lm(
    registry: EngineRegistry,
    role: str,
    out_dir: str,
    tokenizer: Any = None,
    source_path: str | None = None,
    lora: LoraSettings | None = None,
) -> dict[str, str]:
    """Write ``role`` to ``out_dir`` (merged weights for LoRA, plus ``out_dir/adapter``).

    Args:
        source_path: the folder the role was loaded from (needed for LoRA: the base of the merge).
        lora: the role's LoRA settings (None for a full model).

    Returns:
        ``{"model": out_dir}`` and, for LoRA, ``"adapter"``.
    """
    module = registry.role(role).module
    written = {"model": out_dir}
    if not is_lora(module):
        # as registry.export, into the caller's folder: full weights gathered on all ranks, rank 0 writes
        with registry.gathered(role):
            if registry.is_main:
                os.makedirs(out_dir, exist_ok=True)
                module.save_pretrained(out_dir)
        barrier()
    else:
        if source_path is None or lora is None:
            raise ValueError(f"role '{role}' has LoRA adapters: pass source_path and lora to merge them.")
        state = gathered_state_dict(registry, role)
        if registry.is_main:
            # A host twin (base + the same adapters) takes the trained weights; merging it leaves the
            # live, partitioned engine untouched.
            dtype = registry.role(role).dtype
            twin = load_causal_lm(source_path, dtype=dtype, lora=lora)
            missing, unexpected = twin.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if "lora_" in k]:
                raise RuntimeError(f"LoRA export of '{role}': unexpected {unexpected[:5]}, missing {missing[:5]}")
            adapter_dir = os.path.join(out_dir, "adapter")
            twin.save_pretrained(adapter_dir)
            merged = twin.merge_and_unload()
            merged.save_pretrained(out_dir)
            logger.info("exported LoRA role '%s': adapter %s, merged weights %s", role, adapter_dir, out_dir)
        barrier()
        written["adapter"] = os.path.join(out_dir, "adapter")
    if registry.is_main:
        _save_tokenizer(tokenizer, out_dir)
    barrier()
    return written


def _write_scalar(model: ScalarHeadModel, out_dir: str) -> None:
    """Rank-local write of an unpartitioned scalar-head model (no collective)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    model.body.save_pretrained(out_dir)
    save_file({"weight": model.value_head.weight.detach().cpu().contiguous().clone()},
              os.path.join(out_dir, VALUE_HEAD_FILE))


def export_scalar_model(
    registry: EngineRegistry,
    role: str,
    out_dir: str,
    tokenizer: Any = None,
    source_path: str | None = None,
    lora: LoraSettings | None = None,
) -> dict[str, str]:
    """Write a reward model / critic as a :class:`ScalarHeadModel` folder (LoRA merged into the body)."""
    module = registry.role(role).module
    if not is_lora(module):
        module.save_pretrained(out_dir)  # collective: gathers under ZeRO-3, rank 0 writes
    else:
        if source_path is None or lora is None:
            raise ValueError(f"role '{role}' has LoRA adapters: pass source_path and lora to merge them.")
        state = gathered_state_dict(registry, role)
        if registry.is_main:
            twin = load_scalar_model(source_path, zero3=False, dtype=registry.role(role).dtype, lora=lora)
            twin.load_state_dict(state)
            twin.body = twin.body.merge_and_unload()
            _write_scalar(twin, out_dir)
        barrier()
    if registry.is_main:
        _save_tokenizer(tokenizer, out_dir)
    barrier()
    return {"model": out_dir}

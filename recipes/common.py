"""Config sections -> the engines' role vocabulary, for the recipes (only recipes read the config tree).

A role section has the placement keys ``stage, dtype, offload_params, offload_optimizer, gather_forward``
and, for a trainable role, the optimizer keys ``lr, weight_decay, scheduler, warmup_steps, max_grad_norm``
(any may be missing: the defaults of Placement / OptimSpec apply). A LoRA section has ``enabled, rank,
alpha, dropout, target_modules``.
"""

from __future__ import annotations

from typing import Any

from multiengine.engines import LoraSpec, OptimSpec, Placement

__all__ = ["RLHF_BETAS", "lora_spec", "optim_spec", "placement"]

# Adam betas of DeepSpeed-Chat and OpenRLHF for every RLHF role (beta2 = 0.95 tolerates the noisier
# gradients of RL better than the 0.999 default).
RLHF_BETAS = (0.9, 0.95)


def placement(section: Any, follow: Placement | None = None, trainable: bool = True) -> Placement:
    """The Placement of a role section; ``stage: -1`` and ``dtype: ""`` take ``follow``'s (a ref that
    follows the actor). ``offload_optimizer`` is read for trainable roles only."""
    get = section.get
    stage = get("stage", 3)
    if stage is not None and stage < 0:
        stage = follow.stage
    dtype = get("dtype", "bf16") or (follow.dtype if follow is not None else "bf16")
    offload_params = get("offload_params", False)
    return Placement(stage=stage, dtype=dtype, offload_params=bool(offload_params),
                     offload_optimizer=bool(get("offload_optimizer", False)) if trainable else False,
                     gather_forward=bool(get("gather_forward", False)) if not trainable else False)


def optim_spec(section: Any, total_steps: int, **overrides: Any) -> OptimSpec:
    """The OptimSpec of a trainable role's section (``max_grad_norm: 0`` = no clipping)."""
    get = section.get
    values = {
        "lr": float(get("lr", 1e-5)),
        "weight_decay": float(get("weight_decay", 0.0)),
        "scheduler": get("scheduler", "constant"),
        "warmup_steps": int(get("warmup_steps", 0)),
        "total_steps": int(total_steps),
        "max_grad_norm": get("max_grad_norm", 1.0) or None,
    }
    values.update(overrides)
    return OptimSpec(**values)


def lora_spec(section: Any, **overrides: Any) -> LoraSpec | None:
    """The LoraSpec of a LoRA section, or None when it is not enabled (``alpha: 0`` = alpha = rank)."""
    if not section.enabled:
        return None
    values = {"rank": int(section.rank), "alpha": section.get("alpha") or None,
              "dropout": float(section.get("dropout", 0.0)), "target_modules": tuple(section.target_modules)}
    values.update(overrides)
    return LoraSpec(**values)

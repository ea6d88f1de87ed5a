"""Config sections -> the engines' role vocabulary, for the recipes (only recipes read the config tree).

A role section has the placement keys ``stage, dtype, offload_params, offload_optimizer, gather_forward``
and, for a trainable role, the optimizer keys ``lr, weight_decay, scheduler, warmup_steps, max_grad_norm``
(any may be missing: the defaults of Placement / OptimSpec apply). A LoRA section has ``enabled, rank,
alpha, dropout, target_modules``.
"""

from __future__ import annotations

from typing import Any

from multiengine.engines import LoraSpec, OptimSpec, Placement, ShardedBatches, shard_batches

__all__ = ["RLHF_BETAS", "demonstrations", "evaluation_prompts", "lora_spec", "optim_spec", "placement",
           "tiny_assets"]

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


# --- the RLHF recipes' shared data setup (the built-in task by default) ---------------------------------
def tiny_assets(recipe: Any, needed: bool) -> dict[str, str]:
    """The embedded default (built-in dataset, tokenizer, random tiny OPT) under ``output_dir/tiny`` when
    ``needed`` (a model folder or the data source was left empty), else ``{}``."""
    from multiengine.pipelines.rlhf.runs import prepare_tiny_assets

    if not needed:
        return {}
    model = recipe.cfg.get("model") or {}
    return prepare_tiny_assets(recipe.path("tiny"), recipe.registry, recipe.cfg.seed,
                               model.get("tiny_hidden", 64), model.get("tiny_layers", 2))


def demonstrations(recipe: Any, source: str, tokenizer: Any, batch_size: int) -> tuple[ShardedBatches, list[Any]]:
    """Prompt + response rows (``sft`` split) as a checkpointed training stream (``add_state("batches")``)
    and a held-out tail of ``data.heldout_size`` rows (at most a tenth) that is never trained on."""
    from multiengine.pipelines.rlhf.data import SFTCollator
    from multiengine.pipelines.rlhf.runs import load_split

    cfg, registry = recipe.cfg, recipe.registry
    rows = load_split(source, "sft", registry, cfg.data.train_split)
    n_heldout = min(cfg.data.heldout_size, len(rows) // 10)
    collate = SFTCollator(tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
    batches = registry.add_state("batches", ShardedBatches(
        rows.select(range(len(rows) - n_heldout)), collate, batch_size, registry.world_size, registry.rank,
        seed=cfg.seed))
    heldout = shard_batches(rows.select(range(len(rows) - n_heldout, len(rows))), collate, batch_size,
                            registry.world_size, registry.rank)
    return batches, heldout


def evaluation_prompts(recipe: Any, source: str, tokenizer: Any) -> list[dict[str, Any]]:
    """``eval.size`` evaluation prompts (``eval`` split) in batches of ``eval.batch_size``, equal shares per
    rank; ``[]`` when ``eval.size`` is 0."""
    from multiengine.pipelines.rlhf.data import PromptCollator
    from multiengine.pipelines.rlhf.runs import load_split

    cfg, registry = recipe.cfg, recipe.registry
    if not cfg.eval.size:
        return []
    rows = load_split(source, "eval", registry, cfg.data.eval_split)
    return shard_batches(rows, PromptCollator(tokenizer, cfg.data.max_prompt_len), cfg.eval.batch_size,
                         registry.world_size, registry.rank, limit=cfg.eval.size)

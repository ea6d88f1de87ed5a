"""Config sections -> the engines' role vocabulary, for the recipes (only recipes read the config tree).

A role section has the placement keys ``stage, dtype, offload_params, offload_optimizer, gather_forward``
and, for a trainable role, the optimizer keys ``lr, weight_decay, scheduler, warmup_steps, max_grad_norm``
(any may be missing: the defaults of Placement / OptimSpec apply). A LoRA section has ``enabled, rank,
alpha, dropout, target_modules``.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multiengine.engines import LoraSpec, OptimSpec, Placement, ShardedBatches, shard_batches

logger = logging.getLogger(__name__)

__all__ = ["REWARD_DEFAULTS", "RLHF_BETAS", "RewardModelRole", "check_model_path", "demonstrations",
           "evaluation_prompts", "lora_spec", "optim_spec", "placement", "reward_config", "reward_entries",
           "sft_model", "tiny_assets"]

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


def check_model_path(key: str, given: str, recipe: str) -> str:
    """``given`` unless it names a local folder that does not exist ("org/name" or "name" is a hub model)."""
    from multiengine.recipes.config import RecipeConfigError

    if given and not os.path.exists(given) and (given.startswith(("/", ".", "~")) or given.count("/") >= 2):
        raise RecipeConfigError(f"{key}={given!r} does not exist; run `multiengine run {recipe} --config tiny "
                                f"--nproc-per-node 2` first, or use rlhf_e2e.")
    return given


def sft_model(recipe: Any, section: Any, out_dir: str, data_source: str, base_model: str) -> str:
    """Train a model with the rlhf_sft recipe under ``out_dir`` (once: a finished run is reused) and return
    its export. ``section`` has ``config`` (a shipped rlhf_sft config) and ``overrides``. Recipes compose in
    one process: the SFT run builds its own registry on the same ranks."""
    from multiengine.recipes.config import checked_config, load_recipe

    cfg = recipe.cfg
    export = os.path.join(out_dir, "export", "actor")
    if os.path.isfile(os.path.join(out_dir, "summary.json")) and os.path.isdir(export):
        logger.info("%s: reusing the SFT model trained in %s", recipe.name, out_dir)
        return export
    overrides = [f"output_dir={out_dir}", f"seed={cfg.seed}", f"backend={cfg.backend}", f"data.source={data_source}",
                 f"model.pretrained={base_model}", *section.overrides]
    sft_cfg = checked_config("rlhf_sft", section.config or None, overrides)
    logger.info("%s: training the SFT model with rlhf_sft (config %s) in %s", recipe.name, section.config, out_dir)
    load_recipe("rlhf_sft").main(sft_cfg)
    return export


# --- reward sources named in a config (rlhf_ppo, rlhf_grpo) -----------------------------------------------
# ``reward.models``: reward-model roles, each ``{role, path, weight}`` plus optional placement keys
# (``stage, dtype, offload_params, gather_forward``) over ``roles.reward``'s; ``role`` is ``reward`` or
# ``reward_<name>``, and only ``reward`` may leave ``path`` empty (then ``model.reward``).
# ``reward.functions``: ``fn(prompts, responses) -> list[float]`` as ``"pkg.mod:fn"``, ``"/path/file.py:fn"``
# or ``"builtin:judge"`` (weight 1), or ``{fn: <spec>, weight: w}``. The score is the weighted sum.
REWARD_DEFAULTS: dict[str, Any] = {
    "models": [],  # [] and no functions = the `reward` role from model.reward, weight 1
    "functions": [],
    "normalize": False,  # running mean/std of the combined score over all ranks, before clipping
}
_MODEL_KEYS = ("role", "path", "weight", "stage", "dtype", "offload_params", "gather_forward")
_FUNCTION_KEYS = ("fn", "weight")


@dataclass(frozen=True)
class RewardModelRole:
    """A frozen reward-model role to build: its name, folder, weight in the sum and placement."""

    role: str
    path: str
    weight: float
    placement: Placement


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _weight(key: str, value: Any) -> float:
    from multiengine.recipes.config import RecipeConfigError

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecipeConfigError(f"{key}={value!r}: a reward weight is a finite number (e.g. 1.0).")
    return float(value)


def _check_keys(key: str, entry: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    from multiengine.recipes.config import RecipeConfigError

    for name in entry:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(valid)}."
            raise RecipeConfigError(f"unknown key '{key}.{name}' (value {entry[name]!r}).{hint}")


def reward_entries(section: Any, key: str = "reward") -> tuple[list[dict[str, Any]], list[tuple[str, float]]]:
    """The checked entries of a reward section, without building or importing anything heavy:
    ``([{role, path, weight, <placement keys>}], [(function spec, weight)])``. Every reward function is
    resolved once here, so a typo in a spec fails before any rank starts.

    Raises:
        RecipeConfigError: naming the key, the value and the fix.
    """
    from multiengine.pipelines.rlhf.rewards import load_reward_function
    from multiengine.recipes.config import RecipeConfigError

    models, functions = _plain(section.get("models")) or [], _plain(section.get("functions")) or []
    if not isinstance(models, list):
        raise RecipeConfigError(f"{key}.models={models!r}: expected a list, e.g. [{{role: reward, weight: 1.0}}].")
    if not isinstance(functions, list):
        raise RecipeConfigError(f"{key}.functions={functions!r}: expected a list, e.g. [builtin:judge].")
    roles: list[dict[str, Any]] = []
    for i, entry in enumerate(models):
        where = f"{key}.models[{i}]"
        if isinstance(entry, str):
            entry = {"role": entry}
        if not isinstance(entry, dict):
            raise RecipeConfigError(f"{where}={entry!r}: expected a mapping such as {{role: reward, weight: 1.0}}.")
        _check_keys(where, entry, _MODEL_KEYS)
        role = entry.get("role", "reward")
        if not isinstance(role, str) or not (role == "reward" or (role.startswith("reward_") and len(role) > 7)):
            raise RecipeConfigError(f"{where}.role={role!r}: a reward-model role is named 'reward' or "
                                    "'reward_<name>' (e.g. reward_safety).")
        if any(r["role"] == role for r in roles):
            raise RecipeConfigError(f"{where}.role={role!r} appears twice in {key}.models; give each a new name.")
        path = entry.get("path", "") or ""
        if not isinstance(path, str):
            raise RecipeConfigError(f"{where}.path={path!r}: expected a model folder or hub name.")
        if not path and role != "reward":
            raise RecipeConfigError(f"{where}.path is empty: only the 'reward' role defaults to model.reward; "
                                    f"give {role!r} its own folder.")
        roles.append({**entry, "role": role, "path": path, "weight": _weight(f"{where}.weight",
                                                                            entry.get("weight", 1.0))})
    specs: list[tuple[str, float]] = []
    for i, entry in enumerate(functions):
        where = f"{key}.functions[{i}]"
        if isinstance(entry, str):
            entry = {"fn": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("fn"), str):
            raise RecipeConfigError(f"{where}={entry!r}: expected 'pkg.module:function', '/path/file.py:function', "
                                    "'builtin:judge' or {fn: <one of those>, weight: 1.0}.")
        _check_keys(where, entry, _FUNCTION_KEYS)
        try:
            load_reward_function(entry["fn"])
        except ValueError as exc:
            raise RecipeConfigError(f"{where}: {exc}") from None
        if any(s == entry["fn"] for s, _ in specs):
            raise RecipeConfigError(f"{where}={entry['fn']!r} appears twice in {key}.functions; merge the weights.")
        specs.append((entry["fn"], _weight(f"{where}.weight", entry.get("weight", 1.0))))
    return roles, specs


def reward_config(section: Any, default_path: str | None, base: Placement,
                  key: str = "reward") -> tuple[list[RewardModelRole], list[Any]]:
    """The reward-model roles to build and every reward source (``rewards.RewardSource``) of a reward
    section. With neither models nor functions the reward is the ``reward`` role at ``default_path``
    (``model.reward``); ``default_path=None`` then is an error. ``base`` is ``roles.reward``'s placement,
    which each entry's own placement keys override."""
    from multiengine.pipelines.rlhf.rewards import reward_function, reward_model
    from multiengine.recipes.config import RecipeConfigError

    entries, specs = reward_entries(section, key)
    if not entries and not specs:
        if not default_path:
            raise RecipeConfigError(f"no reward source: set model.reward (a reward-model folder), {key}.models or "
                                    f"{key}.functions (e.g. {key}.functions=[builtin:judge] on the built-in task).")
        entries = [{"role": "reward", "path": default_path, "weight": 1.0}]
    roles = []
    for i, entry in enumerate(entries):
        path = entry["path"] or default_path
        if not path:
            raise RecipeConfigError(f"{key}.models[{i}] (role 'reward') has no path and model.reward is empty.")
        stage = entry.get("stage", base.stage)
        try:
            place = Placement(stage=base.stage if stage is None or stage < 0 else int(stage),
                              dtype=entry.get("dtype") or base.dtype,
                              offload_params=bool(entry.get("offload_params", base.offload_params)),
                              gather_forward=bool(entry.get("gather_forward", base.gather_forward)))
        except ValueError as exc:  # the engines' ConfigError: name the entry it came from
            raise RecipeConfigError(f"{key}.models[{i}] (role {entry['role']!r}): {exc}") from None
        roles.append(RewardModelRole(entry["role"], path, entry["weight"], place))
    sources = [reward_model(r.role, r.weight) for r in roles]
    labels = [spec.rpartition(":")[2] for spec, _ in specs]
    taken = {r.role for r in roles}
    for (spec, weight), label in zip(specs, labels):
        # a function's metric name is its own name, or the whole spec where that would be ambiguous
        unique = labels.count(label) == 1 and label not in taken
        sources.append(reward_function(spec, weight, name=label if unique else spec))
    return roles, sources

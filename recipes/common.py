"""What the RLHF recipes read from their configs beyond the role schema (engines/role_schema.py): the sections
they share (data, reward, generation, eval, export), the checks of validate(cfg), and the setup that reads those
sections (tiny assets, model folders and tokenizers, data streams, evaluation answers, export). The work itself
lives in pipelines/ (flat arguments)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from multiengine.engines import ShardedBatches, shard_batches
from multiengine.engines.recipe_config import Key, RecipeConfigError, Satisfies, plain
from multiengine.pipelines.checks import check_model, check_stage_batches, check_tokenizer
from multiengine.pipelines.rlhf.reward_sources import RewardModelRole, reward_roles, reward_tokenizer_checks
from multiengine.pipelines.rlhf.reward_sources import reward_entries as _reward_entries
from multiengine.pipelines.rlhf.runs import on_rank0_first, role_tokenizer

logger = logging.getLogger(__name__)

# --- the sections several RLHF recipes declare alike ---------------------------------------------------------
# What every trainable RLHF role changes from the shared role defaults: the Adam betas of DeepSpeed-Chat and
# OpenRLHF (beta2 = 0.95 tolerates the noisier gradients of RL better than the 0.999 default).
RLHF_TRAINABLE: dict[str, Any] = {"betas": [0.9, 0.95]}
# The random tiny model a recipe builds when a role's model is "" (the embedded default).
TINY_KEYS = Key({"hidden": Key(64, "width of the random tiny model (roles whose model is \"\")"),
                 "layers": Key(2, "layers of the random tiny model")},
                "the random tiny OPT built under output_dir/tiny for roles whose model is \"\" (mechanics only)")
TINY_RENAMED: dict[str, str] = {"model.tiny_hidden": "tiny.hidden", "model.tiny_layers": "tiny.layers"}


def _eval_split_ok(value: Any) -> bool:
    from multiengine.pipelines.sources import DataSourceError, parse_eval_split

    try:
        parse_eval_split(value)
    except DataSourceError:
        return False
    return True


# Every RLHF recipe's `data` section starts with these keys (docs/data.md); the recipe adds its lengths.
DATA_COLUMNS: dict[str, str] = {
    "prompt": Key("", "your column holding the prompt (\"\" = a column named prompt)"),
    "response": Key("", "... the response (completion is read as response)"),
    "completion": Key("", "... the completion"),
    "chosen": Key("", "... the preferred answer"),
    "rejected": Key("", "... the worse answer"),
    "text": Key("", "... plain text (language modelling)"),
    "messages": Key("", "... a conversation: a list of {role, content}"),
}
DATA_KEYS: dict[str, Any] = {
    "source": Key("", ".jsonl/.json/.csv/.parquet file, save_to_disk folder, split-files folder, hub name; \"\" = "
                      "built-in"),
    "sources": Key([], "several sources blended by weight, [{path, weight, columns, split}]; replaces data.source"),
    "columns": Key({**DATA_COLUMNS}, "your column names per field: data.columns.<field>=<column>"),
    "train_split": Key("train", "the split of a hub dataset / DatasetDict folder to train on"),
    "eval_source": Key("", "separate evaluation rows (the forms of data.source); never a training source"),
    "eval_split": Key("auto", "auto (the eval/test split, else 5% of rows held out) | none | 0.05 | 200 | a split "
                              "name", Satisfies(_eval_split_ok, "auto, none, a fraction in (0, 1), a row count >= 1 or "
                                                                "a split name")),
}
PROMPT_LEN = Key(16, "prompt tokens kept (a longer prompt loses its beginning)")  # data.max_prompt_len
# reward sources named in a config (rlhf_ppo, rlhf_grpo; the entries' forms: pipelines/rlhf/reward_sources.py)
REWARD_KEYS: dict[str, Any] = {
    "models": Key([], "reward-model roles [{role, model, weight, tokenizer, stage, ...}]; [] and no functions = "
                      "the `reward` role (roles.reward), weight 1"),
    "functions": Key([], "reward functions: pkg.mod:fn, /path/file.py:fn, builtin:judge or {fn, weight}"),
    "normalize": Key(False, "running mean/std of the combined score over all ranks, before clipping"),
}
GENERATION_KEYS: dict[str, Any] = {
    "max_new_tokens": Key(8, "tokens generated per answer"),
    "temperature": Key(1.0, "sampling temperature"),
}
# the sampling of rollouts, which the evaluation answers share
ROLLOUT_KEYS: dict[str, Any] = {
    **GENERATION_KEYS,
    "temperature": Key(1.0, "sampling temperature (also divides the logits of the update)"),
    "top_k": Key(0, "0 = off"),
    "top_p": Key(1.0, "nucleus sampling (1 = off)"),
    "mode": Key("gather", "gather (actor gathered once per batch) | per_token (ZeRO-3 synced_gpus)"),
}
EVAL_KEYS: dict[str, Any] = {
    "every": Key(50, "also evaluate every N steps (0 = only before and after)"),
    "size": Key(256, "evaluation prompts (those of the evaluation rows, never training prompts), split evenly over "
                     "ranks; 0 = none"),
    "batch_size": Key(32, "prompts per generation batch"),
    "judge": Key(True, "the built-in task's programmatic judge (only for its prompts)"),
    "greedy": Key(True, "also score greedy answers (the main figures are those of sampled answers, seeded)"),
    "seed": Key(1234, "sampling seed of evaluation answers"),
}
JUDGE_HEADLINE = ("judge", "judge score of sampled answers (built-in task)", True)
REWARD_HEADLINE = ("reward", "held-out reward (weighted sum of the reward sources)", True)


def eval_keys(meaning: str, **defaults: Any) -> Key:
    """The ``eval`` section (:data:`EVAL_KEYS`) with a recipe's own defaults, e.g. ``eval_keys("...", every=100)``."""
    unknown = set(defaults) - set(EVAL_KEYS)
    if unknown:
        raise KeyError(f"not eval keys: {sorted(unknown)}")
    return Key({k: v._replace(default=defaults.get(k, v.default)) for k, v in EVAL_KEYS.items()}, meaning)


def export_keys(role: str = "actor", what: str = "") -> Key:
    """The ``export`` section of a recipe that exports one trained role (:func:`export_role`)."""
    return Key({"enabled": Key(True, f"export/{role}{what}")}, "what the run writes under output_dir/export")


def run_keys(meaning: str, config: str = "a shipped rlhf_sft config",
             overrides: str = "key=value overrides for it (rlhf_sft's keys: roles.actor.lr=..., ...)") -> Key:
    """A section naming another recipe's run: ``actor_sft`` / ``teacher_sft`` (how a role left empty is trained
    first, :func:`sft_model`), rlhf_e2e's steps."""
    return Key({"config": Key("tiny", config), "overrides": Key([], overrides)}, meaning)


def lora_renamed(role: str) -> dict[str, str]:
    """RENAMED entries of the old ``lora.<role>.*`` section (its ``enabled`` + ``rank`` are ``roles.<role>.lora.r``)."""
    return {f"lora.{role}.*": f"roles.{role}.lora.*", f"lora.{role}.rank": f"roles.{role}.lora.r",
            f"lora.{role}.enabled": f"roles.{role}.lora.r (to the adapter rank, e.g. 8; 0 = no LoRA)"}


# --- the checks of validate(cfg), before any rank starts -------------------------------------------------------
def check_role(cfg: Any, role: str, tokenizer: str | None = None, fallback: Any = None) -> Any:
    """``roles.<role>.model`` (:func:`check_model`) and its tokenizer (``tokenizer``, else
    ``roles.<role>.tokenizer``) against its vocabulary (:func:`check_tokenizer`); returns the tokenizer."""
    section = cfg.roles[role]
    check_model(f"roles.{role}.model", section.model)
    given = section.tokenizer if tokenizer is None else tokenizer
    return check_tokenizer(f"roles.{role}.tokenizer", given, f"roles.{role}.model", section.model, fallback)


def check_data(cfg: Any, stage: str, tokenizer: Any = None, *, eval_stage: str | None = None,
               tokenizer_key: str = "roles.actor.model", source: Any = None, key: str | None = None,
               evaluate: bool = True) -> dict[str, Any] | None:
    """The data of one stage: every source exists and has rows of a format of the stage after the column mapping,
    conversational rows meet a tokenizer with a chat template, and the evaluation rows resolve (an eval source, a
    named split the sources have, or held-out rows that leave training rows). The built-in data ("" source)
    passes. Returns ``check_rlhf_data``'s report with the row counts and columns (``None`` for built-in data)."""
    from multiengine.pipelines.rlhf.data import check_rlhf_data, load_rlhf_data

    spec = data_spec(cfg.data)
    train_source = source or spec["source"]
    if not train_source:
        return None
    key = key or ("data.sources" if isinstance(train_source, list) else "data.source")
    try:
        report = check_rlhf_data(train_source, stage, columns=spec["columns"], train_split=spec["train_split"],
                                 tokenizer=tokenizer, key=key, tokenizer_key=tokenizer_key)
        if evaluate and spec["eval_source"]:
            check_rlhf_data(spec["eval_source"], eval_stage or stage, columns=spec["columns"], tokenizer=tokenizer,
                            key="data.eval_source", tokenizer_key=tokenizer_key)
        data = load_rlhf_data(train_source, stage, columns=spec["columns"], train_split=spec["train_split"],
                              eval_source=spec["eval_source"] or None, eval_split=spec["eval_split"],
                              eval_stage=eval_stage, seed=cfg.seed, evaluate=evaluate)
    except ValueError as err:
        raise RecipeConfigError(str(err)) from None
    report["train_rows"] = len(data.train)
    report["eval_rows"] = len(data.eval) if data.eval is not None else 0
    # what reward functions may read besides the prompt (checked against their parameters)
    report["columns"] = {"train": list(data.train.column_names),
                         "eval": list(data.eval.column_names) if data.eval is not None else None}
    report["eval_origin"] = data.eval_origin
    logger.info("data (%s): %d training rows (%s); evaluation: %s", stage, report["train_rows"],
                ", ".join(f"{r['path']}: {r['format']}" for r in report["sources"]), data.eval_origin)
    return report


def check_sft_run(cfg: Any, section: str, role: str, world_size: int, report: Any = False) -> None:
    """The rlhf_sft run that trains ``roles.<role>`` first when its model is empty (``section``: ``actor_sft`` /
    ``teacher_sft``, ``{config, overrides}``), on the recipe's SFT rows (``report``: their :func:`check_data`
    report when already checked): that run's micro batch against them."""
    from multiengine.engines.recipe_config import load_config

    if cfg.roles[role].model:
        return
    if report is False:
        report = check_data(cfg, "sft", None)  # the SFT run trains on the same data first
    if report is None:
        return
    run = cfg[section]
    sub = load_config("rlhf_sft", run.config or None, [str(o) for o in run.overrides])
    check_stage_batches(report, world_size, key=f"{section}: roles.actor.micro_batch_size",
                        value=int(sub.roles.actor.micro_batch_size), unit="SFT rows",
                        what=f"the rlhf_sft run that trains the {role} first, config {run.config!r}",
                        setting=f"{section}.overrides=[roles.actor.micro_batch_size={{n}}]")


def check_prompts_and_rewards(cfg: Any, models: list[RewardModelRole],
                              scoring: tuple[tuple[str, str, str, str], ...] = ()) -> tuple[Any, Any]:
    """rlhf_ppo, rlhf_grpo: the folders of the actor, every reward model and the roles of ``scoring`` (more scoring
    roles' ``(role, folder, tokenizer, key)``), the actor's tokenizer against its model, the prompts and evaluation
    prompts (:func:`check_data`), the columns each reward function names, and (with roles.actor.model set) each
    scoring role's tokenizer. Returns the actor's tokenizer and the data report."""
    from multiengine.pipelines.rlhf.retokenize import check_scoring_tokenizers

    r = cfg.roles
    for role in ("actor", *(s[0] for s in scoring), "reward"):
        check_model(f"roles.{role}.model", r[role].model)
    for m in models:
        if m.path != r.reward.model:
            check_model(f"reward.models ({m.role}).model", m.path)
    actor_tok = check_tokenizer("roles.actor.tokenizer", r.actor.tokenizer, "roles.actor.model", r.actor.model)
    report = check_data(cfg, "ppo", actor_tok, eval_stage="eval", tokenizer_key="roles.actor.tokenizer")
    if report is not None:  # the columns each reward function names are in the prompts' rows
        check_reward_columns(cfg.reward, report["columns"])
    if r.actor.model:
        try:
            check_scoring_tokenizers(actor_tok, [*reward_tokenizer_checks(models), *scoring],
                                     bool(report and report["conversational"]))
        except (OSError, ValueError) as err:
            raise RecipeConfigError(str(err)) from None
    return actor_tok, report


def check_reward_columns(sources: Any, columns: Any, key: str = "data.source") -> None:
    """Each reward function's required parameters are columns of the rows it will score: ``columns`` is
    ``{"train": [...], "eval": [...] or None}`` (``check_data``'s report) or one list; ``sources`` the
    ``RewardSource`` list, or a reward config section (its functions are loaded here). Raises a config error
    naming the function, the parameter, the data's columns and the fix."""
    from multiengine.pipelines.rlhf.rewards import check_reward_columns as check
    from multiengine.pipelines.rlhf.rewards import reward_function

    if not isinstance(sources, (list, tuple)):
        sources = [reward_function(spec, weight) for spec, weight in reward_entries(sources)[1]]
    named = columns if isinstance(columns, Mapping) else {"train": columns}
    try:
        for split, cols in named.items():
            if cols is not None:
                check(sources, list(cols), "the evaluation rows" if split == "eval" else f"{key} (the training rows)")
    except ValueError as err:
        raise RecipeConfigError(str(err)) from None


# --- reading the data and reward sections ---------------------------------------------------------------------
def data_spec(section: Any) -> dict[str, Any]:
    """The loading arguments of a ``data`` section: ``source`` (``data.sources`` when set, else
    ``data.source``), ``columns`` (the fields that are mapped), ``train_split``, ``eval_source``, ``eval_split``
    (parsed)."""
    from multiengine.pipelines.sources import parse_eval_split

    sources = plain(section.get("sources")) or []
    columns = {k: v for k, v in (plain(section.get("columns")) or {}).items() if v}
    return {"source": sources or section.get("source") or "", "columns": columns,
            "train_split": section.get("train_split") or "train",
            "eval_source": section.get("eval_source") or "",
            "eval_split": parse_eval_split(section.get("eval_split", "auto"))}


def data_overrides(section: Any, source: str | None = None) -> list[str]:
    """``key=value`` overrides that give another recipe the same data (rlhf_e2e's steps, an SFT actor trained
    first): ``data.source`` (``source`` when given: the built-in data folder), ``data.sources``, every mapped
    column, ``data.train_split``, ``data.eval_source`` and ``data.eval_split``."""
    import json

    out = [f"data.source={source if source is not None else section.get('source') or ''}"]
    sources = plain(section.get("sources")) or []
    if sources:
        out.append(f"data.sources={json.dumps(sources)}")
    for field, column in (plain(section.get("columns")) or {}).items():
        if column:
            out.append(f"data.columns.{field}={column}")
    for key in ("train_split", "eval_source", "eval_split"):
        if key in section:
            out.append(f"data.{key}={section.get(key) if section.get(key) is not None else ''}")
    return out


def uses_builtin_data(section: Any) -> bool:
    """Neither ``data.source`` nor ``data.sources`` is set: the built-in task's data."""
    return not (section.get("source") or plain(section.get("sources")))


def reward_entries(section: Any, key: str = "reward", default_model: str = ""
                   ) -> tuple[list[dict[str, Any]], list[tuple[str, float]]]:
    """The checked ``models`` and ``functions`` entries of a reward section (``reward_sources.reward_entries``)."""
    return _reward_entries(plain(section.get("models")) or [], plain(section.get("functions")) or [], key,
                           default_model)


def wants_reward_role(section: Any) -> bool:
    """The ``reward`` role takes its folder from ``roles.reward.model``: no source is named (the default), or
    a ``reward.models`` entry names the role without a folder."""
    entries, functions = reward_entries(section)
    return (not entries and not functions) or any(e["role"] == "reward" and not e["model"] for e in entries)


def reward_config(section: Any, default_path: str | None, base: Any, key: str = "reward",
                  default_tokenizer: str = "") -> tuple[list[RewardModelRole], list[Any]]:
    """The reward-model roles to build and every reward source of a reward section
    (``reward_sources.reward_roles``): ``default_path`` is ``roles.reward.model`` (``None`` = none may be used),
    ``base`` ``roles.reward``'s resolved placement, ``default_tokenizer`` ``roles.reward.tokenizer``."""
    entries, specs = reward_entries(section, key, default_path or "")
    return reward_roles(entries, specs, default_path, base, key, default_tokenizer)


# --- setup: model folders, data streams, evaluation answers, export --------------------------------------------
def tiny_assets(recipe: Any, *models: str) -> dict[str, str]:
    """The embedded default (built-in dataset, tokenizer, random tiny OPT) under ``output_dir/tiny`` when the data
    source or one of ``models`` (model folders) is left empty, else ``{}``."""
    from multiengine.pipelines.rlhf.runs import prepare_tiny_assets

    if not (uses_builtin_data(recipe.cfg.data) or not all(models)):
        return {}
    tiny = recipe.cfg.tiny
    return prepare_tiny_assets(recipe.path("tiny"), recipe.registry, recipe.cfg.seed, tiny.hidden, tiny.layers)


def role_folder(recipe: Any, role: str, assets: dict[str, str], path: str = "") -> tuple[str, Any]:
    """``roles.<role>.model`` (``path`` when given: what the recipe resolved or trained for it; else the tiny
    model of ``assets`` when empty) and its tokenizer (``roles.<role>.tokenizer``, else the folder's, else the
    tiny tokenizer)."""
    section = recipe.cfg.roles[role]
    path = path or section.model or assets["model"]
    tiny_tok = role_tokenizer("", assets["tokenizer"]) if assets else None
    return path, role_tokenizer(section.tokenizer, path, tiny_tok, what=f"roles.{role}.model")


def sft_model(recipe: Any, section: Any, out_dir: str, data: list[str], base_model: str) -> str:
    """Train a model with the rlhf_sft recipe under ``out_dir`` and return its export. ``section`` has ``config``
    (a shipped rlhf_sft config) and ``overrides``; ``data`` are the ``data.*`` overrides that give it the
    recipe's data (:func:`data_overrides`). A finished run is reused only while its resolved config and inputs
    are unchanged (engines/recipe_steps.py). The SFT run builds its own registry on the same ranks."""
    from multiengine.engines.recipe_steps import run_step

    cfg = recipe.cfg
    overrides = [f"seed={cfg.seed}", f"backend={cfg.backend}", *data, f"roles.actor.model={base_model}",
                 *section.overrides]
    logger.info("%s: the SFT model comes from rlhf_sft (config %s) in %s", recipe.name, section.config, out_dir)
    summary = run_step("rlhf_sft", section.config, overrides, out_dir, False, {})
    return summary["export"]["actor"]["model"]


def sft_actor(recipe: Any, assets: dict[str, str]) -> tuple[str, Any]:
    """The actor's folder (``roles.actor.model``, else the tiny SFT actor trained first under output_dir/sft with
    ``actor_sft`` on the recipe's data; ``assets``: :func:`tiny_assets`) and its tokenizer."""
    cfg = recipe.cfg
    path = cfg.roles.actor.model or sft_model(
        recipe, cfg.actor_sft, recipe.path("sft"), data_overrides(cfg.data, assets.get("data") or None),
        assets["model"])
    return role_folder(recipe, "actor", assets, path)


def load_data(recipe: Any, stage: str, assets: dict[str, str], *, eval_stage: str | None = None,
              source: Any = None, evaluate: bool = True) -> Any:
    """The training and evaluation rows of one stage (``rlhf.data.load_rlhf_data``) from the recipe's ``data``
    section, rank 0 first: ``data.sources`` or ``data.source`` (the built-in data of ``assets`` when both are
    empty), ``data.columns``, ``data.eval_source`` / ``data.eval_split``. ``source`` replaces the training source
    (PPO's ``data.ptx_source``); ``evaluate=False`` loads training rows only. Returns a ``TrainEval``."""
    from multiengine.pipelines.rlhf.data import load_rlhf_data

    cfg = recipe.cfg
    spec = data_spec(cfg.data)
    train_source = source or spec["source"] or assets.get("data", "")
    return on_rank0_first(recipe.registry, lambda: load_rlhf_data(
        train_source, stage, columns=spec["columns"], train_split=spec["train_split"],
        eval_source=spec["eval_source"] or None, eval_split=spec["eval_split"], eval_stage=eval_stage,
        seed=cfg.seed, evaluate=evaluate))


def training_batches(recipe: Any, data: Any, collate: Any, batch_size: int) -> tuple[ShardedBatches, list[Any]]:
    """Training rows as a checkpointed stream of ``batch_size`` rows (``add_state("batches")``) and the held-out
    batches of the evaluation rows (at most ``data.heldout_size`` of them; 0 = all), which are never trained on."""
    cfg, registry = recipe.cfg, recipe.registry
    batches = registry.add_state("batches", ShardedBatches(data.train, collate, batch_size, registry.world_size,
                                                           registry.rank, seed=cfg.seed))
    heldout = []
    if data.eval is not None:
        heldout = shard_batches(data.eval, collate, batch_size, registry.world_size, registry.rank,
                                limit=cfg.data.heldout_size)
    return batches, heldout


def prompt_batches(recipe: Any, data: Any, tokenizer: Any, batch_size: int) -> tuple[ShardedBatches, bool, dict]:
    """The training prompts as a checkpointed stream (``add_state("prompts")``), whether they are conversations,
    and the columns of the training and evaluation rows (what reward functions may read)."""
    from multiengine.pipelines.rlhf.data import PromptCollator

    cfg, registry = recipe.cfg, recipe.registry
    collate = PromptCollator(tokenizer, cfg.data.max_prompt_len)
    prompts = registry.add_state("prompts", ShardedBatches(data.train, collate, batch_size, registry.world_size,
                                                           registry.rank, seed=cfg.seed))
    columns = {"train": data.train.column_names, "eval": data.eval.column_names if data.eval is not None else None}
    return prompts, "prompt_messages" in collate([data.train[0]]), columns


def policy_answers(recipe: Any, rows: Any, tokenizer: Any, role: str = "actor") -> Any:
    """``role``'s answers to ``eval.size`` prompts of ``rows`` (evaluation rows, never training rows; none when
    they have no prompts) in batches of ``eval.batch_size``, equal shares per rank, as a ``PolicyAnswers``:
    sampled with ``generation.*`` (seeded by ``eval.seed``), greedy too with ``eval.greedy``, judged with
    ``eval.judge`` when the prompts are the built-in task's. Call it to evaluate."""
    from multiengine.pipelines.rlhf.data import PromptCollator
    from multiengine.pipelines.rlhf.evaluation import PolicyAnswers
    from multiengine.pipelines.rlhf.generation import GenerationSettings
    from multiengine.pipelines.rlhf.runs import builtin_judge

    cfg, registry = recipe.cfg, recipe.registry
    g, mode = cfg.generation, cfg.generation.get("mode", "gather")
    batches = []
    if cfg.eval.size and rows is not None and len(rows) and {"prompt", "messages"} & set(rows.column_names):
        # conversational prompts are rendered with add_generation_prompt=True
        batches = shard_batches(rows, PromptCollator(tokenizer, cfg.data.max_prompt_len), cfg.eval.batch_size,
                                registry.world_size, registry.rank, limit=cfg.eval.size)
    sampled = GenerationSettings(max_new_tokens=g.max_new_tokens, temperature=g.temperature, top_k=g.get("top_k", 0),
                                 top_p=g.get("top_p", 1.0), mode=mode, do_sample=True)
    greedy = GenerationSettings(max_new_tokens=g.max_new_tokens, mode=mode, do_sample=False) if cfg.eval.greedy \
        else None
    judge = builtin_judge([p for b in batches for p in b["prompts"]], cfg.eval.judge)
    return PolicyAnswers(registry, batches, tokenizer, sampled, greedy, judge, cfg.eval.seed, role)


def export_role(recipe: Any, tokenizer: Any, role: str = "actor") -> dict[str, Any]:
    """``export/<role>`` (an HF folder with ``tokenizer``; merged weights + adapter/ for LoRA; a
    ``*ForSequenceClassification`` folder for a scalar-head role) when ``export.enabled``, else ``{}``."""
    from multiengine.engines import save_role

    if not recipe.cfg.export.enabled:
        return {}
    return {role: save_role(recipe.registry, role, recipe.path("export", role), tokenizer=tokenizer)}

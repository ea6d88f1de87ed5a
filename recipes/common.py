"""What the RLHF recipes share beyond pipelines/rlhf (whose functions build their roles, data streams and rollouts):
the sections they declare alike (the export and step-run settings here; data, generation, eval, reward, tiny in
pipelines/), the checks of their ``validate``, the SFT model a recipe trains first (an rlhf_sft run) and the planner
helpers of their ``plan``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multiengine.engines import planner as P
from multiengine.engines.settings import Settings, setting
from multiengine.pipelines.checks import check_model, check_stage_batches, check_tokenizer
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import RecipeConfigError, config_problem, load_config

__all__ = ["JUDGE_HEADLINE", "REF_TOKENIZER", "REWARD_HEADLINE", "RLHF_TRAINABLE", "TINY_RENAMED", "TOKEN_BUDGET_WHY",
           "ExportSettings",
           "StepRun", "check_data", "check_hf_generation", "check_model", "check_prompts_and_rewards",
           "check_router_replay", "check_scalar_export",
           "check_reward_columns", "check_role", "check_sft_run", "check_stage_batches", "check_tokenizer",
           "eval_generation", "lm_info", "lora_renamed", "old_keys", "policy_plan", "reward_plan", "sft_model"]

logger = logging.getLogger(__name__)

# What every trainable RLHF role changes from the shared role defaults: the Adam betas of DeepSpeed-Chat and
# OpenRLHF (beta2 = 0.95 tolerates the noisier gradients of RL better than the 0.999 default).
RLHF_TRAINABLE: dict[str, Any] = {"betas": [0.9, 0.95]}
JUDGE_HEADLINE = ("judge", "judge score of sampled answers (built-in task)", True)
REWARD_HEADLINE = ("reward", "held-out reward (weighted sum of the reward sources)", True)
TOKEN_BUDGET_WHY = ("its micro-batches are the data loader's micro_batch_size rows (each packed where the family "
                    "packs); token budgets size the RL updates' micro-batches")
REF_TOKENIZER = "the ref scores the actor's tokens: its tokenizer is the actor's (roles.actor.tokenizer)"
TINY_RENAMED: dict[str, str] = {"model.tiny_hidden": "tiny.hidden", "model.tiny_layers": "tiny.layers"}


@dataclass(frozen=True)
class ExportSettings(Settings):
    enabled: bool = setting(True, "write export/<role>: an HF folder with the tokenizer (merged weights + adapter/ "
                                  "for LoRA; a *ForSequenceClassification folder for a scalar-head role)")


@dataclass(frozen=True)
class StepRun(Settings):
    """Another recipe run in-process as a step of this one (reused while its config and inputs are unchanged)."""

    config: str = setting("tiny", "its shipped config")
    overrides: list[str] = setting([], "key=value overrides for it (its own keys: roles.actor.lr=..., ...)")


def old_keys(trainable: str, model: str = "model.pretrained", **extra: str) -> dict[str, str]:
    """The ``renamed`` entries of the dialect the RLHF recipes spoke before every role had the same keys."""
    new = f"roles.{trainable}"
    return {"train.*": f"{new}.*", "lora.enabled": f"{new}.lora.r (to the adapter rank, e.g. 8; 0 = no LoRA)",
            "lora.rank": f"{new}.lora.r", "lora.*": f"{new}.lora.*", model: f"{new}.model",
            "model.tokenizer": f"{new}.tokenizer", **TINY_RENAMED, **extra}


def lora_renamed(role: str) -> dict[str, str]:
    """``renamed`` entries of the old ``lora.<role>.*`` section (its ``enabled`` + ``rank`` are
    ``roles.<role>.lora.r``)."""
    return {f"lora.{role}.*": f"roles.{role}.lora.*", f"lora.{role}.rank": f"roles.{role}.lora.r",
            f"lora.{role}.enabled": f"roles.{role}.lora.r (to the adapter rank, e.g. 8; 0 = no LoRA)"}


# --- the checks of validate, before any rank starts -----------------------------------------------------------------
def check_role(cfg: Any, role: str, tokenizer: str | None = None, fallback: Any = None) -> Any:
    """``roles.<role>.model`` and its tokenizer (``tokenizer``, else ``roles.<role>.tokenizer``) against its
    vocabulary; returns the tokenizer (None for the built-in tiny model)."""
    r = cfg.roles[role]
    check_model(f"roles.{role}.model", r.model)
    given = r.tokenizer if tokenizer is None else tokenizer
    return check_tokenizer(f"roles.{role}.tokenizer", given, f"roles.{role}.model", r.model, fallback)


def check_data(cfg: Any, stage: str, tokenizer: Any = None, *, eval_stage: str | None = None,
               tokenizer_key: str = "roles.actor.model", source: Any = None, key: str | None = None,
               evaluate: bool = True) -> dict[str, Any] | None:
    """The rows of one stage (``cfg.data``; ``source``/``key``: another training source, PPO's pretraining rows):
    every source exists and holds a format of the stage, conversations meet a chat template, and the evaluation rows
    resolve. Returns ``check_rlhf_data``'s report with ``train_rows``, ``eval_rows``, ``columns`` (what reward
    functions may read) and ``eval_origin``; None for the built-in data."""
    from multiengine.pipelines.rlhf.data import check_rlhf_data, load_rlhf_data

    data = cfg.data
    source = source or data.train_source()
    if not source:
        return None
    report = check_rlhf_data(data, stage, tokenizer, source=source, key=key, tokenizer_key=tokenizer_key)
    if evaluate and data.eval_source:
        check_rlhf_data(data, eval_stage or stage, tokenizer, source=data.eval_source, key="data.eval_source",
                        tokenizer_key=tokenizer_key)
    rows = load_rlhf_data(data, stage, seed=cfg.seed, eval_stage=eval_stage, source=source, evaluate=evaluate)
    report.update(train_rows=len(rows.train), eval_rows=len(rows.eval) if rows.eval is not None else 0,
                  eval_origin=rows.eval_origin,
                  columns={"train": list(rows.train.column_names),
                           "eval": list(rows.eval.column_names) if rows.eval is not None else None})
    logger.info("data (%s): %d training rows (%s); evaluation: %s", stage, report["train_rows"],
                ", ".join(f"{r['path']}: {r['format']}" for r in report["sources"]), rows.eval_origin)
    return report


def check_sft_run(cfg: Any, section: str, role: str, world_size: int, report: Any = False) -> None:
    """The rlhf_sft run (``cfg.<section>``: actor_sft, teacher_sft) that trains ``roles.<role>`` first when its model
    is empty, on the recipe's SFT rows (``report``: their :func:`check_data` report, if already made): its config
    loads and its micro batch fits them."""
    if cfg.roles[role].model:
        return
    if report is False:
        report = check_data(cfg, "sft")
    run = getattr(cfg, section)
    try:
        sub = load_config("rlhf_sft", run.config or None, list(run.overrides))
    except RecipeConfigError as err:
        raise RecipeConfigError(f"{section}.config={run.config!r} with {section}.overrides={list(run.overrides)} (the "
                                f"rlhf_sft run that trains roles.{role} first): {err}") from None
    check_stage_batches(report, world_size, key=f"{section}: roles.actor.micro_batch_size",
                        value=sub.roles.actor.micro_batch_size, unit="SFT rows",
                        what=f"the rlhf_sft run that trains the {role} first, config {run.config!r}",
                        setting=f"{section}.overrides=[roles.actor.micro_batch_size={{n}}]")


def check_reward_columns(sources: Any, columns: Any, key: str = "data.source") -> None:
    """Each reward function's required parameters are columns of the rows it will score: ``columns`` is
    ``{"train": [...], "eval": [...] or None}`` (a :func:`check_data` report's) or one list; ``sources`` the
    ``RewardSource`` list or a ``RewardSettings`` (its functions are loaded here)."""
    from multiengine.pipelines.rlhf.rewards import check_reward_columns as check
    from multiengine.pipelines.rlhf.rewards import reward_function

    if not isinstance(sources, (list, tuple)):
        sources = [reward_function(spec, weight) for spec, weight in sources.entries()[1]]
    named = columns if isinstance(columns, Mapping) else {"train": columns}
    try:
        for split, cols in named.items():
            if cols is not None:
                check(sources, list(cols), "the evaluation rows" if split == "eval" else f"{key} (the training rows)")
    except ValueError as err:
        raise RecipeConfigError(str(err)) from None


def check_prompts_and_rewards(cfg: Any, models: list[Any], scoring: tuple[tuple[str, str, str, str], ...] = ()
                              ) -> tuple[Any, Any]:
    """rlhf_ppo, rlhf_grpo: the folders of the actor, every reward model and the roles of ``scoring`` (more scoring
    roles' ``(role, folder, tokenizer, key)``), the actor's tokenizer, the prompts and evaluation prompts, the
    columns each reward function names, and (with roles.actor.model set) each scoring role's tokenizer. Returns the
    actor's tokenizer and the data report."""
    from multiengine.pipelines.rlhf.retokenize import check_scoring_tokenizers
    from multiengine.pipelines.rlhf.reward_sources import reward_tokenizer_checks

    r = cfg.roles
    for role in ("actor", *(s[0] for s in scoring), "reward"):
        check_model(f"roles.{role}.model", r[role].model)
    for m in models:
        if m.path != r.reward.model:
            check_model(f"reward.models ({m.role}).model", m.path)
    actor_tok = check_tokenizer("roles.actor.tokenizer", r.actor.tokenizer, "roles.actor.model", r.actor.model)
    report = check_data(cfg, "ppo", actor_tok, eval_stage="eval", tokenizer_key="roles.actor.tokenizer")
    if report is not None:
        check_reward_columns(cfg.reward, report["columns"])
    if r.actor.model:
        try:
            check_scoring_tokenizers(actor_tok, [*reward_tokenizer_checks(models), *scoring],
                                     bool(report and report["conversational"]))
        except (OSError, ValueError) as err:
            raise RecipeConfigError(str(err)) from None
    return actor_tok, report


def run_step(recipe: str, config: str, overrides: list[str], out_dir: str, rerun: bool,
             decisions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``language.steps.run_step``, keeping this run's key reads: the step's ``Recipe.main`` starts tracking anew
    (``track_reads()`` empties the record, recipes/language/lifecycle.py), which would drop the keys read so far."""
    from multiengine.engines import settings
    from multiengine.recipes.language import steps

    reads = set(settings._READS or ())
    try:
        return steps.run_step(recipe, config, overrides, out_dir, rerun, decisions)
    finally:
        if settings._READS is not None:
            settings._READS |= reads


ROLLOUT_ROLE_HELP = ("the engine generating the {of}'s rollouts, its weights synced from the {of} after each step: "
                     "vLLM on every rank (generation.engine=vllm, docs/vllm.md), or either engine on ranks of its "
                     "own (roles.rollout.ranks, docs/async.md)")


def trainer_ranks(cfg: Any, world_size: int) -> int:
    """The ranks that train: the job's, less roles.rollout.ranks."""
    return world_size - len(cfg.roles.rollout.ranks) if "rollout" in cfg.roles else world_size


def check_placement(cfg: Any, world_size: int, multiturn: bool = False, dynamic: bool = False) -> None:
    """roles.rollout.ranks: the job's last ranks, leaving trainer ranks it divides; what rollout ranks cannot run yet
    (multi-turn episodes, dynamic sampling's rounds, router replay, a vLLM engine over several ranks) refused; and
    rollout_is_cap only where rollouts carry their sampler's log-probs. Before any rank starts."""
    from multiengine.engines.placement import layout_problem

    ranks, g = list(cfg.roles.rollout.ranks), cfg.generation
    section = "grpo" if hasattr(cfg, "grpo") else "ppo"
    cap = getattr(cfg, section).rollout_is_cap if hasattr(cfg, section) else 0.0
    if cap and g.engine != "vllm" and g.schedule == "sync" and not ranks and g.router_replay == "off":
        raise config_problem(f"{section}.rollout_is_cap", cap, "corrects rollouts sampled by other weights or another "
                             "engine, and this run has none (generation.engine=hf, schedule=sync, no rollout ranks)",
                             "set generation.schedule=one_step_off/async, roles.rollout.ranks or "
                             f"generation.engine=vllm; or drop {section}.rollout_is_cap")
    if not ranks:
        return
    key = "roles.rollout.ranks"
    problem = layout_problem(ranks, world_size)
    if problem is not None:
        world = max(world_size, 2)
        raise config_problem(key, ranks, problem, f"e.g. {key}=[{world - 1}] with --nproc-per-node {world}, or "
                             f"{key}=[] (rollouts on every rank)")
    why = {"grpo.env": multiturn, "grpo.dynamic_sampling": dynamic,
           "generation.router_replay": g.router_replay != "off",
           "roles.rollout.tensor_parallel_size": g.engine == "vllm" and cfg.roles.rollout.tensor_parallel_size > 1}
    for other, on in why.items():
        if on:
            raise config_problem(key, ranks, f"cannot run with {other} yet (rollout ranks generate single-turn "
                                 "answers, one engine per rank, without routing records or extra rounds)",
                                 f"{key}=[] (rollouts on every rank), or turn {other} off")


def check_lockstep(cfg: Any, what: str) -> None:
    """Refuse generation.schedule and roles.rollout.ranks where ``what`` generates in lockstep only."""
    if cfg.generation.schedule != "sync":
        raise config_problem("generation.schedule", cfg.generation.schedule, f"is not available: {what} generate in "
                             "lockstep with training (rlhf_grpo and rlhf_ppo run ahead, docs/async.md)",
                             "generation.schedule=sync")
    if cfg.roles.rollout.ranks:
        raise config_problem("roles.rollout.ranks", list(cfg.roles.rollout.ranks), f"is not available: {what} "
                             "generate on every rank (rlhf_grpo and rlhf_ppo have rollout ranks, docs/async.md)",
                             "roles.rollout.ranks=[]")


def schedule_rollouts(run: Any, trainer: Any, actor_path: str, seq_len: int) -> None:
    """generation.schedule and roles.rollout.ranks on ``trainer`` (a GRPOTrainer or PPOTrainer): a queue of
    rollouts ahead of the update, generated here or on the rollout ranks (``run.bridge``); lockstep sync on every
    rank keeps the trainer's own path."""
    cfg = run.cfg
    if run.bridge is None and cfg.generation.schedule == "sync":
        return
    from multiengine.pipelines.rlhf.rollout_ranks import RemoteRollouts

    remote = None
    if run.bridge is not None:
        vllm = cfg.roles.rollout.engine_settings(seq_len, cfg.seed) if cfg.generation.engine == "vllm" else None
        n = getattr(trainer.settings, "n_samples_per_prompt", 1)
        remote = RemoteRollouts(run.bridge, run.registry, trainer.spec, n,
                                {"folder": actor_path, "dtype": cfg.roles.actor.effective_dtype, "vllm": vllm})
        if run.registry.is_main:
            logger.info("rollout rank %s: %s", remote.server, remote.engine)
    trainer.schedule(cfg.generation.depth, run.prompts, remote)


def rollouts_summary(run: Any) -> dict[str, Any]:
    """With a rollout queue: its counts and the ledger of trained batches (a hash over their indices and versions,
    this rank's; a resumed run that trained the same samples has the same)."""
    scheduled = getattr(getattr(run, "trainer", None), "scheduled", None)
    if scheduled is None:
        return {}
    engine = scheduled.remote.engine if scheduled.remote is not None else None
    counts = {k.removeprefix("rollout/"): v for k, v in scheduled.queue.counts().items()}
    return {"rollouts": {**counts, "ledger": scheduled.queue.ledger, "engine": engine,
                         "schedule": run.cfg.generation.schedule, "ranks": list(run.cfg.roles.rollout.ranks)}}


def stop_rollouts(run: Any) -> None:
    """Tell the rollout ranks the run is over (they exit)."""
    scheduled = getattr(getattr(run, "trainer", None), "scheduled", None)
    if scheduled is not None:
        scheduled.close()


def check_rollout(cfg: Any, seq_len: int, role: str = "actor", tiny: tuple[int, int, int] | None = None) -> None:
    """generation.engine=vllm: vLLM installed and able to run ``roles.<role>``'s model (``tiny``: the tiny OPT's
    hidden, layers, heads when it is empty; default tiny.*) on this machine (head size on CPU, family),
    ``roles.rollout`` within its means (max_model_len >= ``seq_len``: vLLM silently cuts longer answers; tensor
    parallelism and sleep mode need GPUs)."""
    import torch
    from multiengine.engines.vllm_rollout import RolloutEngineError, check_supported

    if cfg.generation.engine == "hf" and cfg.generation.router_replay != "off":
        check_router_replay(cfg, role)
    if cfg.generation.engine != "vllm":
        return
    r, model = cfg.roles.rollout, cfg.roles[role].model
    if r.max_model_len and r.max_model_len < seq_len:
        raise config_problem("roles.rollout.max_model_len", r.max_model_len, f"is shorter than a rollout ({seq_len} "
                             "tokens: prompt + new tokens); vLLM would cut answers short", f"set it >= {seq_len}, or 0")
    from multiengine.engines import known_models

    if model and known_models.canonical(model) in known_models.MODELS:  # a built-in hub name: no hub round trips
        known = known_models.MODELS[known_models.canonical(model)]
        config = {**known.config, "architectures": [known.class_name]}
    elif model:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model).to_dict()
        except OSError:  # a folder an earlier step writes (rlhf_e2e): checked when that step has run
            return
    else:
        from multiengine.pipelines.rlhf.tiny import tiny_lm_config

        hidden, layers, heads = tiny or (cfg.tiny.hidden, cfg.tiny.layers, cfg.tiny.heads)
        config = {**tiny_lm_config("opt", 512, hidden, layers, heads=heads).to_dict(),
                  "architectures": ["OPTForCausalLM"]}
    from multiengine.engines.moe import moe_shape

    if moe_shape(config) is not None:  # vLLM generates with it, but the sync sends fused experts it cannot load
        raise config_problem("generation.engine", "vllm", f"cannot run roles.{role}.model, a mixture of experts "
                             f"({config.get('model_type')}): the weight sync sends its fused expert tensors, which "
                             "vLLM's loader does not take", "generation.engine=hf")
    try:
        check_supported(config, r.engine_settings(seq_len, cfg.seed), "cuda" if torch.cuda.is_available() else "cpu")
    except RolloutEngineError as err:
        key = {"package": "generation.engine", "head_size": f"roles.{role}.model" if model or tiny else "tiny.heads",
               "architecture": f"roles.{role}.model"}.get(err.what, f"roles.rollout.{err.what}")
        fix = f"tiny.heads={cfg.tiny.hidden // 32} (head size 32)" if key == "tiny.heads" else err.fix
        raise config_problem(key, err.value if key != "generation.engine" else "vllm",
                             f"cannot run with generation.engine=vllm: {err.problem}", fix) from None


def check_hf_generation(cfg: Any, name: str) -> None:
    """generation.engine=vllm only where a rollout role generates (recipe ``name`` samples evaluation answers only)."""
    if cfg.generation.engine != "hf":
        raise config_problem("generation.engine", cfg.generation.engine, f"has no rollout engine in {name} (vLLM "
                             "generates the rollouts of rlhf_grpo, rlhf_ppo and distill)", "generation.engine=hf")


def check_router_replay(cfg: Any, role: str) -> None:
    """generation.router_replay=rollout: ``roles.<role>`` (the policy that samples) is a mixture of experts, its
    rollouts single-turn (an episode's turns are sampled as separate generations), and with replay_ref the ref has
    the same routers."""
    from multiengine.engines.moe import moe_shape
    from multiengine.recipes.language.roles import _model_config

    key, path = "generation.router_replay", cfg.roles[role].model_path()
    config = _model_config(path)
    if config is not None and moe_shape(config) is None:
        raise config_problem(key, "rollout", f"replays an MoE router's choices; roles.{role}.model "
                             f"({path or 'the built-in tiny model'}) is dense", f"{key}=off")
    if getattr(getattr(cfg, "distill", None), "on_policy_fraction", 1.0) == 0:
        raise config_problem(key, "rollout", "replays the student's own rollouts; distill.on_policy_fraction=0 "
                             "trains on the data's answers only", f"{key}=off, or distill.on_policy_fraction > 0")
    grpo = getattr(cfg, "grpo", None)
    if grpo is not None and grpo.env:
        raise config_problem(key, "rollout", "records one generation per rollout row; multi-turn episodes (grpo.env) "
                             "are several", f"{key}=off")
    if cfg.generation.replay_ref and ("ref" not in cfg.roles or (grpo is not None and not grpo.kl_coef)):
        raise config_problem("generation.replay_ref", True, "replays the rollout's routing in the ref, and this run "
                             "builds none (distill has no ref; rlhf_grpo builds it for grpo.kl_coef > 0)",
                             "generation.replay_ref=false")
    if cfg.generation.replay_ref:
        ref = _model_config(cfg.roles.ref.model_path() or path)
        same = ref is None or config is None or (moe_shape(ref) == moe_shape(config) and ref.get(
            "num_hidden_layers") == config.get("num_hidden_layers"))
        if not same:
            raise config_problem("generation.replay_ref", True, "replays the actor's routing in the ref, whose "
                                 "routers differ", "generation.replay_ref=false")


def check_scalar_export(key: str, path: str, what: str, fix: str) -> None:
    """A trained reward model / critic (``what``) whose model folder ``path`` (``key``) is of a family transformers has
    no ``*ForSequenceClassification`` class for trains, but its export (that class's folder) would fail at the end of
    the run: refused, with ``fix`` (turning the export off) besides a family that has one."""
    from multiengine.recipes.language.roles import _model_config
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSES

    family = (_model_config(path) or {}).get("model_type", "")
    if family and family not in CLASSES:
        raise config_problem(key, path, f"is of the {family} family, for which transformers has no "
                             f"*ForSequenceClassification class: {what} could not be exported at the end of the run "
                             "(export/ is that class's folder)", f"a model of a family with one (e.g. qwen3_moe, "
                             f"mixtral, qwen2_moe), or {fix}")


def sft_model(cfg: Any, run: StepRun, out_dir: str, assets: dict[str, str]) -> str:
    """The export of an rlhf_sft run (``run``: config and overrides) under ``out_dir`` on ``cfg.data`` from the tiny
    model, reused while its config and inputs are unchanged (language.steps.run_step)."""
    overrides = [f"seed={cfg.seed}", f"backend={cfg.backend}", *cfg.data.overrides(assets.get("data") or None),
                 f"roles.actor.model={assets['model']}", *run.overrides]
    logger.info("the SFT model comes from rlhf_sft (config %s) in %s", run.config, out_dir)
    return run_step("rlhf_sft", run.config, overrides, out_dir, False, {})["export"]["actor"]["model"]


# --- the planner helpers of the recipes' plan -----------------------------------------------------------------------
def lm_info(cfg: Any, model: str, role: str, assume: Mapping[str, str] | None,
            tiny: tuple[int, ...] | None = None) -> P.ModelInfo:
    """A causal LM's ModelInfo; ``model`` "" = the random tiny OPT ``(hidden, layers, seed)``, by default tiny.*'s."""
    import functools

    from multiengine.pipelines.rlhf.tiny import tiny_model_info

    build = functools.partial(tiny_model_info, *(tiny or (cfg.tiny.hidden, cfg.tiny.layers, cfg.seed, cfg.tiny.heads)))
    if not model and not (assume and role in assume):
        return build()
    return plans.resolve_model(str(model), role, assume=assume, tiny=build)


def eval_generation(cfg: Any) -> tuple[int, int, int] | None:
    """The evaluation answers' generation (eval.batch_size prompts, prompt and new tokens); None with eval.size 0."""
    return (cfg.eval.batch_size, cfg.data.max_prompt_len, cfg.generation.max_new_tokens) if cfg.eval.size else None


def reward_plan(cfg: Any, rows: int, assume: Mapping[str, str] | None) -> tuple[plans.RecipePlan, dict[str, Any]]:
    """Every reward-model role the recipe builds from ``reward.models`` (or the `reward` role from
    ``roles.reward.model`` when the section names no source), each forwarding ``rows`` rollout rows: ``roles.reward``'s
    keys go to the first role without a placement of its own, which the other such roles follow; a role whose entry
    sets its stage or offload is planned at that placement only (its keys are in a list --write does not rewrite).
    Returns their plan and the scalar-head model of each."""
    r = cfg.roles.reward
    entries, functions = cfg.reward.entries()
    if not entries and not functions:
        entries = [{"role": "reward", "model": "", "weight": 1.0}]
    seq = cfg.data.max_prompt_len + cfg.generation.max_new_tokens
    out, infos, leader = plans.RecipePlan("", []), {}, None
    for i, e in enumerate(entries):
        info = plans.scalar_info(lm_info(cfg, e.get("model") or r.model or "", e["role"], assume))
        stage = r.effective_stage if e.get("stage") is None or e["stage"] < 0 else int(e["stage"])
        dtype = str(e.get("dtype") or r.effective_dtype)
        own = "stage" in e or "offload_params" in e
        current = plans.current_choice(stage, False, bool(e.get("offload_params", r.offload_params)))
        follows = leader if not own and leader is not None else None
        note = f"weight {e['weight']:g}" + (f"; placement set in reward.models[{i}] (planned as written)" if own else
                                            f"; placed like {leader} (one roles.reward section)" if follows else "")
        out.roles.append(plans.role_plan(
            e["role"], info, dtype, trainable=False, current=current,
            phases=plans.lm_phases(P.transformer_dims(info.config), dtype, forward=(rows, seq), logits=False,
                                    label="experience forward"),
            full_gather=("experience forward",) if e.get("gather_forward", r.gather_forward) else (),
            gather_hint=f"reward.models[{i}].gather_forward=false" if "gather_forward" in e
            else "roles.reward.gather_forward=false",
            choices=(current,) if own else (), follows=follows, follows_all=follows is not None, note=note))
        infos[e["role"]] = info
        if not own and leader is None:
            leader = e["role"]
            out.keys[e["role"]] = plans.role_keys("roles.reward", offload_optimizer=False)
    if functions:
        out.notes.append("reward functions (no memory): " + ", ".join(f"{fn} x {w:g}" for fn, w in functions))
    out.packed = [name for name, info in infos.items() if plans.packs(r, info)]
    return out, infos


def rollout_plan(cfg: Any, info: P.ModelInfo, rows: int = 0) -> list[P.RoleRequest]:
    """The rollout engine of every rank, or of each rollout rank (roles.rollout.ranks). generation.engine=vllm: whole
    weights (its share under tensor parallelism) and its KV cache, resident for the whole run (sleep mode, GPU, frees
    them during updates). transformers on a rollout rank: a whole copy of the actor in its dtype, generating ``rows``
    rows (one trainer rank's batch: it serves its trainer ranks in turn)."""
    r, g, stage0 = cfg.roles.rollout, cfg.generation, plans.current_choice(0, False)
    if r.ranks and g.engine == "hf":
        dtype = cfg.roles.actor.effective_dtype
        phases = plans.lm_phases(P.transformer_dims(info.config), dtype,
                                 generate=(rows, cfg.data.max_prompt_len, g.max_new_tokens))
        return [P.RoleRequest("rollout", info.params, dtype, phases=tuple(phases), choices=(stage0,), current=stage0,
                              source=info.source,
                              note=f"transformers generate on a whole copy of the actor: one trainer rank's {rows} "
                                   "rows at a time")]
    if g.engine != "vllm":
        return []
    dtype = r.dtype or cfg.roles.actor.effective_dtype
    element = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    kv = int(r.kv_cache_gb * 2**30)
    if r.ranks:  # alone on its GPU: the KV cache shown as its own (resident) use
        return [P.RoleRequest("rollout", info.params, dtype, phases=(("KV cache", kv),), choices=(stage0,),
                              current=stage0, source=info.source, note="vLLM: whole weights + KV cache")]
    return [P.RoleRequest("rollout", info.params // r.tensor_parallel_size + kv // element, dtype, choices=(stage0,),
                          current=stage0, source=info.source,
                          note=f"vLLM: {info.params // r.tensor_parallel_size:,} parameters (tensor_parallel_size "
                               f"{r.tensor_parallel_size}) + KV cache {r.kv_cache_gb:g} GiB")]


def policy_plan(title: str, note: str, cfg: Any, infos: Mapping[str, P.ModelInfo], ref: bool, rows: int,
                rollout: int, rewards: plans.RecipePlan, assume: Mapping[str, str] | None = None) -> plans.RecipePlan:
    """rlhf_ppo, rlhf_grpo: the actor generating ``rollout`` rows and updating on its micro batch, the critic where
    ``infos`` has one, a frozen ref from the actor's folder where ``ref`` (experience forwards of ``rows`` rows by
    the actor and critic, of ``rollout`` rows by the ref), then the reward-model roles ``rewards``."""
    prompt, new = cfg.data.max_prompt_len, cfg.generation.max_new_tokens
    seq, r = prompt + new, cfg.roles
    if ref:  # the actor's folder unless roles.ref.model names another
        infos = {**infos, "ref": lm_info(cfg, r.ref.model, "ref", assume) if r.ref.model else infos["actor"]}
    # an update micro-batch: micro_batch_size rows, or with a token budget the budget's tokens (update_shape)
    train = {name: plans.update_shape(r[name], infos[name], seq, rows) for name in ("actor", "critic") if name in infos}
    # with rollout ranks the actor generates only the evaluation answers (eval.size > 0), on the trainer ranks
    placed = tuple(r.rollout.ranks)
    generate = eval_generation(cfg) if placed else (rollout, prompt, new)
    phases = {"actor": plans.lm_role_phases(r.actor, infos["actor"], generate=generate,
                                            forward=(rows, seq), train=train["actor"][0], label="experience forward"),
              "ref": plans.lm_role_phases(r.ref, infos.get("ref", infos["actor"]), forward=(rollout, seq),
                                          label="experience forward")}
    gathers = cfg.generation.mode == "gather" and (cfg.generation.engine == "hf" or bool(placed))  # vllm generates
    options = {"actor": {"full_gather": ("generation",) if gathers else (),
                         "gather_hint": "generation.mode=per_token"},
               "ref": plans.gather_options(r.ref, "experience forward")}
    if "critic" in infos:
        phases["critic"] = plans.lm_role_phases(r.critic, infos["critic"], forward=(rows, seq),
                                                train=train["critic"][0], logits=False,
                                                label="experience forward")
        options["critic"] = {"extra_trainable": P.transformer_dims(infos["critic"].config).hidden}
    budgets = [text for _, notes in train.values() for text in notes]
    plan = plans.declared_roles(cfg, infos, phases, title=title, notes=[note, *budgets, *rewards.notes], **options)
    plan.roles += rewards.roles
    if placed:  # the rollout engine on each rollout GPU, the roles above on the trainer GPUs (plans.plan_recipe)
        plan.rollout, plan.rollout_ranks = plans.RecipePlan("", rollout_plan(cfg, infos["actor"], rows)), placed
    else:
        plan.roles += rollout_plan(cfg, infos["actor"])
    plan.keys.update(rewards.keys)
    plan.packed += rewards.packed
    return plan

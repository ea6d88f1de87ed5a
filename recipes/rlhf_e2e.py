"""RLHF steps 1-3 in one run: SFT -> reward model -> PPO (or GRPO, or DPO), each step's export feeding the next.

    multiengine run rlhf_e2e --config tiny --nproc-per-node 2      # the embedded default, a few minutes on CPU
    multiengine run rlhf_e2e --config opt1.3b_opt350m --nproc-per-node 8

Each step runs its own recipe (rlhf_sft, rlhf_reward, rlhf_ppo) with the shipped config named here plus
overrides, under output_dir/{sft,reward,ppo}; every ``data.*`` key is passed to every step (each reads
its stage's rows of the data); this run fills in the model paths: step 1's actor is
step 3's actor and ref, step 2's reward model is step 3's reward model and critic (and, with
``reward.init_from_sft``, step 2 starts from step 1's model, as in InstructGPT). The embedded assets
(built-in dataset, tokenizer, random tiny OPT) are built once under output_dir/tiny.

A finished step is reused only when nothing it was made from changed: beside each step's summary.json a
fingerprint.json records the hash of the step's resolved config and the identity of its inputs (every
local file or folder the config names outside the step's own output_dir: content hashes of small files,
size + mtime of large ones). Any difference reruns the step (and, through its new exports, the steps
after it); ``rerun=true`` reruns all. The log and summary.json say which steps were reused and why.
Prints and writes the before/after figures (summary.json) and copies step 3's curves to
output_dir/curves.png.

``algorithm`` picks step 3 (see ``FINAL_STEP``): ``ppo`` (rlhf_ppo, section ``ppo``), ``grpo`` (rlhf_grpo,
section ``grpo``: the step-2 reward model is its reward) or ``dpo`` (rlhf_dpo, section ``dpo``: trained on
the preference pairs directly, so step 2 is skipped). Step 3 runs under output_dir/<algorithm>.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Any

import torch
from multiengine.engines.metrics import write_summary
from multiengine.recipes.common import (
    DATA_DEFAULTS,
    check_data,
    check_model,
    check_tokenizer,
    data_overrides,
    recipe_checks,
    uses_builtin_data,
)
from multiengine.engines.recipe_config import Choice, Range

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "output_dir": Key("outputs/rlhf_e2e", "each step runs under output_dir/<step>; the summary and curves here"),
    "seed": Key(0, "passed to every step"),
    "max_steps": Key(0, "steps of step 3; 0 = its config's"),
    "backend": Key("auto", "auto | deepspeed | torch, passed to every step"),
    "dist_timeout_s": Key(1800.0, "a collective that waits longer than this fails the run; passed to every step"),
    "data": Key({
        **DATA_DEFAULTS,
    }, "the data of every step (each step reads its stage's rows: sft, reward, ppo; docs/data.md)"),
    "model": Key({
        "pretrained": Key("", "step 1's base (a causal-LM folder or hub name); \"\" = the random tiny OPT"),
        "reward_pretrained": Key("", "step 2's base with reward.init_from_sft=false; \"\" = model.pretrained"),
    }, "the base models"),
    "sft": Key({
        "config": Key("tiny", "its shipped config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "step 1 (rlhf_sft)"),
    "reward": Key({
        "config": Key("tiny", "its shipped config"),
        "overrides": Key([], "key=value overrides for it"),
        "init_from_sft": Key(True, "start the reward model from step 1's model (InstructGPT) instead of a base"),
    }, "step 2 (rlhf_reward)"),
    "algorithm": Key("ppo", "step 3: ppo | grpo | dpo"),
    "ppo": Key({
        "config": Key("tiny", "its shipped config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "step 3 with algorithm=ppo (rlhf_ppo)"),
    "grpo": Key({
        "config": Key("tiny", "its shipped config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "step 3 with algorithm=grpo (rlhf_grpo)"),
    "dpo": Key({
        "config": Key("tiny", "its shipped config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "step 3 with algorithm=dpo (rlhf_dpo)"),
    "rerun": Key(False, "rerun every step, even those whose config and inputs did not change"),
    "overwrite": Key(False, "true: clear another recipe's run from output_dir first (this recipe's own steps are "
                            "reused or rerun anyway)"),
}
CHECKS = {**recipe_checks(DEFAULTS), "max_steps": Range(0), "backend": Choice("auto", "deepspeed", "torch"),
          "algorithm": Choice("ppo", "grpo", "dpo")}

# step 3 per algorithm: its recipe, whether it needs step 2's reward model, and the overrides that feed it
# step 1's actor (the ref is loaded from the same folder) and step 2's reward model
FINAL_STEP: dict[str, tuple[str, bool, Any]] = {
    "ppo": ("rlhf_ppo", True, lambda actor, rm: [f"model.actor={actor}", f"model.reward={rm}"]),
    "grpo": ("rlhf_grpo", True, lambda actor, rm: [f"model.actor={actor}", f"model.reward={rm}",
                                                   "reward.models=[{role: reward, weight: 1.0}]",
                                                   "reward.functions=[]"]),
    "dpo": ("rlhf_dpo", False, lambda actor, rm: [f"model.actor={actor}"]),
}




def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts: the base model folders and their tokenizers against their vocabularies, the data
    of every stage the steps read (SFT rows, preference pairs, prompts and evaluation prompts), and each step's
    batches against its rows on ``world_size`` ranks. The rest of the steps' own configs is checked when they
    load."""
    check_model("model.pretrained", cfg.model.pretrained)
    check_model("model.reward_pretrained", cfg.model.reward_pretrained)
    tok = check_tokenizer("model.pretrained", "", "model.pretrained", cfg.model.pretrained)
    if cfg.model.reward_pretrained and not cfg.reward.init_from_sft:
        check_tokenizer("model.reward_pretrained", "", "model.reward_pretrained", cfg.model.reward_pretrained)
    _, needs_rm, _ = FINAL_STEP[cfg.algorithm]
    reports = {"sft": check_data(cfg, "sft", tok), "reward": None, "ppo": None}
    if needs_rm or cfg.algorithm == "dpo":
        reports["reward"] = check_data(cfg, "reward", tok)
    if cfg.algorithm in ("ppo", "grpo"):
        reports["ppo"] = check_data(cfg, "ppo", tok, eval_stage="eval")
    _check_step_batches(cfg, reports, world_size)


def _check_step_batches(cfg: Any, reports: dict[str, Any], world_size: int) -> None:
    """Each step's batches (its recipe's check_batches) against the rows of its stage, with the step's config as
    _run_step loads it (its shipped config, the data keys, its overrides); the model folders it gets from the
    steps before do not exist yet and are not needed here. Built-in data has no report: nothing to check."""
    from multiengine.engines.recipe_config import RecipeConfigError, load_config, load_recipe

    recipe3, needs_rm, _ = FINAL_STEP[cfg.algorithm]
    steps = [("sft", "rlhf_sft", "sft")]
    if needs_rm:
        steps.append(("reward", "rlhf_reward", "reward"))
    steps.append((cfg.algorithm, recipe3, "reward" if cfg.algorithm == "dpo" else "ppo"))
    common = [f"seed={cfg.seed}", *data_overrides(cfg.data)]
    for section, recipe, stage in steps:
        if reports.get(stage) is None:
            continue
        step = cfg[section]
        step_cfg = load_config(recipe, step.config or None, [*common, *[str(o) for o in step.overrides]])
        try:
            load_recipe(recipe).check_batches(step_cfg, reports[stage], world_size,
                                              setting=f"{section}.overrides=[{{key}}={{n}}]")
        except RecipeConfigError as exc:
            raise RecipeConfigError(f"step {section} ({recipe} --config {step.config}): {exc}") from None


FINGERPRINT_FILE = "fingerprint.json"
_SMALL_FILE = 1 << 20  # files up to 1 MiB are identified by content, larger ones by size and mtime
_MAX_FILES = 5000  # per input folder


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _file_identity(path: str) -> str:
    st = os.stat(path)
    if st.st_size <= _SMALL_FILE:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    return f"size:{st.st_size}:mtime_ns:{st.st_mtime_ns}"


def path_identity(path: str) -> dict[str, str]:
    """``{relative file: identity}`` of a file or of every file under a folder (hidden ones and lock files
    skipped; at most 5000)."""
    if os.path.isfile(path):
        return {".": _file_identity(path)}
    out: dict[str, str] = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith(".lock"):
                continue
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = _file_identity(full)
            if len(out) >= _MAX_FILES:
                return out
    return out


def step_fingerprint(recipe: str, resolved: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """What a step's result depends on: its resolved config (hashed) and the identity of every existing
    local path its config names, except its own output_dir and what lies under it."""
    text = json.dumps(resolved, sort_keys=True, default=str)
    own = os.path.abspath(out_dir)
    cwd = os.path.abspath(os.getcwd())
    inputs: dict[str, dict[str, str]] = {}
    for value in sorted(set(_strings(resolved))):
        if not value or not os.path.exists(value):
            continue
        full = os.path.abspath(value)
        if full == own or full.startswith(own + os.sep) or cwd == full or cwd.startswith(full + os.sep):
            continue  # the step's own outputs, or a folder holding the working directory (".", "/")
        inputs[value] = path_identity(full)
    return {"recipe": recipe, "config_sha256": hashlib.sha256(text.encode()).hexdigest(), "config": resolved,
            "inputs": inputs}


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def reuse_reason(out_dir: str, fingerprint: dict[str, Any], rerun: bool) -> tuple[bool, str]:
    """``(reuse, why)`` for a step whose fingerprint would be ``fingerprint``."""
    if rerun:
        return False, "rerun=true"
    if not os.path.isfile(os.path.join(out_dir, "summary.json")):
        return False, "no summary.json yet"
    path = os.path.join(out_dir, FINGERPRINT_FILE)
    if not os.path.isfile(path):
        return False, f"summary.json has no {FINGERPRINT_FILE} beside it (an older or interrupted run)"
    with open(path, encoding="utf-8") as f:
        old = json.load(f)
    changes = []
    if old.get("config_sha256") != fingerprint["config_sha256"]:
        before, after = _flatten(old.get("config", {})), _flatten(fingerprint["config"])
        keys = sorted(k for k in set(before) | set(after) if before.get(k, "<unset>") != after.get(k, "<unset>"))
        shown = ", ".join(f"{k} ({before.get(k, '<unset>')!r} -> {after.get(k, '<unset>')!r})" for k in keys[:4])
        changes.append(f"config changed: {shown}{' ...' if len(keys) > 4 else ''}")
    old_inputs, new_inputs = old.get("inputs", {}), fingerprint["inputs"]
    for name in sorted(set(old_inputs) | set(new_inputs)):
        a, b = old_inputs.get(name), new_inputs.get(name)
        if a != b:
            files = sorted(k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k))
            changes.append(f"input {name} changed ({', '.join(files[:3])}{' ...' if len(files) > 3 else ''})")
    if changes:
        return False, "; ".join(changes)
    return True, "config and inputs unchanged since it ran"


def _on_every_rank(value: Any) -> Any:
    """Rank 0's value on every rank: one decision, so no rank runs a step the others skip (a hang)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _run_step(recipe: str, config: str, overrides: list[str], out_dir: str, rerun: bool,
              decisions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from multiengine.engines.recipe_config import checked_config, load_recipe
    from omegaconf import OmegaConf

    # CHECKS and validate(cfg): the step's inputs (earlier steps' exports) exist by now
    cfg = checked_config(recipe, config or None, [*overrides, f"output_dir={out_dir}"])
    fingerprint = step_fingerprint(recipe, OmegaConf.to_container(cfg, resolve=True), out_dir)
    is_main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    reuse, why = _on_every_rank(reuse_reason(out_dir, fingerprint, rerun) if is_main else None)
    summary_path = os.path.join(out_dir, "summary.json")
    decisions[recipe] = {"reused": reuse, "why": why}
    if reuse:
        logger.info("%s: reusing %s (%s)", recipe, out_dir, why)
        with open(summary_path) as f:
            return json.load(f)
    logger.info("=== %s (config %s) -> %s: running (%s)", recipe, config or "defaults", out_dir, why)
    if is_main and os.path.isfile(os.path.join(out_dir, FINGERPRINT_FILE)):
        os.remove(os.path.join(out_dir, FINGERPRINT_FILE))  # an interrupted rerun must not look finished
    load_recipe(recipe).main(cfg)
    # Engines of the finished step are garbage now; free them before the next step builds its own.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if is_main:
        write_summary(os.path.join(out_dir, FINGERPRINT_FILE), fingerprint)
    with open(summary_path) as f:
        return json.load(f)


def main(cfg: Any) -> dict[str, Any]:
    from multiengine.engines import EngineRegistry
    from multiengine.pipelines.rlhf.runs import prepare_tiny_assets

    out = cfg.output_dir
    os.makedirs(out, exist_ok=True)
    # the process group (created once, so its timeout is this run's for every step), and rank 0 builds the assets
    registry = EngineRegistry(backend=cfg.backend, timeout_s=cfg.dist_timeout_s)
    common = [f"seed={cfg.seed}", f"backend={cfg.backend}", f"dist_timeout_s={cfg.dist_timeout_s}"]
    assets: dict[str, str] = {}
    builtin = uses_builtin_data(cfg.data)
    if builtin or not cfg.model.pretrained:
        assets = prepare_tiny_assets(os.path.join(out, "tiny"), registry, cfg.seed)
    base = cfg.model.pretrained or assets["model"]
    # every step reads the same data (its own stage's rows of it)
    common.extend(data_overrides(cfg.data, assets["data"] if builtin else None))
    steps: dict[str, dict[str, Any]] = {}  # recipe -> {"reused": bool, "why": str}

    # 1. SFT: base model -> export/actor
    sft = _run_step("rlhf_sft", cfg.sft.config, [*common, f"model.pretrained={base}", *cfg.sft.overrides],
                    os.path.join(out, "sft"), cfg.rerun, steps)
    actor = sft["export"]["actor"]["model"]
    # 2. reward model: from the SFT model (InstructGPT) or a separate base (DeepSpeed-Chat) -> export/reward
    recipe, needs_rm, feed = FINAL_STEP[cfg.algorithm]
    reward: dict[str, Any] = {"metrics": {}, "export": {}}
    reward_path = None
    if needs_rm:
        rm_base = actor if cfg.reward.init_from_sft else (cfg.model.reward_pretrained or base)
        reward = _run_step("rlhf_reward", cfg.reward.config,
                           [*common, f"model.pretrained={rm_base}", *cfg.reward.overrides],
                           os.path.join(out, "reward"), cfg.rerun, steps)
        reward_path = reward["export"]["reward"]["model"]
    # 3. PPO / GRPO / DPO: actor and ref from step 1 (PPO: reward and critic from step 2; GRPO: reward)
    final = cfg[cfg.algorithm]
    ppo_overrides = [*common, *feed(actor, reward_path), *final.overrides]
    if cfg.max_steps:
        ppo_overrides.append(f"max_steps={cfg.max_steps}")
    ppo = _run_step(recipe, final.config, ppo_overrides, os.path.join(out, cfg.algorithm), cfg.rerun, steps)

    m_sft, m_rm, m_ppo = sft["metrics"], reward["metrics"], ppo["metrics"]
    a = cfg.algorithm  # figures of step 3 are named after it: ppo/judge_after, grpo/judge_after, ...
    figures = {
        "sft/judge": m_sft.get("eval/after/judge"),
        "sft/heldout_loss": m_sft.get("eval/after/heldout_loss"),
        "reward/heldout_accuracy": m_rm.get("heldout_accuracy"),
        "reward/heldout_accuracy_before": m_rm.get("heldout_accuracy_before"),
        f"{a}/judge_before": m_ppo.get("eval/before/judge"),
        f"{a}/judge_after": m_ppo.get("eval/after/judge"),
        f"{a}/reward_before": m_ppo.get("eval/before/reward"),
        f"{a}/reward_after": m_ppo.get("eval/after/reward"),
        f"{a}/kl_after": m_ppo.get("eval/after/kl"),
        f"{a}/step_s_mean": m_ppo.get("time/step_s_mean"),
        f"{a}/generation_s_mean": m_ppo.get("time/generation_s_mean"),
        f"{a}/experience_s_mean": m_ppo.get("time/experience_s_mean"),
        f"{a}/train_s_mean": m_ppo.get("time/train_s_mean"),
        "sft/step_s_mean": m_sft.get("step_time_s_mean"),
        "reward/step_s_mean": m_rm.get("step_time_s_mean"),
    }
    plot = ppo.get("plot")
    if registry.is_main:
        if plot and os.path.isfile(plot):
            shutil.copyfile(plot, os.path.join(out, "curves.png"))
            plot = os.path.join(out, "curves.png")
        write_summary(os.path.join(out, "summary.json"), {
            "recipe": "rlhf_e2e", "world_size": registry.world_size, "figures": figures, "plot": plot,
            "algorithm": a, "step_runs": steps,
            "steps": {"sft": sft, **({"reward": reward} if needs_rm else {}), a: ppo}})
        logger.info("steps: %s", "; ".join(f"{k} {'reused' if v['reused'] else 'ran'} ({v['why']})"
                                            for k, v in steps.items()))
        if figures[f"{a}/judge_before"] is not None:
            logger.info(
                "RLHF on the built-in task: judge score of the actor's sampled answers %.3f after SFT -> %.3f after "
                "%s (KL to the SFT model %.3f nats per answer)%s", figures[f"{a}/judge_before"],
                figures[f"{a}/judge_after"], a.upper(), figures[f"{a}/kl_after"] or float("nan"),
                f"; reward-model held-out pair accuracy {figures['reward/heldout_accuracy']:.3f}" if needs_rm else "")
    return {"figures": figures, "plot": plot, "step_runs": steps,
            "export": {"actor": ppo["export"].get("actor"), "reward": reward["export"].get("reward")}}

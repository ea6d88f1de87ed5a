"""RLHF steps 1-3 in one run: SFT -> reward model -> PPO (or GRPO, or DPO), each step's export feeding the next.

    multiengine run rlhf_e2e --config tiny --nproc-per-node 2      # the embedded default, a few minutes on CPU
    multiengine run rlhf_e2e --config opt1.3b_opt350m --nproc-per-node 8

Each step runs its own recipe (rlhf_sft, rlhf_reward, then ``algorithm``'s: see ``FINAL_STEP``) with the shipped
config named here plus overrides, under output_dir/<step>, on the shared lifecycle. Every ``data.*`` key and the
common keys reach every step; this run fills in the model paths: step 1's actor is step 3's actor and ref, step 2's
reward model is step 3's reward model (and PPO's critic); with ``reward.init_from_sft`` step 2 starts from step 1's
model, as in InstructGPT. DPO trains on the preference pairs directly, so step 2 is skipped. A finished step is
reused only while its resolved config and inputs are unchanged (engines/recipe_steps.py; ``rerun=true`` reruns
all); the log and summary.json say which steps were reused and why. Step 3's curves are copied to
output_dir/curves.png.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

from multiengine.engines.recipe_config import Choice, Key, Range, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.recipe_steps import FINGERPRINT_FILE, run_step
from multiengine.recipes import common, plans

__all__ = ["FINAL_STEP", "FINGERPRINT_FILE", "main", "steps", "validate"]

logger = logging.getLogger(__name__)

# The common keys, except those a run of runs does not own: each step checkpoints and resumes as its own config
# says (a step's resume_from goes in its overrides), and a finished step is reused by its fingerprint.
PASSED_TO_STEPS = ("seed", "backend", "dist_timeout_s", "trust_remote_code", "tensorboard", "plot", "report_to",
                   "nonfinite")
_STEP = functools.partial(common.run_keys, config="its shipped config", overrides="key=value overrides for it")
KEYS: dict[str, Any] = {
    **{k: v for k, v in COMMON_KEYS.items() if k not in ("checkpoint", "resume_from")},
    "output_dir": Key("outputs/rlhf_e2e", "each step runs under output_dir/<step>; the summary and curves here"),
    "max_steps": Key(0, "steps of step 3; 0 = its config's", Range(0)),
    "data": Key(dict(common.DATA_KEYS), "the data of every step (each step reads its stage's rows: sft, reward, ppo; "
                                        "docs/data.md)"),
    "model": Key({
        "pretrained": Key("", "step 1's base (a causal-LM folder or hub name); \"\" = the random tiny OPT"),
        "reward_pretrained": Key("", "step 2's base with reward.init_from_sft=false; \"\" = model.pretrained"),
    }, "the base models"),
    "sft": _STEP("step 1 (rlhf_sft)"),
    "reward": Key({**_STEP("").default, "init_from_sft": Key(True, "start the reward model from step 1's model "
                                                                   "(InstructGPT) instead of a base")},
                  "step 2 (rlhf_reward)"),
    "algorithm": Key("ppo", "step 3: ppo | grpo | dpo", Choice("ppo", "grpo", "dpo")),
    "ppo": _STEP("step 3 with algorithm=ppo (rlhf_ppo)"),
    "grpo": _STEP("step 3 with algorithm=grpo (rlhf_grpo)"),
    "dpo": _STEP("step 3 with algorithm=dpo (rlhf_dpo)"),
    "rerun": Key(False, "rerun every step, even those whose config and inputs did not change"),
    "overwrite": Key(False, "true: clear another recipe's run from output_dir first (this recipe's own steps are "
                            "reused or rerun anyway)"),
}

DEFAULTS, HELP = split_keys(KEYS)
for _key in PASSED_TO_STEPS:
    HELP[_key] += " (passed to every step)"
# Its roles are its steps' (rlhf_sft, rlhf_reward and the final recipe each declare theirs).
ROLES: tuple = ()

# step 3 per algorithm: its recipe, whether it needs step 2's reward model, and the overrides that feed it
# step 1's actor (the ref is loaded from the same folder) and step 2's reward model
FINAL_STEP: dict[str, tuple[str, bool, Any]] = {
    "ppo": ("rlhf_ppo", True, lambda actor, rm: [f"roles.actor.model={actor}", f"roles.reward.model={rm}"]),
    "grpo": ("rlhf_grpo", True, lambda actor, rm: [f"roles.actor.model={actor}", f"roles.reward.model={rm}",
                                                   "reward.models=[{role: reward, weight: 1.0}]",
                                                   "reward.functions=[]"]),
    "dpo": ("rlhf_dpo", False, lambda actor, rm: [f"roles.actor.model={actor}"]),
}
# the overrides that give steps 1 and 2 their base model
BASE_MODEL = {"rlhf_sft": "roles.actor.model", "rlhf_reward": "roles.reward.model"}


def steps(cfg: Any) -> list[tuple[str, str, str]]:
    """``(section, recipe, data stage)`` of each step the config runs: SFT, the reward model unless step 3 is DPO
    (which trains on the pairs directly), then step 3."""
    recipe, needs_rm, _ = FINAL_STEP[cfg.algorithm]
    return [("sft", "rlhf_sft", "sft"), *([("reward", "rlhf_reward", "reward")] if needs_rm else []),
            (cfg.algorithm, recipe, "reward" if cfg.algorithm == "dpo" else "ppo")]


def validate(cfg: Any, world_size: int = 1) -> None:
    """Before any rank starts: the base model folders and their tokenizers against their vocabularies, the data
    of every stage the steps read (SFT rows, preference pairs, prompts and evaluation prompts), and each step's
    batches against its rows on ``world_size`` ranks. The rest of the steps' own configs is checked when they
    load."""
    from multiengine.engines.recipe_config import RecipeConfigError, load_config, load_recipe

    common.check_model("model.pretrained", cfg.model.pretrained)
    common.check_model("model.reward_pretrained", cfg.model.reward_pretrained)
    tok = common.check_tokenizer("model.pretrained", "", "model.pretrained", cfg.model.pretrained)
    if cfg.model.reward_pretrained and not cfg.reward.init_from_sft:
        common.check_tokenizer("model.reward_pretrained", "", "model.reward_pretrained", cfg.model.reward_pretrained)
    shared = [f"seed={cfg.seed}", *common.data_overrides(cfg.data)]
    for section, recipe, stage in steps(cfg):
        report = common.check_data(cfg, stage, tok, eval_stage="eval" if stage == "ppo" else None)
        if report is None:  # built-in data: nothing to check
            continue
        # the step's batches against its rows, with its config as run_step loads it (the model folders it gets
        # from the steps before do not exist yet and are not needed here)
        step = cfg[section]
        step_cfg = load_config(recipe, step.config or None, [*shared, *[str(o) for o in step.overrides]])
        try:
            load_recipe(recipe).check_batches(step_cfg, report, world_size,
                                              setting=f"{section}.overrides=[{{key}}={{n}}]")
        except RecipeConfigError as exc:
            raise RecipeConfigError(f"step {section} ({recipe} --config {step.config}): {exc}") from None


def _passed_overrides(cfg: Any) -> list[str]:
    """The common keys every step gets, as overrides."""
    out = []
    for key in PASSED_TO_STEPS:
        value = cfg[key]
        if isinstance(value, Mapping):
            out += [f"{key}.{k}={v}" for k, v in value.items()]
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


class RLHFE2E(Recipe):
    """A run of runs on the shared lifecycle: setup (the process group, output folder policy, metrics), train
    (the three steps, each its own recipe with its own registry on these ranks), export (the last step's
    models), summary and curves."""

    name = "rlhf_e2e"

    def build(self) -> None:
        from multiengine.pipelines.rlhf.runs import prepare_tiny_assets

        cfg = self.cfg
        # the embedded assets (built-in data, tokenizer, random tiny OPT), built once by rank 0
        self.builtin = common.uses_builtin_data(cfg.data)
        self.assets: dict[str, str] = {}
        if self.builtin or not cfg.model.pretrained:
            self.assets = prepare_tiny_assets(self.path("tiny"), self.registry, cfg.seed)
        self.decisions: dict[str, dict[str, Any]] = {}  # recipe -> {"reused": bool, "why": str}
        self.results: dict[str, dict[str, Any]] = {}

    def train(self) -> None:
        cfg, out = self.cfg, self.output_dir
        base = cfg.model.pretrained or self.assets["model"]
        # every step gets the common keys and reads the same data (its own stage's rows of it)
        data = common.data_overrides(cfg.data, self.assets["data"] if self.builtin else None)
        shared = [*_passed_overrides(cfg), *data]
        # 1. SFT: base model -> export/actor
        sft = run_step("rlhf_sft", cfg.sft.config, [*shared, f"{BASE_MODEL['rlhf_sft']}={base}", *cfg.sft.overrides],
                       os.path.join(out, "sft"), cfg.rerun, self.decisions)
        actor = sft["export"]["actor"]["model"]
        # 2. reward model: from the SFT model (InstructGPT) or a separate base (DeepSpeed-Chat) -> export/reward
        recipe, needs_rm, feed = FINAL_STEP[cfg.algorithm]
        reward: dict[str, Any] = {"metrics": {}, "export": {}}
        reward_path = None
        if needs_rm:
            rm_base = actor if cfg.reward.init_from_sft else (cfg.model.reward_pretrained or base)
            reward = run_step("rlhf_reward", cfg.reward.config,
                              [*shared, f"{BASE_MODEL['rlhf_reward']}={rm_base}", *cfg.reward.overrides],
                              os.path.join(out, "reward"), cfg.rerun, self.decisions)
            reward_path = reward["export"]["reward"]["model"]
        # 3. PPO / GRPO / DPO: actor and ref from step 1 (PPO: reward and critic from step 2; GRPO: reward)
        final = cfg[cfg.algorithm]
        overrides = [*shared, *feed(actor, reward_path), *final.overrides]
        if cfg.max_steps:
            overrides.append(f"max_steps={cfg.max_steps}")
        last = run_step(recipe, final.config, overrides, os.path.join(out, cfg.algorithm), cfg.rerun, self.decisions)
        self.results = {"sft": sft, **({"reward": reward} if needs_rm else {}), cfg.algorithm: last}
        self.step = int(last.get("metrics", {}).get("steps") or 0)
        # 4. the figures of the whole run, as one record of metrics.jsonl
        self.figures = _figures(cfg.algorithm, sft["metrics"], reward["metrics"], last["metrics"])
        self.metrics.log(self.step, {k: v for k, v in self.figures.items() if isinstance(v, (int, float))},
                         prefix="e2e")

    def export(self) -> dict[str, Any]:
        last = self.results[self.cfg.algorithm]["export"]
        reward = self.results.get("reward", {}).get("export", {})
        return {k: v for k, v in {"actor": last.get("actor"), "reward": reward.get("reward")}.items() if v}

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        return {"recipe": self.name, "world_size": self.registry.world_size, "metrics": self.figures,
                "figures": self.figures, "algorithm": self.cfg.algorithm, "step_runs": self.decisions,
                "steps": self.results, "export": export, "config": OmegaConf.to_container(self.cfg, resolve=True)}

    def plot(self) -> str | None:
        """Step 3's curves, copied to output_dir/curves.png."""
        plot = self.results[self.cfg.algorithm].get("plot")
        if not plot or not os.path.isfile(plot):
            return None
        if self.registry.is_main:
            shutil.copyfile(plot, self.path("curves.png"))
        return self.path("curves.png")

    def closing_summary(self, export: dict[str, Any], plot: str | None, seconds: float) -> str:
        a, f = self.cfg.algorithm, self.figures
        lines = ["rlhf_e2e: " + "; ".join(f"{k} {'reused' if v['reused'] else 'ran'} ({v['why']})"
                                           for k, v in self.decisions.items())]
        if isinstance(f.get(f"{a}/judge_before"), (int, float)) and isinstance(f.get(f"{a}/judge_after"), (int, float)):
            kl = f.get(f"{a}/kl_after")
            lines.append(f"  judge score of the actor's sampled answers: {f[f'{a}/judge_before']:.3f} after SFT -> "
                         f"{f[f'{a}/judge_after']:.3f} after {a.upper()}"
                         + (f" (KL to the SFT model {kl:.3f} nats per answer)" if isinstance(kl, float) else ""))
        if isinstance(f.get("reward/heldout_accuracy"), (int, float)):
            lines.append(f"  reward-model held-out pair accuracy: {f['reward/heldout_accuracy']:.3f}")
        for role, value in export.items():
            lines.append(f"  export ({role}): {value.get('model') if isinstance(value, dict) else value}")
        lines.append(f"  summary: {self.path('summary.json')}")
        if plot:
            lines.append(f"  curves: {plot}")
        return "\n".join(lines)


def _figures(a: str, m_sft: dict[str, Any], m_rm: dict[str, Any], m_last: dict[str, Any]) -> dict[str, Any]:
    """The run's figures; those of step 3 are named after its algorithm (ppo/judge_after, grpo/judge_after, ...)."""
    return {
        "sft/judge": m_sft.get("eval/after/judge"),
        "sft/heldout_loss": m_sft.get("eval/after/heldout_loss"),
        "reward/heldout_accuracy": m_rm.get("heldout_accuracy"),
        "reward/heldout_accuracy_before": m_rm.get("heldout_accuracy_before"),
        f"{a}/judge_before": m_last.get("eval/before/judge"),
        f"{a}/judge_after": m_last.get("eval/after/judge"),
        f"{a}/reward_before": m_last.get("eval/before/reward"),
        f"{a}/reward_after": m_last.get("eval/after/reward"),
        f"{a}/kl_after": m_last.get("eval/after/kl"),
        f"{a}/step_s_mean": m_last.get("time/step_s_mean"),
        f"{a}/generation_s_mean": m_last.get("time/generation_s_mean"),
        f"{a}/experience_s_mean": m_last.get("time/experience_s_mean"),
        f"{a}/train_s_mean": m_last.get("time/train_s_mean"),
        "sft/step_s_mean": m_sft.get("step_time_s_mean"),
        "reward/step_s_mean": m_rm.get("step_time_s_mean"),
    }


main = RLHFE2E.main
plan = plans.rlhf_e2e  # what `multiengine plan` sees of this recipe

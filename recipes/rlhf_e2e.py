"""RLHF steps 1-3 in one run: SFT -> reward model -> PPO (or GRPO, or DPO), each step's export feeding the next.

    multiengine run rlhf_e2e --config tiny --nproc-per-node 2      # the embedded default, a few minutes on CPU
    multiengine run rlhf_e2e --config opt1.3b_opt350m --nproc-per-node 8

Each step runs its own recipe (rlhf_sft, rlhf_reward, then ``algorithm``'s: see ``FINAL_STEP``) with the shipped
config named here plus overrides, under output_dir/<step>, on the shared lifecycle. The ``data.*`` keys and the common
keys of ``PASSED_TO_STEPS`` reach every step; this run fills in the model paths: step 1's actor is step 3's actor and
ref, step 2's reward model is step 3's reward model (and PPO's critic); with ``reward.init_from_sft`` step 2 starts
from step 1's model, as in InstructGPT. DPO trains on the preference pairs directly, so step 2 is skipped. A finished
step is reused only while its resolved config and inputs are unchanged (language/steps.py; ``rerun=true`` reruns
all); the log and summary.json say which steps were reused and why. Step 3's curves are copied to
output_dir/curves.png.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from multiengine.engines.settings import Choice, Range, Settings, section, setting
from multiengine.pipelines.rlhf.data import DataSettings
from multiengine.recipes import common
from multiengine.recipes.common import run_step
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import RecipeConfigError, load_config, load_recipe
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.steps import FINGERPRINT_FILE

__all__ = ["FINAL_STEP", "FINGERPRINT_FILE", "RECIPE", "steps"]

logger = logging.getLogger(__name__)

# The common keys every step gets (a step checkpoints and resumes as its own config says, and a finished step is
# reused by its fingerprint: this run has no checkpoint or resume_from of its own).
PASSED_TO_STEPS = ("seed", "backend", "dist_timeout_s", "trust_remote_code", "tensorboard", "plot", "report_to",
                   "nonfinite")


@dataclass(frozen=True)
class BaseModels(Settings):
    pretrained: str = setting("", "step 1's base (a causal-LM folder or hub name); \"\" = the random tiny OPT")
    reward_pretrained: str = setting("", "step 2's base with reward.init_from_sft=false; \"\" = model.pretrained")


@dataclass(frozen=True)
class RewardStep(common.StepRun):
    init_from_sft: bool = setting(True, "start the reward model from step 1's model (InstructGPT) instead of a base")


@dataclass(frozen=True)
class E2EConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_e2e", "each step runs under output_dir/<step>; the summary and curves here")
    max_steps: int = setting(0, "steps of step 3; 0 = its config's", Range(0))
    overwrite: bool = setting(False, "true: clear another recipe's run from output_dir first (this recipe's own steps "
                                     "are reused or rerun anyway)")
    data: DataSettings = section(DataSettings, "the data of every step (each step reads its stage's rows: sft, "
                                               "reward, ppo; docs/data.md)")
    model: BaseModels = section(BaseModels, "the base models")
    sft: common.StepRun = section(common.StepRun, "step 1 (rlhf_sft)")
    reward: RewardStep = section(RewardStep, "step 2 (rlhf_reward)")
    algorithm: str = setting("ppo", "step 3: ppo | grpo | dpo", Choice("ppo", "grpo", "dpo"))
    ppo: common.StepRun = section(common.StepRun, "step 3 with algorithm=ppo (rlhf_ppo)")
    grpo: common.StepRun = section(common.StepRun, "step 3 with algorithm=grpo (rlhf_grpo)")
    dpo: common.StepRun = section(common.StepRun, "step 3 with algorithm=dpo (rlhf_dpo)")
    rerun: bool = setting(False, "rerun every step, even those whose config and inputs did not change")


# step 3 per algorithm: its recipe, whether it needs step 2's reward model, and the overrides that feed it step 1's
# actor (the ref is loaded from the same folder) and step 2's reward model
FINAL_STEP: dict[str, tuple[str, bool, Any]] = {
    "ppo": ("rlhf_ppo", True, lambda actor, rm: [f"roles.actor.model={actor}", f"roles.reward.model={rm}"]),
    "grpo": ("rlhf_grpo", True, lambda actor, rm: [f"roles.actor.model={actor}", f"roles.reward.model={rm}",
                                                   "reward.models=[{role: reward, weight: 1.0}]",
                                                   "reward.functions=[]"]),
    "dpo": ("rlhf_dpo", False, lambda actor, rm: [f"roles.actor.model={actor}"]),
}
# the overrides that give steps 1 and 2 their base model
BASE_MODEL = {"rlhf_sft": "roles.actor.model", "rlhf_reward": "roles.reward.model"}


def steps(cfg: E2EConfig) -> list[tuple[str, str, str]]:
    """``(section, recipe, data stage)`` of each step the config runs: SFT, the reward model unless step 3 is DPO
    (which trains on the pairs directly), then step 3."""
    recipe, needs_rm, _ = FINAL_STEP[cfg.algorithm]
    return [("sft", "rlhf_sft", "sft"), *([("reward", "rlhf_reward", "reward")] if needs_rm else []),
            (cfg.algorithm, recipe, "reward" if cfg.algorithm == "dpo" else "ppo")]


def _passed_overrides(cfg: E2EConfig) -> list[str]:
    """The common keys every step gets, as overrides."""
    out = []
    for key in PASSED_TO_STEPS:
        value = getattr(cfg, key)
        if isinstance(value, Settings):
            out += [f"{key}.{k}={v}" for k, v in value.to_dict().items()]
        else:
            out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out


class RLHFE2E(Recipe):
    """A run of runs on the shared lifecycle: setup (the process group, output folder policy, metrics; build: the tiny
    assets and the keys every step gets), train (train_step runs the next step: its own recipe with its own registry
    on these ranks), export (the last step's models), summary and curves. Its roles are its steps'."""

    name = "rlhf_e2e"
    Config = E2EConfig
    omit = ("checkpoint", "resume_from")

    @classmethod
    def validate(cls, cfg: E2EConfig, world_size: int = 1) -> None:
        """Before any rank starts: the base model folders and their tokenizers against their vocabularies, the data
        of every stage the steps read, and each step's batches against its rows on ``world_size`` ranks (the rest of
        a step's own config is checked when it runs)."""
        common.check_model("model.pretrained", cfg.model.pretrained)
        common.check_model("model.reward_pretrained", cfg.model.reward_pretrained)
        tok = common.check_tokenizer("model.pretrained", "", "model.pretrained", cfg.model.pretrained)
        if cfg.model.reward_pretrained and not cfg.reward.init_from_sft:
            common.check_tokenizer("model.reward_pretrained", "", "model.reward_pretrained",
                                   cfg.model.reward_pretrained)
        if any(name == "reward" for name, _, _ in steps(cfg)):  # step 2 exports its reward model for step 3
            key = "model.reward_pretrained" if cfg.model.reward_pretrained and not cfg.reward.init_from_sft else \
                "model.pretrained"
            common.check_scalar_export(key, getattr(cfg.model, key.split(".")[1]), "step 2's reward model",
                                       "algorithm=dpo (no reward model)")
        shared = [f"seed={cfg.seed}", *cfg.data.overrides()]
        for name, recipe, stage in steps(cfg):
            report = common.check_data(cfg, stage, tok, eval_stage="eval" if stage == "ppo" else None)
            if report is None:  # built-in data: nothing to check
                continue
            # the step's batches against its rows, with its config as run_step loads it (the model folders it gets
            # from the steps before do not exist yet and are not needed here)
            step = getattr(cfg, name)
            step_cfg = load_config(recipe, step.config or None, [*shared, *step.overrides])
            try:
                load_recipe(recipe).check_batches(step_cfg, report, world_size,
                                                  setting=f"{name}.overrides=[{{key}}={{n}}]")
            except RecipeConfigError as exc:
                raise RecipeConfigError(f"step {name} ({recipe} --config {step.config}): {exc}") from None

    @classmethod
    def plan(cls, cfg: E2EConfig, assume: Any = None) -> list[plans.RecipePlan]:
        """The steps rlhf_e2e runs one after another, each planned on its own."""
        shared = [f"seed={cfg.seed}", f"backend={cfg.backend}"]
        base = cfg.model.pretrained
        # the reward model starts from the SFT export (same architecture as the base) or its own base
        rm_base = base if cfg.reward.init_from_sft else (cfg.model.reward_pretrained or base)
        models = {"sft": [f"{BASE_MODEL['rlhf_sft']}={base}"] if base else [],
                  "reward": [f"{BASE_MODEL['rlhf_reward']}={rm_base}"] if rm_base else [],
                  cfg.algorithm: FINAL_STEP[cfg.algorithm][2](base, rm_base)}
        out = []
        for name, recipe, _ in steps(cfg):
            step = getattr(cfg, name)
            sub = load_config(recipe, step.config or None, [*shared, *models[name], *step.overrides])
            for item in load_recipe(recipe).plan(sub, assume):
                item.title = f"rlhf_e2e step {recipe} (config {step.config or 'defaults'})"
                item.overrides_key = f"{name}.overrides"
                out.append(item)
        return out

    def build(self) -> None:
        from multiengine.pipelines.rlhf.runs import prepare_tiny_assets

        cfg = self.cfg
        # the embedded assets (built-in data, tokenizer, random tiny OPT), built once by rank 0
        self.assets: dict[str, str] = {}
        if cfg.data.builtin or not cfg.model.pretrained:
            self.assets = prepare_tiny_assets(self.path("tiny"), self.registry, cfg.seed)
        # every step gets the common keys and reads the same data (its own stage's rows of it)
        self.shared = [*_passed_overrides(cfg), *cfg.data.overrides(self.assets["data"] if cfg.data.builtin else None)]
        self.decisions: dict[str, dict[str, Any]] = {}  # recipe -> {"reused": bool, "why": str}
        self.results: dict[str, dict[str, Any]] = {}  # step -> its run's metrics, export, plot

    def train_step(self) -> dict[str, Any]:
        """The next step, its models from the steps before: 1. SFT: base model -> export/actor; 2. the reward model
        from the SFT model (InstructGPT) or a separate base (DeepSpeed-Chat) -> export/reward; 3. PPO / GRPO / DPO:
        actor and ref from step 1 (PPO: reward and critic from step 2; GRPO: reward)."""
        cfg, done = self.cfg, self.results
        name, recipe, _ = steps(cfg)[len(done)]
        base = cfg.model.pretrained or self.assets["model"]
        if name == "sft":
            models = [f"{BASE_MODEL[recipe]}={base}"]
        elif name == "reward":
            rm_base = done["sft"]["export"]["actor"]["model"] if cfg.reward.init_from_sft else \
                (cfg.model.reward_pretrained or base)
            models = [f"{BASE_MODEL[recipe]}={rm_base}"]
        else:
            reward_path = done["reward"]["export"]["reward"]["model"] if "reward" in done else None
            models = FINAL_STEP[name][2](done["sft"]["export"]["actor"]["model"], reward_path)
        step = getattr(cfg, name)
        last = [f"max_steps={cfg.max_steps}"] if cfg.max_steps and name == cfg.algorithm else []
        done[name] = run_step(recipe, step.config, [*self.shared, *models, *step.overrides, *last],
                              os.path.join(self.output_dir, name), cfg.rerun, self.decisions)
        return done[name]["metrics"]

    def train(self) -> None:
        """Each step in turn, then the figures of the whole run as one record of metrics.jsonl."""
        cfg = self.cfg
        while len(self.results) < len(steps(cfg)):
            self.train_step()
        last = self.results[cfg.algorithm]
        self.step = int(last.get("metrics", {}).get("steps") or 0)
        self.figures = _figures(cfg.algorithm, self.results["sft"]["metrics"],
                                self.results.get("reward", {}).get("metrics", {}), last["metrics"])
        self.metrics.log(self.step, {k: v for k, v in self.figures.items() if isinstance(v, (int, float))},
                         prefix="e2e")

    def export(self) -> dict[str, Any]:
        last = self.results[self.cfg.algorithm]["export"]
        reward = self.results.get("reward", {}).get("export", {})
        return {k: v for k, v in {"actor": last.get("actor"), "reward": reward.get("reward")}.items() if v}

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        return {"recipe": self.name, "world_size": self.registry.world_size, "metrics": self.figures,
                "figures": self.figures, "algorithm": self.cfg.algorithm, "step_runs": self.decisions,
                "steps": self.results, "export": export, "config": self.cfg.to_dict()}

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
        "sft/judge": m_sft.get("eval/after/judge"), "sft/heldout_loss": m_sft.get("eval/after/heldout_loss"),
        "reward/heldout_accuracy": m_rm.get("heldout_accuracy"),
        "reward/heldout_accuracy_before": m_rm.get("heldout_accuracy_before"),
        f"{a}/judge_before": m_last.get("eval/before/judge"), f"{a}/judge_after": m_last.get("eval/after/judge"),
        f"{a}/reward_before": m_last.get("eval/before/reward"), f"{a}/reward_after": m_last.get("eval/after/reward"),
        f"{a}/kl_after": m_last.get("eval/after/kl"), f"{a}/step_s_mean": m_last.get("time/step_s_mean"),
        f"{a}/generation_s_mean": m_last.get("time/generation_s_mean"),
        f"{a}/experience_s_mean": m_last.get("time/experience_s_mean"),
        f"{a}/train_s_mean": m_last.get("time/train_s_mean"),
        "sft/step_s_mean": m_sft.get("step_time_s_mean"), "reward/step_s_mean": m_rm.get("step_time_s_mean"),
    }


RECIPE = RLHFE2E

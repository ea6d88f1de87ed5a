"""The one lifecycle every recipe shares: setup -> train -> export -> summary, with checkpoints and resume.

A :class:`Recipe` subclass declares ``name``, ``roles``, ``Config`` (a :class:`RunConfig`), ``renamed``,
``validate`` and ``plan``, and fills in ``build``, ``train_step`` (metrics already means over ranks), ``evaluate``,
``export``, ``state_dict`` / ``load_state_dict``, ``summary_metrics`` and ``plot_panels``. The base does the rest:
output folder, seeding, registry, metrics, the loop with evaluation and checkpoints, resume, summary.json, curves.png
and the ``nonfinite`` policy (``stop``: exit 3; ``skip``: until ``max_skips``), decided on values summed over ranks."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from multiengine.engines import (
    EngineRegistry,
    MetricsLogger,
    NonFiniteError,
    gather_memory,
    latest_tag,
    plot_curves,
    read_jsonl,
    set_trust_remote_code,
    sum_over_ranks,
    write_summary,
)
from multiengine.engines.metrics import WANDB_FIX, WANDB_MISSING
from multiengine.engines.settings import (
    Choice,
    Length,
    Range,
    Satisfies,
    Settings,
    reads_of,
    section,
    setting,
    track_reads,
    tracking_reads,
)
from tqdm import tqdm

from .config import KEY_READS_ENV, RecipeConfigError, config_problem, inactive_keys

logger = logging.getLogger(__name__)
LAUNCH_KEYS = ("overwrite",)  # keys the launching process uses before any rank starts (never read by a rank)

__all__ = ["RUN_FILE", "RUN_OUTPUTS", "CheckpointSettings", "NonfiniteSettings", "Recipe", "RunConfig",
           "check_output_dir", "clear_output_dir", "folder_run", "mark_run"]


def _resume_source(value: Any) -> bool:
    if value in ("", "latest"):
        return True
    path = os.path.expanduser(str(value))
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in ("manifest.json", "latest"))


@dataclass(frozen=True)
class CheckpointSettings(Settings):
    every: int = setting(0, "every N steps, and at the end of the run (0 = never)", Range(0))
    keep_last: int | None = setting(2, "keep the newest K (null = all)", Range(1), when="every")


@dataclass(frozen=True)
class NonfiniteSettings(Settings):
    policy: str = setting("stop", "stop: end the run (exit 3), the last checkpoint kept | skip: go on, up to "
                                  "max_skips", Choice("stop", "skip"))
    max_skips: int = setting(10, "skip: the run stops at the step that would be skip number max_skips + 1",
                             Range(0), when="policy=skip")


@dataclass(frozen=True)
class RunConfig(Settings):
    """The keys every recipe shares; a recipe's Config adds its sections (and may change these defaults)."""

    output_dir: str = setting("outputs/recipe", "everything the run writes goes under this folder", Length(1))
    seed: int = setting(0, "one seed for data order, sampling and initialisation (each rank gets seed + rank)",
                        Range(0, 2**32 - 1))
    max_steps: int = setting(100, "optimizer steps", Range(1))
    backend: str = setting("auto", "auto | deepspeed | torch", Choice("auto", "deepspeed", "torch"))
    resume_from: str = setting("", "\"\" | \"latest\" (output_dir/checkpoints; fresh start if none) | a checkpoint "
                                    "folder", Satisfies(_resume_source, "'', 'latest' or a checkpoint folder "
                                                        "(manifest.json, or a 'latest' file in it)"))
    overwrite: bool = setting(False, "true: clear the earlier run's files in output_dir (metrics, summary, curves, "
                                     "TensorBoard, checkpoints, exports, logs) before starting; false: a folder "
                                     "holding another recipe's run or a finished run is refused")
    dist_timeout_s: float = setting(1800.0, "a collective that waits longer than this fails the run",
                                    Range(0, min_exclusive=True))
    checkpoint: CheckpointSettings = section(CheckpointSettings, "checkpoints under output_dir/checkpoints (written "
                                             "atomically; `latest` names the newest)")
    nonfinite: NonfiniteSettings = section(NonfiniteSettings, "a NaN/inf loss or gradient norm at a step (no role "
                                           "ever applies such an update)")
    trust_remote_code: bool = setting(False, "DANGEROUS: true lets transformers run Python files shipped in a model "
                                             "or tokenizer folder; only for folders whose code you have read")
    tensorboard: bool = setting(True, "TensorBoard events beside metrics.jsonl (and SD validation images)")
    plot: bool = setting(True, "curves.png of the main figures")
    report_to: str = setting("none", "none | wandb: also send the scalars (and SD validation images) to Weights & "
                                     "Biases (needs `pip install wandb`; project from WANDB_PROJECT, default "
                                     "\"multiengine\"; WANDB_MODE=offline works without a login)",
                             Choice("none", "wandb"))
    roles: Any = field(default=None, metadata={"hidden": True})  # the declared roles (Roles), set by the loader


# --- output_dir: one run per folder ------------------------------------------------------------------------
RUN_FILE = "run.json"  # {"recipe": ...}, written when a run starts: what an unfinished folder holds
# What a run writes into output_dir; overwrite=true clears these. The rest is kept: inputs a run builds there
# and reuses (tiny/ models and data, generated images, an SFT model trained under sft/), each checked on reuse.
RUN_OUTPUTS = (RUN_FILE, "summary.json", "metrics.jsonl", "curves.png", "fingerprint.json", "tensorboard",
               "checkpoints", "export", "validation", "wandb", "logs")
# any of these makes a folder a run folder (logs/ alone is left by a run that failed its checks)
_RUN_MARKS = (RUN_FILE, "summary.json", "metrics.jsonl")


def _read_recipe(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("recipe")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def folder_run(output_dir: str) -> dict[str, Any] | None:
    """What run ``output_dir`` holds: ``{"recipe": name or None, "finished": summary.json exists, "outputs":
    [the run files there]}``; None when it holds none (missing, empty, or only inputs and logs)."""
    folder = os.path.expanduser(str(output_dir))
    if not os.path.isdir(folder) or not any(os.path.lexists(os.path.join(folder, m)) for m in _RUN_MARKS):
        return None
    recipe = _read_recipe(os.path.join(folder, RUN_FILE)) or _read_recipe(os.path.join(folder, "summary.json"))
    return {"recipe": recipe, "finished": os.path.isfile(os.path.join(folder, "summary.json")),
            "outputs": [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(folder, name))]}


def _unsafe_to_clear(folder: str) -> bool:
    """The file system root, the home folder, or the working directory and its parents: never cleared."""
    full = os.path.realpath(folder)
    cwd = os.path.realpath(os.getcwd())
    return (full in (os.path.sep, os.path.realpath(os.path.expanduser("~")))
            or cwd == full or cwd.startswith(full.rstrip(os.sep) + os.sep))


def check_output_dir(name: str, cfg: Any, resumable: bool = True) -> None:
    """The output_dir policy: another recipe's run, or a finished one of this recipe without ``resume_from``, is
    refused unless ``overwrite=true`` (rlhf_e2e may rerun into its own folder)."""
    output_dir = str(cfg.output_dir)
    overwrite, resume = cfg.overwrite, cfg.resume_from
    if overwrite and resume:
        raise config_problem("overwrite", True, f"clears output_dir's checkpoints, and resume_from={resume!r} "
                             "asks to continue from them", "drop one: overwrite=true starts over, resume_from=latest "
                             "continues the run in output_dir")
    found = folder_run(output_dir)
    if found is None:
        return
    if overwrite:
        if _unsafe_to_clear(output_dir):
            raise config_problem("output_dir", output_dir, "is the working directory, one of its parents, the home "
                                 "folder or /, which overwrite=true never clears", "give the run a folder of its own")
        return
    files = ", ".join(found["outputs"])
    other = found["recipe"]
    if other is not None and other != name:
        raise config_problem(
            "output_dir", output_dir, f"holds a run of {other} ({files}); running {name} there would mix its "
            "metrics, curves, checkpoints and exports with it",
            "use a new output_dir, or set overwrite=true to clear that run's files first (resume_from=latest "
            "continues only a run of the same recipe)")
    if found["finished"] and not resume and resumable:
        tag = latest_tag(os.path.join(os.path.expanduser(output_dir), "checkpoints"))
        cont = (f"set resume_from=latest to continue it from its checkpoint {tag} (with a larger max_steps)" if tag
                else "resume_from=latest continues a run from its checkpoints, but this one wrote none "
                "(checkpoint.every=0)")
        raise config_problem(
            "output_dir", output_dir, f"holds a finished {name} run ({files}); a new run there would append to its "
            "metrics.jsonl and replace its summary and exports",
            f"{cont}; set overwrite=true to clear it and start over, or use a new output_dir")
    if not found["finished"] and not resume and "metrics.jsonl" in found["outputs"]:
        logger.warning("output_dir=%s holds an unfinished %s run: this run starts at step 0 and appends to its "
                       "metrics.jsonl; resume_from=latest continues it instead, overwrite=true clears it first",
                       output_dir, other or "earlier")


def clear_output_dir(name: str, cfg: Any) -> list[str]:
    """With ``overwrite=true``: remove the earlier run's ``RUN_OUTPUTS`` from output_dir, on one process before any
    rank writes; returns what was removed."""
    if not cfg.overwrite:
        return []
    folder = os.path.expanduser(str(cfg.output_dir))
    found = folder_run(folder)
    if found is None or _unsafe_to_clear(folder):
        return []
    removed = []
    for entry in found["outputs"]:
        path = os.path.join(folder, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed.append(entry)
    logger.info("overwrite=true: removed the earlier %s run's %s from %s", found["recipe"] or "", ", ".join(removed),
                folder)
    return removed


def output_dir_policy(recipe: Any, cfg: Any, *, clear: bool, nnodes: int = 1, node_rank: int | None = None,
                      rdzv_backend: str = "static") -> None:
    """The policy of ``recipe`` (its class): :func:`check_output_dir`, or with ``clear`` and overwrite=true,
    :func:`clear_output_dir` on rank 0's node only (several nodes may share the folder)."""
    name = recipe.name
    if not clear:
        check_output_dir(name, cfg, "resume_from" not in recipe.omit)
    elif cfg.overwrite and nnodes > 1 and rdzv_backend == "c10d":
        raise RecipeConfigError("overwrite=true with --rdzv-backend c10d on several nodes: nodes are numbered as they "
                                "join, so none can clear output_dir before the others start; clear the earlier run's "
                                "files by hand, use a new output_dir, or the static rendezvous")
    elif nnodes == 1 or not node_rank:
        clear_output_dir(name, cfg)


def mark_run(output_dir: str, name: str) -> None:
    """Record in output_dir which recipe runs there (run.json), so a later run of another recipe is refused
    before summary.json exists."""
    path = os.path.join(output_dir, RUN_FILE)
    if _read_recipe(path) == name:
        return
    os.makedirs(output_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"recipe": name, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
        f.write("\n")
    os.replace(tmp, path)


def _nonfinite_losses(metrics: dict[str, Any]) -> list[str]:
    """The loss metrics of a step that are NaN/inf (`loss`, `policy_loss`, `loss/actor`, ...)."""
    return sorted(k for k, v in metrics.items() if "loss" in k and isinstance(v, float) and not math.isfinite(v))


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes} min {sec} s" if minutes else f"{seconds:.1f} s"


def _verdict(before: float, after: float, higher_is_better: bool) -> str:
    if not (math.isfinite(before) and math.isfinite(after)) or after == before:
        return "unchanged" if after == before else "not finite"
    return "improved" if (after > before) == higher_is_better else "got worse"


def _scalars(result: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Recipe:
    """setup() -> train() -> export() -> summary() -> plot(); save_checkpoint()/resume() on the way."""

    name = "recipe"
    roles: ClassVar[tuple[Any, ...]] = ()  # the Role declaration
    Config: ClassVar[type] = RunConfig
    renamed: ClassVar[dict[str, str]] = {}  # old key -> new key ("new.key (how the values differ)")
    omit: ClassVar[tuple[str, ...]] = ()  # common keys this recipe does not have (a run of runs: resume_from, ...)
    plot_panels: list[tuple[str, list[str]]] = []
    plot_xlabel = "step"
    postfix_keys: tuple[str, ...] = ("loss",)  # shown in the progress bar
    # the closing summary's figures: (evaluation key, what it is, higher is better), first vs last evaluation;
    # none found: the training loss of the first and last steps
    headline: tuple[tuple[str, str, bool], ...] = ()

    @classmethod
    def validate(cls, cfg: Any, world_size: int = 1) -> None:
        """The recipe's checks across keys and outside the config (paths, data, vocabularies, batches on
        ``world_size`` ranks), before any rank starts; raise config_problem(...) or any RecipeConfigError."""

    @classmethod
    def plan(cls, cfg: Any, assume: Any = None) -> list[Any]:
        """What ``multiengine plan`` sizes: a list of ``plans.RecipePlan``."""
        raise RecipeConfigError(f"`multiengine plan` cannot plan recipe '{cls.name}': it defines no plan(cfg, assume) "
                                "(see docs/adding-a-workflow.md)")

    @classmethod
    def describe(cls, cfg: Any) -> dict[str, Any]:
        """What a run of ``cfg`` builds, as plain data: each role's RoleSpec and model folders and every other
        section as handed on (a key must change it or be refused)."""
        out = {k: v for k, v in cfg.to_dict().items() if k != "roles"}
        out["roles"] = {}
        for name, role in (cfg.roles.items() if cfg.roles is not None else ()):
            if not hasattr(role, "spec"):  # a rollout engine: its settings
                out["roles"][name] = role.to_dict()
                continue
            spec = role.spec(lambda: None, total_steps=1, lora_targets=("*",)) if role.trainable else \
                role.spec(lambda: None)
            out["roles"][name] = {**spec.describe(), "model": role.model_path(), "tokenizer": role.tokenizer_path(),
                                  **({"packing": role.packing} if hasattr(role, "packing") else {})}
        return out

    @classmethod
    def check(cls, cfg: Any, world_size: int = 1) -> None:
        """Every check across keys: the common ones (trust_remote_code before any folder is read, wandb installed
        for report_to=wandb), then :meth:`validate`."""
        set_trust_remote_code(cfg.trust_remote_code)
        if cfg.report_to == "wandb" and importlib.util.find_spec("wandb") is None:
            raise config_problem("report_to", "wandb", f"needs wandb, but {WANDB_MISSING}", WANDB_FIX)
        if cfg.roles is not None:
            cfg.roles.check_packing()
            cfg.roles.check_moe()
        cls.validate(cfg, world_size)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.step = 0
        self.history: list[dict[str, Any]] = []  # evaluations, in order
        self.step_metrics: list[dict[str, float]] = []
        self.registry: EngineRegistry | None = None
        self.bridge: Any = None  # with rollout ranks: the engines' Bridge to them (split_ranks)
        self.metrics: MetricsLogger | None = None
        self._saved_at: int | None = None
        self.nonfinite_skips = 0  # steps counted by the nonfinite policy (checkpointed)

    # --- what a recipe implements -----------------------------------------------------------------
    def build(self) -> None:
        raise NotImplementedError

    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self, tag: str) -> dict[str, Any]:
        return {}

    def export(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def after_step(self, last: bool) -> None:
        """Called after every step's logging (e.g. periodic validation images); all ranks."""

    def summary_metrics(self) -> dict[str, Any]:
        return {}

    def summary_extra(self) -> dict[str, Any]:
        return {}

    def eval_every(self) -> int:
        """Evaluate every N steps as well (0 = only before and after): ``eval.every`` where the recipe has it."""
        return int(getattr(getattr(self.cfg, "eval", None), "every", 0) or 0)

    # --- the shared lifecycle ---------------------------------------------------------------------
    @property
    def output_dir(self) -> str:
        return str(self.cfg.output_dir)

    def path(self, *parts: str) -> str:
        return os.path.join(self.output_dir, *parts)

    def setup(self) -> None:
        cfg = self.cfg
        os.makedirs(self.output_dir, exist_ok=True)
        set_trust_remote_code(cfg.trust_remote_code)  # before build() loads any folder
        self.registry = EngineRegistry(backend=cfg.backend, seed=cfg.seed, timeout_s=cfg.dist_timeout_s or None)
        if self.registry.is_main:
            mark_run(self.output_dir, self.name)
        self.build()
        self.metrics = MetricsLogger(self.path("metrics.jsonl"), enabled=self.registry.is_main,
                                     tensorboard_dir=self.path("tensorboard") if cfg.tensorboard else None,
                                     wandb=self.wandb_init() if cfg.report_to == "wandb" else None)
        if self.registry.is_main:
            logger.info("%s: roles built (world size %d):\n%s", self.name, self.registry.world_size,
                        self.registry.memory_report())
        n = cfg.nonfinite  # the policy of every step
        self.nonfinite = (n.policy, n.max_skips if n.policy == "skip" else 0)
        if cfg.resume_from:  # a run of runs (rlhf_e2e) has no resume_from: its steps resume themselves
            self.resume(cfg.resume_from)

    def wandb_init(self) -> dict[str, Any]:
        """wandb.init's arguments for report_to=wandb: the run named after the recipe and output folder, its
        files under output_dir/wandb, the resolved config attached."""
        return {"project": os.environ.get("WANDB_PROJECT", "multiengine"),
                "name": f"{self.name}:{os.path.basename(os.path.abspath(self.output_dir))}",
                "dir": self.output_dir, "config": self.cfg.to_dict()}

    def train(self) -> None:
        cfg, registry = self.cfg, self.registry
        if self.step == 0:
            self.run_evaluation("before")
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=self.name, disable=not registry.is_main)
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            metrics = dict(self.train_step())
            self.step += 1
            metrics.setdefault("step_time_s", time.perf_counter() - t0)
            problem = self._nonfinite_problem(metrics)
            if problem is not None:
                self.nonfinite_skips += 1
            if self.nonfinite_skips:
                metrics["nonfinite_skips"] = float(self.nonfinite_skips)
            self.step_metrics.append(metrics)
            self.metrics.log(self.step, metrics, prefix="train")
            if problem is not None:
                self._apply_nonfinite_policy(problem, bar)
            bar.update(1)
            bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self.postfix_keys if metrics.get(k) is not None})
            last = self.step == cfg.max_steps
            every = self.eval_every()
            if every and self.step % every == 0 and not last:
                self.run_evaluation(f"step_{self.step}")
            self.after_step(last)
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        bar.close()
        if cfg.checkpoint.every and self._saved_at != self.step:
            self.save_checkpoint()  # the final state too, so a finished run can be extended with resume_from
        self.run_evaluation("after")

    def _nonfinite_problem(self, metrics: dict[str, Any]) -> str | None:
        """What was not finite at this step (its skipped updates, its loss metrics), or None; decided on
        values summed over ranks, so every rank gets the same answer."""
        updates = self.registry.nonfinite_updates()  # the same list on every rank
        losses = _nonfinite_losses(metrics)
        if self.registry.world_size > 1:
            bad = sum_over_ranks({"bad": float(bool(updates or losses))})["bad"] > 0
        else:
            bad = bool(updates or losses)
        if not bad:
            return None
        parts = [f"{k}={metrics[k]}" for k in losses] + [u.describe() for u in updates]
        return "; ".join(parts) or "a loss was not finite on another rank"

    def _apply_nonfinite_policy(self, problem: str, bar: Any) -> None:
        name, max_skips = self.nonfinite
        where = f"step {self.step}: non-finite values ({problem})"
        if name == "skip" and self.nonfinite_skips <= max_skips:
            if self.registry.is_main:
                logger.warning("%s; step skipped (%d of nonfinite.max_skips=%d)", where, self.nonfinite_skips,
                               max_skips)
            return
        bar.close()
        tag = latest_tag(self.path("checkpoints"))
        kept = (f"the last checkpoint, {os.path.join(self.path('checkpoints'), tag)}, is kept as it was" if tag
                else "no checkpoint was written")
        why = (f"more than nonfinite.max_skips={max_skips} steps were skipped" if name == "skip"
               else "nonfinite.policy=stop")
        fix = ("lower the learning rate or turn gradient clipping on (max_grad_norm > 0), check the data for NaN/inf"
               f"{', then resume with resume_from=latest' if tag else ''}; or set nonfinite.policy=skip "
               "(nonfinite.max_skips=K) to step over rare bad batches")
        raise NonFiniteError(f"{where}; the run stops ({why}); nothing was exported and {kept}", fix)

    def run_evaluation(self, tag: str) -> dict[str, Any]:
        result = self.evaluate(tag) or {}
        if result:
            self.metrics.log(self.step, _scalars(result), prefix="eval")
            self.history.append({"tag": tag, "step": self.step, **result})
            if self.registry.is_main:
                logger.info("eval (%s, step %d): %s", tag, self.step,
                            ", ".join(f"{k} {v:.4f}" for k, v in _scalars(result).items()))
                for sample in result.get("samples", [])[:3]:
                    logger.info("  %s -> %s", *sample)
        return result

    def save_checkpoint(self) -> str:
        """Every trainable role, registered states, RNG and the recipe's state; keep the newest K."""
        state = {"step": self.step, "recipe": self.state_dict(), "history": self.history,
                 "step_metrics": self.step_metrics, "nonfinite_skips": self.nonfinite_skips}
        self._saved_at = self.step
        return self.registry.save_checkpoint(self.path("checkpoints"), client_state=state,
                                             keep_last=self.cfg.checkpoint.keep_last)

    def resume(self, resume_from: str) -> bool:
        path = resume_from
        if resume_from == "latest":
            path = self.path("checkpoints")
            if latest_tag(path) is None:
                logger.info("resume_from=latest: no checkpoint under %s yet, starting fresh", path)
                return False
        state = self.registry.load_checkpoint(path)
        self.step = int(state["step"])
        self._saved_at = self.step
        self.history = list(state.get("history", []))
        self.step_metrics = list(state.get("step_metrics", []))
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
        self.load_state_dict(state.get("recipe", {}))
        logger.info("%s: resumed from %s at step %d", self.name, path, self.step)
        return True

    def mean_step_metric(self, key: str) -> float | None:
        """Mean of a per-step metric, leaving out the first step (it also builds ZeRO-3's fetch trace)."""
        steps = self.step_metrics[1:] or self.step_metrics
        values = [m[key] for m in steps if m.get(key) is not None]
        return statistics.fmean(values) if values else None

    def evaluation(self, tag: str) -> dict[str, Any] | None:
        """The last evaluation with this tag."""
        return next((h for h in reversed(self.history) if h["tag"] == tag), None)

    def eval_figures(self, keys: tuple[str, ...]) -> dict[str, Any]:
        """``eval/before/<key>`` and ``eval/after/<key>`` of the first and last evaluations."""
        out = {}
        for tag in ("before", "after"):
            found = self.evaluation(tag)
            for key in keys:
                if found is not None and found.get(key) is not None:
                    out[f"eval/{tag}/{key}"] = found[key]
        return out

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        registry = self.registry
        metrics = {"steps": self.step, "step_time_s_mean": self.mean_step_metric("step_time_s"),
                   **self.summary_metrics()}
        extra = self.summary_extra()
        per_rank = gather_memory(registry)
        return {
            "recipe": self.name,
            "world_size": registry.world_size,
            "metrics": metrics,
            "evaluations": self.history,
            "memory": {"per_rank": per_rank, "planned_vs_measured": self.planned_memory(per_rank, extra)},
            "roles": registry.describe(),
            "export": export,
            "config": self.cfg.to_dict(),
            "inactive_keys": inactive_keys(self.cfg),  # {key: why}: set, but a later setting turned its feature off
            **extra,
        }

    def planned_memory(self, per_rank: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any] | None:
        """`multiengine plan`'s per-rank model-state bytes beside the measured ones for the folders the run used,
        on the main rank; a planner failure is logged and recorded, not raised."""
        if not self.registry.is_main:
            return None
        from . import plans

        used = {role: path for role, path in (extra.get("paths") or {}).items()
                if isinstance(path, str) and os.path.isdir(path)}
        try:
            report = plans.planned_vs_measured(type(self), self.cfg, per_rank, assume=used)
        except Exception as exc:  # the check must never lose a finished run's summary
            logger.warning("%s: planned-vs-measured memory not computed: %s: %s", self.name, type(exc).__name__, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
        off = [role for role, r in report["roles"].items() if not r.get("within_tolerance")]
        if off:
            logger.warning("%s: model states of %s differ from `multiengine plan`'s by more than its tolerance "
                           "(summary.json memory.planned_vs_measured)", self.name, off)
        return report

    def plot(self) -> str | None:
        if not (self.cfg.plot and self.registry.is_main and self.plot_panels):
            return None
        records = read_jsonl(self.path("metrics.jsonl"))
        return plot_curves(records, self.path("curves.png"), self.plot_panels, xlabel=self.plot_xlabel,
                           title=self.plot_title())

    def plot_title(self) -> str:
        return f"{self.name} ({self.registry.world_size} ranks)"

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def closing_summary(self, export: dict[str, Any], plot: str | None, seconds: float) -> str:
        """A few lines for the person who ran it: what changed between the first and the last evaluation (or
        the first and last training loss), and where the export, summary.json and curves are."""
        ranks = self.registry.world_size
        lines = [f"{self.name}: {self.step} steps on {ranks} rank{'s' if ranks > 1 else ''} in {_duration(seconds)}"]
        first, last = (self.history[0], self.history[-1]) if len(self.history) > 1 else ({}, {})
        shown = [(label, first[key], last[key], better) for key, label, better in self.headline
                 if isinstance(first.get(key), (int, float)) and isinstance(last.get(key), (int, float))]
        if shown:
            tags = f"{first['tag']} -> {last['tag']}"
        else:
            losses = [m["loss"] for m in self.step_metrics if isinstance(m.get("loss"), (int, float))]
            shown = [("training loss", losses[0], losses[-1], False)] if len(losses) > 1 else []
            tags = "first -> last step"
        for label, a, b, better in shown:
            lines.append(f"  {label}: {a:.4g} -> {b:.4g} ({tags}; {_verdict(a, b, better)})")
        if export:
            lines.append(f"  export: {self.path('export')} ({', '.join(str(k) for k in export)})")
        else:
            lines.append("  export: none (export.enabled=false)" if hasattr(self.cfg, "export") else "  export: none")
        lines.append(f"  summary: {self.path('summary.json')} (every figure, per-rank memory, the resolved config)")
        if plot:
            lines.append(f"  curves: {plot}")
        return "\n".join(lines)

    @classmethod
    def main(cls, cfg: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        if os.environ.get(KEY_READS_ENV) and not tracking_reads():  # tests: which keys the run read
            track_reads()
        bridge = cls.split_ranks(cfg)
        if bridge is not None and bridge.layout.is_rollout:  # a rollout rank: generation only, until told to stop
            return cls.serve(cfg, bridge)
        run = cls(cfg)
        run.bridge = bridge
        run.setup()
        report = None
        try:
            run.train()
            export = run.export()
            summary = run.summary(export)
            summary["plot"] = run.plot()
            if run.registry.is_main:
                write_summary(run.path("summary.json"), summary)
                if run.registry.roles():  # a recipe of steps (rlhf_e2e) has no roles of its own
                    logger.info("%s: per-role memory on rank 0:\n%s", run.name, run.registry.memory_report())
                report = run.closing_summary(export, summary["plot"], time.perf_counter() - t0)
        finally:
            run.close()
            if os.environ.get(KEY_READS_ENV):
                run.write_key_reads()
        return {"metrics": summary["metrics"], "export": export, "report": report}

    @classmethod
    def split_ranks(cls, cfg: Any) -> Any:
        """With rollout ranks (``roles.<rollout role>.ranks``, before any process group): this process's side of the
        engines' Bridge (trainer ranks then see a world of their own), else None."""
        rollout = next((r.name for r in cls.roles if r.rollout), None)
        ranks = list(cfg.roles[rollout].ranks) if rollout and cfg.roles is not None else []
        if not ranks:
            return None
        from multiengine.engines.placement import Bridge, split_world

        return Bridge(split_world(ranks), cfg.dist_timeout_s or None)

    @classmethod
    def serve(cls, cfg: Any, bridge: Any) -> dict[str, Any]:
        """A rollout rank's run: answer the trainer ranks until they stop (rollout_ranks.serve_rollouts)."""
        from multiengine.engines.dist import _launched, watch_launcher
        from multiengine.pipelines.rlhf.rollout_ranks import serve_rollouts

        if _launched():
            watch_launcher()
        served = serve_rollouts(bridge)
        logger.info("rollout rank %d: %d batches generated", bridge.layout.rank, served)
        if os.environ.get(KEY_READS_ENV):
            folder = os.path.join(str(cfg.output_dir), "logs")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"key-reads-rank{bridge.layout.rank}.json"), "w", encoding="utf-8") as f:
                json.dump(sorted(reads_of(cfg)), f)
        return {"metrics": {}, "export": {}, "report": None}

    def write_key_reads(self) -> None:
        """``logs/key-reads-rank<N>.json``: the keys of this run's config read from setup to summary."""
        folder = self.path("logs")
        os.makedirs(folder, exist_ok=True)
        rank = self.registry.rank if self.registry is not None else 0
        with open(os.path.join(folder, f"key-reads-rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(sorted(reads_of(self.cfg)), f)

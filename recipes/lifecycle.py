"""The one lifecycle every recipe shares: setup -> train -> export -> summary, with checkpoints and resume.

A recipe is a subclass of :class:`Recipe` that fills in what is its own:

* ``build()``       - add and build its roles on ``self.registry`` (already created) and load its data;
* ``train_step()``  - one optimizer step (all of its micro-batches) returning metrics that are already
                      means over ranks (``mean_over_ranks``);
* ``evaluate(tag)`` - collective evaluation, called with ``"before"``, ``"after"`` and ``"step_<n>"``;
* ``export()``      - write ``output_dir/export/<role>/`` (``multiengine.engines.save_role``);
* ``state_dict()`` / ``load_state_dict()`` - what it needs beyond the registry to resume (data
                      streams registered with ``registry.add_state`` are saved by the registry itself);
* ``summary_metrics()`` and ``plot_panels`` - its headline figures and the panels of ``curves.png``.

The base does the rest the same way for all: output folder, seeding, the registry (backend, seed,
collective timeout), ``metrics.jsonl`` + TensorBoard, the tqdm loop with periodic evaluation and
checkpoints, ``resume_from``, ``summary.json`` (with per-rank memory and every role's resolved config)
and ``curves.png``. Its module keeps ``DEFAULTS`` (``with_common({...})``) and ``main = MyRecipe.main``.
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from typing import Any

from multiengine.engines import (
    EngineRegistry,
    MetricsLogger,
    gather_memory,
    latest_tag,
    plot_curves,
    read_jsonl,
    write_summary,
)
from tqdm import tqdm

logger = logging.getLogger(__name__)

__all__ = ["COMMON_DEFAULTS", "Recipe", "with_common"]

COMMON_DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/recipe",  # everything the run writes goes under this folder
    "seed": 0,  # one seed for data order, sampling and initialisation (each rank gets seed + rank)
    "max_steps": 100,  # optimizer steps
    "backend": "auto",  # auto | deepspeed | torch
    "resume_from": "",  # "" | "latest" (output_dir/checkpoints; fresh start if none) | a checkpoint folder
    "dist_timeout_s": 1800.0,  # a collective that waits longer than this fails the run
    "checkpoint": {"every": 0, "keep_last": 2},  # every N steps (0 = never); keep the newest K
    "tensorboard": True,  # TensorBoard events beside metrics.jsonl
    "plot": True,  # curves.png of the main figures
}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and out[key]:
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_common(defaults: dict[str, Any]) -> dict[str, Any]:
    """A recipe's DEFAULTS: the common keys, overridden and extended by the recipe's own."""
    return _merge(COMMON_DEFAULTS, defaults)


def _scalars(result: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Recipe:
    """setup() -> train() -> export() -> summary() -> plot(); save_checkpoint()/resume() on the way."""

    name = "recipe"
    plot_panels: list[tuple[str, list[str]]] = []
    plot_xlabel = "step"
    postfix_keys: tuple[str, ...] = ("loss",)  # shown in the progress bar

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.step = 0
        self.history: list[dict[str, Any]] = []  # evaluations, in order
        self.step_metrics: list[dict[str, float]] = []
        self.registry: EngineRegistry | None = None
        self.metrics: MetricsLogger | None = None
        self._saved_at: int | None = None

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

    # --- the shared lifecycle ---------------------------------------------------------------------
    @property
    def output_dir(self) -> str:
        return str(self.cfg.output_dir)

    def path(self, *parts: str) -> str:
        return os.path.join(self.output_dir, *parts)

    def setup(self) -> None:
        cfg = self.cfg
        os.makedirs(self.output_dir, exist_ok=True)
        self.registry = EngineRegistry(backend=cfg.backend, seed=cfg.seed, timeout_s=cfg.dist_timeout_s or None)
        self.build()
        self.metrics = MetricsLogger(self.path("metrics.jsonl"), enabled=self.registry.is_main,
                                     tensorboard_dir=self.path("tensorboard") if cfg.tensorboard else None)
        if self.registry.is_main:
            logger.info("%s: roles built (world size %d):\n%s", self.name, self.registry.world_size,
                        self.registry.memory_report())
        if cfg.resume_from:
            self.resume(cfg.resume_from)

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
            self.step_metrics.append(metrics)
            self.metrics.log(self.step, metrics, prefix="train")
            bar.update(1)
            bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self.postfix_keys if metrics.get(k) is not None})
            last = self.step == cfg.max_steps
            every = (cfg.get("eval") or {}).get("every", 0)
            if every and self.step % every == 0 and not last:
                self.run_evaluation(f"step_{self.step}")
            self.after_step(last)
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        bar.close()
        if cfg.checkpoint.every and self._saved_at != self.step:
            self.save_checkpoint()  # the final state too, so a finished run can be extended with resume_from
        self.run_evaluation("after")

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
                 "step_metrics": self.step_metrics}
        self._saved_at = self.step
        return self.registry.save_checkpoint(self.path("checkpoints"), client_state=state,
                                             keep_last=self.cfg.checkpoint.keep_last or None)

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
        from omegaconf import OmegaConf

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
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            **extra,
        }

    def planned_memory(self, per_rank: list[dict[str, Any]], extra: dict[str, Any]) -> dict[str, Any] | None:
        """`multiengine plan`'s per-rank model-state bytes per role at this config's placements beside the
        measured ones (recipes.plans.planned_vs_measured), on the main rank. The models are the folders the
        run used (``summary_extra()["paths"]``). A planner failure is logged and recorded, not raised: the
        run itself has finished."""
        if not self.registry.is_main:
            return None
        from multiengine.recipes import plans

        used = {role: path for role, path in (extra.get("paths") or {}).items()
                if isinstance(path, str) and os.path.isdir(path)}
        try:
            report = plans.planned_vs_measured(self.name, self.cfg, per_rank, assume=used)
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

    @classmethod
    def main(cls, cfg: Any) -> dict[str, Any]:
        run = cls(cfg)
        run.setup()
        try:
            run.train()
            export = run.export()
            summary = run.summary(export)
            summary["plot"] = run.plot()
            if run.registry.is_main:
                write_summary(run.path("summary.json"), summary)
                logger.info("%s: per-role memory on rank 0:\n%s", run.name, run.registry.memory_report())
        finally:
            run.close()
        return {"metrics": summary["metrics"], "export": export}

"""Per-phase profile of one PPO step and one SD fine-tuning step: wall time, top ops, the number of
collectives (all_gather / reduce_scatter / all_reduce / broadcast / ...) and of subprocess launches
per phase, for config variants side by side (default: the factories' old settings `legacy` against
today's `default`; see benchmarks/variants.py).

Collectives are counted from torch's profiler (every c10d op is one event, whichever Python API or
cached function reference launched it). Subprocess launches are counted by a wrapper around
``subprocess.Popen`` that also records the caller, so a launch on the hot path names its origin.

    python -m benchmarks.profile_step                       # both workloads, legacy vs default (~2 min)
    python -m benchmarks.profile_step --workload rlhf --config zero2 --shape large --variants legacy,+buckets
    python -m benchmarks.profile_step --workload rlhf --config grpo_zero3_gather
    python -m benchmarks.profile_step --cprofile            # also the top Python functions of the step
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

COLLECTIVE_KINDS = {
    "all_gather": ("allgather", "all_gather"),
    "reduce_scatter": ("reduce_scatter",),
    "all_reduce": ("allreduce", "all_reduce"),
    "broadcast": ("broadcast",),
    "barrier": ("barrier",),
}


def collective_kind(event_name: str) -> str | None:
    """'c10d::_allgather_base_' -> 'all_gather'; None for anything that is not a c10d collective."""
    if not event_name.startswith("c10d::"):
        return None
    op = event_name[len("c10d::"):].lower()
    for kind, stems in COLLECTIVE_KINDS.items():
        if any(s in op for s in stems):
            return kind
    return "other"


class PhaseRecorder:
    """Marks phases (a torch profiler range each) and counts subprocess launches per phase."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self._child: list[float] = []  # time spent in nested phases, per open phase
        self.launches: collections.Counter[tuple[str, str]] = collections.Counter()
        self.wall: collections.defaultdict[str, float] = collections.defaultdict(float)

    @property
    def phase(self) -> str:
        return self.stack[-1] if self.stack else "other"

    @contextlib.contextmanager
    def mark(self, name: str) -> Iterator[None]:
        import torch

        self.stack.append(name)
        self._child.append(0.0)
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase::{name}"):
                yield
        finally:
            elapsed = time.perf_counter() - t0
            self.wall[name] += elapsed - self._child.pop()  # exclusive of nested phases
            if self._child:
                self._child[-1] += elapsed
            self.stack.pop()

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.mark(name):
                return fn(*args, **kwargs)

        return run

    @contextlib.contextmanager
    def counting_subprocesses(self) -> Iterator[None]:
        original = subprocess.Popen.__init__
        recorder = self

        def init(popen: Any, args: Any, *a: Any, **kw: Any) -> None:
            frames = [f for f in traceback.extract_stack()[:-1] if "subprocess.py" not in f.filename]
            caller = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
            recorder.launches[(recorder.phase, f"{args if isinstance(args, str) else ' '.join(map(str, args))}"
                               f"  [{caller}]")] += 1
            original(popen, args, *a, **kw)

        subprocess.Popen.__init__ = init
        try:
            yield
        finally:
            subprocess.Popen.__init__ = original


def analyse(prof: Any, top: int) -> dict[str, Any]:
    """Per phase: collectives by kind, and the top ops by self CPU time (from the profiler's events)."""
    events = list(prof.events())
    phases = sorted(((e.time_range.start, e.time_range.end, e.name[len("phase::"):], e.thread)
                     for e in events if e.name.startswith("phase::")), key=lambda p: p[1] - p[0])

    def phase_of(e: Any) -> str:
        for start, end, name, thread in phases:  # innermost first
            if thread == e.thread and start <= e.time_range.start <= end:
                return name
        return "other"

    collectives: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    self_us: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        if e.name.startswith("phase::"):
            continue
        p = phase_of(e)
        kind = collective_kind(e.name)
        if kind:
            collectives[p][kind] += 1
            ops[p][e.name] += 1
        self_us[p][e.name] += e.self_cpu_time_total
        calls[p][e.name] += 1
    top_ops = {p: [(name, us / 1000.0, calls[p][name]) for name, us in c.most_common(top)] for p, c in self_us.items()}
    return {"collectives": {p: dict(c) for p, c in collectives.items()}, "top_ops": top_ops,
            "collective_ops": {p: dict(c) for p, c in ops.items()}}


def profile_one(step: Callable[[], Any], recorder: PhaseRecorder, top: int, with_cprofile: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.barrier()
    recorder.wall.clear()
    recorder.launches.clear()
    cp = cProfile.Profile() if with_cprofile else None
    with recorder.counting_subprocesses():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            if cp:
                cp.enable()
            t0 = time.perf_counter()
            step()
            total = time.perf_counter() - t0
            if cp:
                cp.disable()
    out = analyse(prof, top)
    out["wall_ms"] = {**{k: 1000 * v for k, v in recorder.wall.items()}, "step": 1000 * total}
    launches: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (phase, what), n in recorder.launches.items():
        launches[phase][what] = n
    out["subprocess_launches"] = dict(launches)
    if cp:
        buf = io.StringIO()
        pstats.Stats(cp, stream=buf).sort_stats("cumulative").print_stats(25)
        out["cprofile"] = buf.getvalue()
    return out


# --------------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _rlhf_phases(recorder: PhaseRecorder, trainer: Any) -> Iterator[None]:
    """Phase marks around the step's parts: generation, experience (the rest of the rollout), train, and
    metrics (every cross-rank reduction of the step's statistics, wherever the library makes it)."""
    import multiengine.pipelines.rlhf.grpo as grpo_module
    import multiengine.pipelines.rlhf.ppo_trainer as ppo_module
    import multiengine.pipelines.rlhf.rollout as rollout_module

    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, phase: str) -> None:
        if hasattr(owner, attr):
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, recorder.wrap(getattr(owner, attr), phase))

    wrap(rollout_module, "generate", "generation")
    for module in (ppo_module, grpo_module):
        wrap(module, "rollout_metrics", "metrics")
        wrap(module, "step_timings", "metrics")
    if hasattr(rollout_module, "StepStats"):  # one reduction for the whole step (absent before it existed)
        wrap(rollout_module.StepStats, "reduce", "metrics")
    trainer.make_experience = recorder.wrap(trainer.make_experience, "experience")
    trainer.train_on = recorder.wrap(trainer.train_on, "train")
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
        del trainer.make_experience, trainer.train_on  # back to the class's methods


def rlhf_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks import ppo_harness as H
    from benchmarks.variants import VARIANTS, running

    results = {}
    stage = H.OURS[args.config]["stage"]
    built = {name: H.Raw(stage, args.model_dir) if name == "raw"
             else H.Ours(args.config, args.model_dir, VARIANTS[name]) for name in args.variants}
    g = torch.Generator().manual_seed(1000 + torch.distributed.get_rank())
    for name, ours in built.items():
        recorder = PhaseRecorder()
        if name == "raw":
            for i in range(args.warmup):
                ours.step(H.prompts(args.shape, g), i, args.shape)
            ours.marker = recorder.mark
            batch = H.prompts(args.shape, g)
            results[name] = profile_one(functools.partial(ours.step, batch, args.warmup, args.shape), recorder,
                                        args.top, args.cprofile)
            results[name]["buckets"] = "DeepSpeed defaults"
            continue
        trainer = ours.trainer(args.shape)
        for i in range(args.warmup):
            ours.step(H.prompts(args.shape, g), i, args.shape)
        batch = H.prompts(args.shape, g)
        with _rlhf_phases(recorder, trainer), running(ours.variant, any_zero3=ours.stage == 3):
            results[name] = profile_one(functools.partial(trainer.step, batch, args.warmup), recorder,
                                        args.top, args.cprofile)
        results[name]["buckets"] = ours.buckets()
    return results


def _sd_step(objective: Any, unet: Any, batch: dict[str, Any], recorder: PhaseRecorder, rank: int, i: int) -> None:
    """One SD fine-tuning step (the recipe's steps 2-5): vae, text encoder, unet forward, backward, step."""
    from multiengine.pipelines.diffusion.training import step_generator

    out = objective.loss(batch, step_generator(0, i, 0, rank))
    with recorder.mark("backward"):
        unet.backward(out.loss)
    with recorder.mark("optimizer_step"):
        unet.step()


def sd_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from diffusers import DDPMScheduler
    from multiengine.engines import EngineRegistry
    from multiengine.pipelines.diffusion.training import DiffusionObjective
    from multiengine.recipes.language.config import load_config, load_recipe

    from benchmarks.variants import VARIANTS, building, configure, optimizer_factory, running

    # sd_finetune's roles: unet, vae and text encoder at ZeRO-3 in fp32 (the frozen ones gathered once per forward
    # in the zero3_gather layout), no EMA
    gather = str(args.sd_layout == "zero3_gather").lower()
    cfg = load_config("sd_finetune", None, [
        "ema.enabled=false", f"model.pretrained={args.model_dir}", "roles.unet.micro_batch_size=8",
        "roles.unet.lr=1e-4",
        *(f"roles.{r}.{k}" for r in ("unet", "vae", "text_encoder") for k in ("stage=3", "dtype=fp32")),
        *(f"roles.{r}.gather_forward={gather}" for r in ("vae", "text_encoder"))])
    results = {}
    setups = {}
    for name in args.variants:
        variant = VARIANTS[name]
        registry = EngineRegistry()
        for spec in load_recipe("sd_finetune").role_specs(cfg, "sd", args.model_dir):
            configure(variant, spec.ds_config, spec.trainable)
            if spec.trainable:
                spec.optimizer = optimizer_factory(variant, 1e-4, (0.9, 0.999))
            registry.add(spec)
        with building(variant):
            registry.build()
        scheduler = DDPMScheduler.from_pretrained(args.model_dir, subfolder="scheduler")
        setups[name] = (variant, registry, DiffusionObjective(registry, ["text_encoder"], scheduler, resolution=32))
    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    te_config = setups[args.variants[0]][1].role("text_encoder").module.config
    batch = {"pixel_values": torch.rand(8, 3, 32, 32, generator=g) * 2 - 1,
             "input_ids": torch.randint(0, te_config.vocab_size, (8, te_config.max_position_embeddings), generator=g)}
    for name, (variant, registry, objective) in setups.items():
        recorder = PhaseRecorder()
        step = functools.partial(_sd_step, objective, registry["unet"], batch, recorder, registry.rank)
        objective.latents = recorder.wrap(objective.latents, "vae")
        objective.encode_prompts = recorder.wrap(objective.encode_prompts, "text_encoder")
        objective.unet_forward = recorder.wrap(objective.unet_forward, "unet_forward")
        with running(variant, any_zero3=True):
            for i in range(args.warmup):
                step(i)
            results[name] = profile_one(functools.partial(step, args.warmup), recorder, args.top, args.cprofile)
        results[name]["buckets"] = {r.name: {k: v for k, v in r.config["zero_optimization"].items()
                                             if "bucket" in k or "threshold" in k or k in ("overlap_comm",
                                                                                           "memory_efficient_linear")}
                                    for r in registry.roles()}
    return results


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------


def report(workload: str, results: dict[str, Any], top: int) -> str:
    from benchmarks.common import table

    lines = [f"\n## {workload}: collectives, subprocess launches and wall time per phase (one profiled step, rank 0)"]
    variants = list(results)
    phases = sorted({p for r in results.values() for p in (*r["collectives"], *r["wall_ms"])} - {"step"},
                    key=lambda p: (p == "other", p))
    rows = []
    for phase in [*phases, "step"]:
        for v in variants:
            r = results[v]
            if phase == "step":
                c = collections.Counter()
                for counts in r["collectives"].values():
                    c.update(counts)
                launches = sum(sum(x.values()) for x in r["subprocess_launches"].values())
            else:
                c = collections.Counter(r["collectives"].get(phase, {}))
                launches = sum(r["subprocess_launches"].get(phase, {}).values())
            rows.append([phase, v, c["all_gather"], c["reduce_scatter"], c["all_reduce"], c["broadcast"],
                         c["barrier"] + c["other"], sum(c.values()), launches, r["wall_ms"].get(phase, 0.0)])
    lines.append(table(["phase", "variant", "all_gather", "reduce_scatter", "all_reduce", "broadcast", "other",
                        "collectives", "subprocesses", "wall ms (profiled, own)"], rows))
    for v in variants:
        r = results[v]
        lines.append(f"\n### {workload} / {v}: top {top} ops by self CPU time per phase")
        for phase, ops in sorted(r["top_ops"].items()):
            lines.append(f"{phase}: " + "; ".join(f"{name} {ms:.1f} ms x{n}" for name, ms, n in ops))
        lines.append("c10d ops: " + "; ".join(f"{phase}: " + ", ".join(f"{k} x{n}" for k, n in sorted(c.items()))
                                              for phase, c in sorted(r["collective_ops"].items())))
        for phase, what in r["subprocess_launches"].items():
            for cmd, n in what.items():
                lines.append(f"subprocess in {phase}: {n} x {cmd}")
        lines.append(f"buckets: {r['buckets']}")
        if "cprofile" in r:
            lines.append(r["cprofile"])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="rlhf,sd")
    parser.add_argument("--variants", default="legacy,default,raw",
                        help="benchmarks/variants.py names; `raw` = the raw-DeepSpeed step (RLHF only)")
    parser.add_argument("--config", default="zero3_gather", help="RLHF placement (benchmarks.ppo_harness.OURS)")
    parser.add_argument("--shape", default="small", help="RLHF shape: small or large")
    parser.add_argument("--sd-layout", default="zero3_gather", choices=("zero3", "zero3_gather"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--results-name", default="profile_step",
                        help="benchmarks/results/<name>.json (e.g. a run against another checkout of the library)")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    if args.worker == "sd":
        args.variants = [v for v in args.variants if v != "raw"]
    from benchmarks.common import emit, run_ranks, write_results

    if args.worker:
        import torch.distributed as dist

        results = rlhf_worker(args) if args.worker == "rlhf" else sd_worker(args)
        if dist.get_rank() == 0:
            emit(results)
        return
    load = os.getloadavg()
    out: dict[str, Any] = {"load_average_start": load}
    passthrough = ["--variants", ",".join(args.variants), "--config", args.config, "--shape", args.shape,
                   "--sd-layout", args.sd_layout, "--warmup", str(args.warmup), "--top", str(args.top)]
    if args.cprofile:
        passthrough.append("--cprofile")
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workload.split(","):
            if workload == "rlhf":
                from benchmarks.ppo_harness import tiny_lm

                model_dir = os.path.join(tmp, "tiny_opt")
                tiny_lm(model_dir)
            else:
                from multiengine.pipelines.diffusion.tiny import build_tiny_sd

                model_dir = build_tiny_sd(os.path.join(tmp, "tiny_sd"), seed=0, resolution=32)
            out[workload] = run_ranks("benchmarks.profile_step", 2,
                                      ["--worker", workload, "--model-dir", model_dir, *passthrough])
            print(report(workload if workload == "sd" else f"rlhf {args.config} {args.shape}", out[workload],
                         args.top))
    out["load_average_end"] = os.getloadavg()
    print(f"\nload average (1, 5, 15 min): start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, end "
          f"{out['load_average_end'][0]:.2f} {out['load_average_end'][1]:.2f} {out['load_average_end'][2]:.2f}")
    import multiengine.engines

    out["library"] = os.path.dirname(os.path.dirname(os.path.realpath(multiengine.engines.__file__)))
    print(f"library: {out['library']}")
    path = write_results(args.results_name, out,
                         command="python -m benchmarks.profile_step " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

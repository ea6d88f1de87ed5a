"""Packed against padded passes: a GRPO and a PPO step through the library (registry + GRPOTrainer / PPOTrainer)
with packing on and off, at ZeRO-2 and ZeRO-3, on 2 CPU ranks, on a long-tailed answer-length distribution, all in
one run, interleaved.

Model: a tiny Llama (a family that packs; hidden 128, 2 layers, vocab 512, pipelines.rlhf.tiny.tiny_lm_config) as
actor and ref, and under a scalar head as critic and reward model; bf16; DeepSpeed under the benchmarks' default
variant (benchmarks/variants.py).
Rows: 32 per rank (GRPO: 8 prompts x 4 samples; PPO: 32 prompts), 16 prompt tokens, answers of 5 to 256 tokens,
most short: 5 + floor(252 u^4) for u uniform (median 21, mean 55), the longest answer of each rank at the cap (so
the padded rows are [32, 272]: long-tailed rollouts hit the cap). The library's generation runs to 256 tokens and
each answer is then cut at its drawn length (EOS there, pad after), so every variant scores and trains rows of the
same lengths, step by step.
Phases (the trainers' own timings): generation; experience = the scoring passes (PPO: actor and ref log-probs,
critic values, reward score; GRPO: ref log-probs and reward score, its one pass taking the old log-probs in the
update); train = train_on_experience, one optimizer step of all 32 rows in one micro-batch, or in micro-batches of
at most ``--budget`` tokens (the budget variant).
Variants per algorithm and stage: padded (RoleSpec.packed False), packed (True), packed_budget (packed, and
RoleSpec.token_budget on the trainable roles).
Pad fraction: of the tokens the padded passes compute (rows x width), the share that is padding; of the packed rows,
the share of unused tails. Peak memory: one more step per variant after the timed rounds, rank 0, the process's
peak RSS within each phase above its RSS when the phase began (free heap trimmed, VmHWM reset at each start).

    python -m benchmarks.packing              # 2 CPU ranks, 9 rounds, ~13 min here (load 4-7)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from typing import Any

VOCAB, HIDDEN, LAYERS = 512, 128, 2
PAD, BOS, EOS = 0, 1, 2
NEVER = 10**6  # an EOS outside the vocabulary: generation runs to max_new_tokens, the lengths are cut afterwards
PROMPT, ANSWER, MIN_ANSWER = 16, 256, 5
ROWS, GRPO_SAMPLES = 32, 4
LR, BETAS = 1e-5, (0.9, 0.95)
ALGORITHMS, STAGES, MODES = ("grpo", "ppo"), (2, 3), ("padded", "packed", "packed_budget")
PHASES = ("generation", "experience", "train", "total")


def answer_lengths(step: int, rank: int) -> Any:
    """The ``ROWS`` answer lengths (EOS included) of a step on a rank: long-tailed, the longest at the cap."""
    import torch

    g = torch.Generator().manual_seed(7919 * step + rank)
    u = torch.rand(ROWS, generator=g)
    lengths = MIN_ANSWER + ((ANSWER - MIN_ANSWER + 1) * u**4).long().clamp(max=ANSWER - MIN_ANSWER)
    lengths[torch.randint(ROWS, (1,), generator=g)] = ANSWER
    return lengths


def prompts(algorithm: str, step: int, rank: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(104_729 * step + rank + 1)
    n = ROWS // GRPO_SAMPLES if algorithm == "grpo" else ROWS
    ids = torch.randint(3, VOCAB, (n, PROMPT), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def tiny_llama(path: str) -> None:
    import torch
    from multiengine.pipelines.rlhf.tiny import tiny_lm_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_lm_config("llama", VOCAB, HIDDEN, LAYERS, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
                            max_positions=PROMPT + ANSWER + 16)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


class Phases:
    """Per phase of the running step: CPU seconds and, with ``memory``, the peak RSS above the phase's start (free
    heap trimmed, VmHWM reset when it starts). Experience starts when generation ends (inside make_experience)."""

    active: Phases | None = None
    _libc = ctypes.CDLL("libc.so.6")

    def __init__(self, memory: bool = False) -> None:
        self.cpu: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.memory = memory
        self._open: dict[str, tuple[float, float]] = {}

    @staticmethod
    def _rss(key: str) -> float:
        with open("/proc/self/status") as f:
            return next(float(line.split()[1]) * 1024 for line in f if line.startswith(key))

    def start(self, name: str) -> None:
        base = 0.0
        if self.memory:
            self._libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            base = self._rss("VmRSS:")
        self._open[name] = (time.process_time(), base)

    def stop(self, name: str) -> None:
        t0, base = self._open.pop(name)
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - t0
        if self.memory:
            self.peak[name] = max(self.peak.get(name, 0.0), self._rss("VmHWM:") - base)

    @classmethod
    def wrap(cls, fn: Any, name: str, then: str = "") -> Any:
        """``fn`` timed as phase ``name``; ``then``: the phase that starts when it returns."""

        def run(*args: Any, **kwargs: Any) -> Any:
            phases = cls.active
            if phases is None:
                return fn(*args, **kwargs)
            phases.start(name)
            out = fn(*args, **kwargs)
            phases.stop(name)
            if then:
                phases.start(then)
            return out

        return run


_FORCED: dict[str, Any] = {}  # the step's answer lengths, read by the generation below


def _forced_generation() -> None:
    """The rollout's generate(), run to max_new_tokens, each answer then cut at the step's drawn length."""
    import multiengine.pipelines.rlhf.rollout as rollout_module
    import torch

    if getattr(rollout_module.generate, "_forced", False):
        return
    original = rollout_module.generate

    def generate(registry: Any, input_ids: Any, attention_mask: Any, settings: Any, eos: int, pad: int,
                 role: str = "actor") -> Any:
        response = original(registry, input_ids, attention_mask, settings, NEVER, pad, role)
        lengths = _FORCED["lengths"].to(response.device)
        response = response.masked_fill(response == eos, eos + 1)
        at = torch.arange(response.shape[1], device=response.device)
        response = response.masked_fill(at == lengths[:, None] - 1, eos)
        return response.masked_fill(at >= lengths[:, None], pad)

    generate._forced = True
    rollout_module.generate = Phases.wrap(generate, "generation", then="experience")


class Step:
    """One variant: its registry (actor, ref, reward; PPO: critic) and trainer."""

    def __init__(self, algorithm: str, stage: int, mode: str, model_dir: str, budget: int) -> None:
        from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, trainable_role
        from multiengine.pipelines.rlhf.generation import GenerationSettings
        from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model
        from multiengine.pipelines.rlhf.rollout import RolloutSpec

        from benchmarks.variants import VARIANTS, building, configure, optimizer_factory

        self.name, self.algorithm, self.stage, self.mode = f"{algorithm}_zero{stage}_{mode}", algorithm, stage, mode
        self.variant = VARIANTS["default"]
        place, optim, zero3 = Placement(stage=stage, dtype="bf16"), OptimSpec(lr=LR, betas=BETAS), stage == 3
        specs = [trainable_role("actor", causal_lm(model_dir, "bf16"), place, optim, micro_batch_size=ROWS),
                 frozen_role("ref", causal_lm(model_dir, "bf16"), place),
                 frozen_role("reward", scalar_model(model_dir, "bf16", zero3), place)]
        if algorithm == "ppo":
            specs.append(trainable_role("critic", scalar_model(model_dir, "bf16", zero3), place, optim,
                                        micro_batch_size=ROWS))
        self.registry = EngineRegistry()
        for spec in specs:
            spec.packed = mode != "padded"
            spec.token_budget = budget if mode == "packed_budget" and spec.trainable else 0
            configure(self.variant, spec.ds_config, spec.trainable)
            if spec.trainable:
                spec.optimizer = optimizer_factory(self.variant, LR, BETAS)
            self.registry.add(spec)
        with building(self.variant):
            self.registry.build()
        if algorithm == "grpo":
            from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
            from multiengine.pipelines.rlhf.rewards import reward_model

            gen = GenerationSettings(max_new_tokens=ANSWER, do_sample=True)
            self.trainer = GRPOTrainer(self.registry, GRPOSettings(n_samples_per_prompt=GRPO_SAMPLES,
                                                                   rollout_batch_size=ROWS // GRPO_SAMPLES),
                                       RolloutSpec(gen, EOS, PAD, [reward_model("reward")]), ROWS)
        else:
            from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer

            gen = GenerationSettings(max_new_tokens=ANSWER, do_sample=False)
            self.trainer = PPOTrainer(self.registry, PPOSettings(rollout_batch_size=ROWS, epochs=1),
                                      RolloutSpec(gen, EOS, PAD, critic="critic"), ROWS)
        self.rows: Any = None
        make, train = self.trainer.make_experience, self.trainer.train_on

        def make_experience(*args: Any, **kwargs: Any) -> Any:
            exp = make(*args, **kwargs)  # generation starts the experience phase when it returns
            Phases.active.stop("experience")
            self.rows = exp.attention_mask
            return exp

        self.trainer.make_experience = make_experience
        self.trainer.train_on = Phases.wrap(train, "train")

    def step(self, step: int, memory: bool = False) -> dict[str, float]:
        import torch.distributed as dist

        from benchmarks.variants import running

        rank = dist.get_rank()
        _FORCED["lengths"] = answer_lengths(step, rank)
        phases = Phases.active = Phases(memory)
        try:
            with running(self.variant, any_zero3=self.stage == 3):
                dist.barrier()
                t0 = time.perf_counter()
                m = self.trainer.step(prompts(self.algorithm, step, rank), step)
                total = time.perf_counter() - t0
        finally:
            Phases.active = None
        out = {"generation": m["time/generation_s"], "experience": m["time/experience_s"],
               "train": m["time/train_s"], "total": total}
        out.update({f"cpu_{k}": v for k, v in phases.cpu.items()})
        if memory:
            out.update({f"peak_mb_{k}": v / 2**20 for k, v in phases.peak.items()})
        return out

    def check_rows(self, step: int, rank: int) -> None:
        """The last rollout's rows hold the prompt and the answer lengths the step drew (EOS included)."""
        real = self.rows.sum(-1).cpu()
        if not bool((real == PROMPT + answer_lengths(step, rank)).all()):
            raise RuntimeError(f"{self.name}: rows of {real.tolist()} tokens, not the drawn lengths + {PROMPT}")


def pad_shares(steps: list[int]) -> dict[str, float]:
    """Over ``steps`` on both ranks: of the tokens the padded passes compute (rows x width), the share of padding;
    of the packed rows (engines.packing.pack), the share of unused tails."""
    import torch
    from multiengine.engines.packing import pack

    real = padded = packed = 0
    for step in steps:
        for rank in range(2):
            lengths = PROMPT + answer_lengths(step, rank)
            mask = (torch.arange(PROMPT + ANSWER) < lengths[:, None]).long()
            real += int(mask.sum())
            padded += mask.numel()
            packed += pack(mask, mask).input_ids.numel()
    n = 2 * len(steps)
    return {"padded": 1 - real / padded, "packed": 1 - real / packed, "real_tokens_per_rank_step": real / n,
            "padded_tokens_per_rank_step": padded / n, "packed_tokens_per_rank_step": packed / n}


def worker(names: list[str], rounds: int, warmup: int, model_dir: str, budget: int) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.common import emit

    torch.manual_seed(0)
    _forced_generation()
    steps = {}
    for name in names:
        algorithm, stage, mode = name.split("_", 2)
        steps[name] = Step(algorithm, int(stage[-1]), mode, model_dir, budget)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in steps}
    for i in range(warmup):
        for s in steps.values():
            s.step(i)
    for r in range(rounds):
        for name, s in steps.items():
            runs[name].append(s.step(warmup + r))
    memory = {name: s.step(warmup + rounds, memory=True) for name, s in steps.items()}
    for s in steps.values():
        s.check_rows(warmup + rounds, dist.get_rank())
    peaks = {name: {k.removeprefix("peak_mb_"): v for k, v in m.items() if k.startswith("peak_mb_")}
             for name, m in memory.items()}
    # the answer lengths of every timed step on this rank (the same for every variant)
    lengths = [answer_lengths(warmup + r, dist.get_rank()).tolist() for r in range(rounds)]
    if dist.get_rank() == 0:
        emit({"runs": runs, "peak_mb": peaks, "lengths_rank0": lengths})


def tree() -> dict[str, Any]:
    """The commit measured and the library files changed since it (a run on a work in progress says so)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "changed": git("status", "--porcelain", "--", "engines", "pipelines", "recipes").splitlines()}


def paired(runs: dict[str, list[dict[str, float]]], name: str, base: str, key: str) -> float:
    """Median over rounds of ``name / base`` within each round (load that drifts between rounds cancels)."""
    return statistics.median(r[key] / max(b[key], 1e-9) for r, b in zip(runs[name], runs[base]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (one step per variant each)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--stages", default=",".join(map(str, STAGES)))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget", type=int, default=1024, help="token budget of packed_budget (tokens per rank per "
                                                                 "micro-batch)")
    parser.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [f"{a}_zero{s}_{m}" for a in args.algorithms.split(",") for s in args.stages.split(",")
             for m in args.modes.split(",")]
    if args.worker:
        worker(names, args.rounds, args.warmup, args.worker, args.budget)
        return
    from benchmarks.common import median, run_ranks, table, write_results

    load_start, t_start, measured = os.getloadavg(), time.perf_counter(), tree()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny_llama")
        tiny_llama(model_dir)
        result = run_ranks("benchmarks.packing", 2, ["--algorithms", args.algorithms, "--stages", args.stages,
                                                      "--modes", args.modes, "--rounds", str(args.rounds), "--warmup",
                                                      str(args.warmup), "--budget", str(args.budget), "--worker",
                                                      model_dir])
    wall, load_end = time.perf_counter() - t_start, os.getloadavg()
    runs, peaks = result["runs"], result["peak_mb"]
    pads = pad_shares(list(range(args.warmup, args.warmup + args.rounds)))
    medians = {name: {k: median([r[k] for r in rows]) for k in rows[0]} for name, rows in runs.items()}
    rows, ratios = [], {}
    for name in names:
        algorithm, stage, _ = name.split("_", 2)
        base = f"{algorithm}_{stage}_padded"
        keys = [*PHASES, *(f"cpu_{k}" for k in PHASES[:3])]
        ratios[name] = {k: paired(runs, name, base, k) for k in keys} if base in runs else {}
        rows.append([name, *(1000 * medians[name][k] for k in PHASES),
                     *(ratios[name].get(k, float("nan")) for k in PHASES),
                     *(peaks[name].get(k, 0.0) for k in ("experience", "train"))])
    print(table(["variant", *(f"{k} ms" for k in PHASES), *(f"{k} x" for k in PHASES), "peak MB experience",
                 "peak MB train"], rows))
    print("\nx: / padded of the same algorithm and stage (median of the ratios within a round); peak MB: rank 0's peak "
          "RSS above the phase's start")
    summary = []
    for algorithm in args.algorithms.split(","):
        for stage in args.stages.split(","):
            key = f"{algorithm}_zero{stage}"
            packed, budget = ratios.get(f"{key}_packed", {}), ratios.get(f"{key}_packed_budget", {})
            if not packed:
                continue
            ok = packed["train"] <= 0.6 and packed["experience"] <= 0.7
            summary.append([algorithm, f"ZeRO-{stage}", pads["padded"], pads["packed"],
                            *(packed[k] for k in ("experience", "train", "total", "cpu_experience", "cpu_train")),
                            budget.get("train", float("nan")), "met" if ok else "MISSED"])
    print("\npacked / padded (targets: train <= 0.6x, experience <= 0.7x)")
    print(table(["step", "stage", "pad share, padded rows", "unused share, packed rows", "experience x", "train x",
                 "step x", "experience x, CPU", "train x, CPU", "train x, token budget", "targets (wall)"], summary))
    print("CPU: rank 0's CPU time (work done, waits for the other rank or a core excluded)")
    print(f"\nms: medians of {args.rounds} interleaved rounds after {args.warmup} warm-up step(s); 2 CPU ranks; load "
          f"average (1 min) {load_start[0]:.2f} at start, {load_end[0]:.2f} at end; wall {wall:.0f} s")
    path = write_results("packing", {"world_size": 2, "medians": medians, "ratios": ratios, "peak_mb": peaks,
                                     "pad": pads, "runs": runs, "lengths_rank0": result["lengths_rank0"],
                                     "shape": {"rows_per_rank": ROWS, "prompt": PROMPT, "answer_max": ANSWER,
                                               "answer_min": MIN_ANSWER, "grpo_samples": GRPO_SAMPLES,
                                               "vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS,
                                               "budget": args.budget},
                                     "load_average_start": load_start, "load_average_end": load_end,
                                     "wall_s": wall, "tree": measured},
                         command="python -m benchmarks.packing " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

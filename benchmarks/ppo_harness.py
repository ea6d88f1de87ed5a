"""The RLHF step for the benchmarks: PPO two ways, through the library (registry + PPOTrainer) under a
config variant and written directly on ``deepspeed.initialize`` with DeepSpeed's default ZeRO settings
and DeepSpeed's Adam (the raw-DeepSpeed reference, no registry); and GRPO through the library
(registry + GRPOTrainer: actor, ref, reward model, no critic).

All run the same models (a tiny OPT actor/ref, scalar-head critic/reward on the same body), the same
shapes and EOS outside the vocabulary (every answer has its full length), 1 epoch of 1 mini-batch.
PPO decodes greedily with the same PPO math (pipelines.rlhf.ppo) on both sides; GRPO samples
``GRPO_SAMPLES`` completions per prompt (a group needs different answers), so its step has that many
times the rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.variants import Variant, configure, optimizer_factory

SHAPES = {"small": (4, 32, 32), "large": (8, 128, 128)}  # prompts per rank, prompt tokens, answer tokens
VOCAB, HIDDEN = 512, 64
EOS = 10**6  # outside the vocabulary: every answer runs to its full length, so all variants do the same work
PAD = 0
LR, BETAS = 1e-5, (0.9, 0.95)
# DeepSpeed's micro batch only sizes its own data loader and throughput log: the engines take any batch, so one
# set of engines serves both shapes.
MICRO_BATCH = 4

GRPO_SAMPLES = 4  # completions per prompt in the GRPO rows

# ours: name -> algorithm, stage of the trainable roles, generation mode, frozen-role options
OURS = {
    "zero2": {"stage": 2, "gen": "gather"},
    "zero3_gather": {"stage": 3, "gen": "gather"},
    "zero3_per_token": {"stage": 3, "gen": "per_token"},
    "zero3_offload": {"stage": 3, "gen": "gather", "offload": True},
    "zero3_frozen_gather": {"stage": 3, "gen": "gather", "frozen_gather": True},
    "grpo_zero2": {"stage": 2, "gen": "gather", "algorithm": "grpo"},
    "grpo_zero3_gather": {"stage": 3, "gen": "gather", "algorithm": "grpo"},
    # the same GRPO steps with the experience phase's actor forward for the old log-probs, which one pass over the
    # rollout does without (RolloutSpec.old_logprobs): the step before that change, side by side
    "grpo_zero2_old_forward": {"stage": 2, "gen": "gather", "algorithm": "grpo", "old_forward": True},
    "grpo_zero3_gather_old_forward": {"stage": 3, "gen": "gather", "algorithm": "grpo", "old_forward": True},
}


def rows_per_prompt(config: str) -> int:
    return GRPO_SAMPLES if OURS.get(config, {}).get("algorithm") == "grpo" else 1


def tiny_lm(path: str) -> None:
    """The tiny OPT of issue 13: hidden 64, 2 layers, vocab 512 (165,760 parameters), dropout off."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=256,
                             num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=HIDDEN,
                             dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                             pad_token_id=PAD)).save_pretrained(path)


def prompts(shape: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    batch, prompt_len, _ = SHAPES[shape]
    ids = torch.randint(3, VOCAB, (batch, prompt_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class CpuClock:
    """This process's CPU time (user + system) per phase, exclusive of nested phases. CPU time counts
    the work a rank does, not the time it waits for its peer or for a core, so it stays readable on a
    loaded machine where wall times are not; wall time stays the measure the targets are set in."""

    active: CpuClock | None = None

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._child: list[float] = []

    @contextlib.contextmanager
    def mark(self, name: str) -> Any:
        self._child.append(0.0)
        t0 = time.process_time()
        try:
            yield
        finally:
            elapsed = time.process_time() - t0
            self.times[name] = self.times.get(name, 0.0) + elapsed - self._child.pop()
            if self._child:
                self._child[-1] += elapsed

    @classmethod
    def phase(cls, name: str) -> Any:
        return cls.active.mark(name) if cls.active is not None else contextlib.nullcontext()


def _clocked(fn: Any, name: str) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        with CpuClock.phase(name):
            return fn(*args, **kwargs)

    return run


# --------------------------------------------------------------------------------------------------
# ours: registry + PPOTrainer
# --------------------------------------------------------------------------------------------------


class Ours:
    """The library's PPO (or GRPO) step under one variant of the config settings."""

    def __init__(self, config: str, model_dir: str, variant: Variant, dtype: str = "bf16") -> None:
        from multiengine.engines import EngineRegistry, OptimSpec, Placement, frozen_role, trainable_role
        from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model

        from benchmarks.variants import building

        c = OURS[config]
        self.name, self.variant, self.stage, self.gen_mode = config, variant, c["stage"], c["gen"]
        self.algorithm, self.old_forward = c.get("algorithm", "ppo"), c.get("old_forward", False)
        train = Placement(stage=c["stage"], dtype=dtype)
        if c["stage"] == 3:
            frozen = Placement(stage=3, dtype=dtype, offload_params=c.get("offload", False),
                               gather_forward=c.get("frozen_gather", False))
        else:
            frozen = Placement(stage=c["stage"], dtype=dtype)
        optim = OptimSpec(lr=LR, betas=BETAS)
        zero3 = c["stage"] == 3
        specs = [trainable_role("actor", causal_lm(model_dir, dtype), train, optim, micro_batch_size=MICRO_BATCH),
                 frozen_role("ref", causal_lm(model_dir, dtype), frozen),
                 frozen_role("reward", scalar_model(model_dir, dtype, zero3), frozen)]
        if self.algorithm == "ppo":
            specs.append(trainable_role("critic", scalar_model(model_dir, dtype, zero3), train, optim,
                                        micro_batch_size=MICRO_BATCH))
        self.registry = EngineRegistry()
        for spec in specs:
            configure(variant, spec.ds_config, spec.trainable)
            if spec.trainable:
                spec.optimizer = optimizer_factory(variant, LR, BETAS)
            self.registry.add(spec)
        with building(variant):
            self.registry.build()
        self._trainers: dict[str, Any] = {}

    def trainer(self, shape: str) -> Any:
        """The trainer for a shape (1 epoch, 1 mini-batch of all rows; engines are shared)."""
        from multiengine.pipelines.rlhf.generation import GenerationSettings
        from multiengine.pipelines.rlhf.rollout import RolloutSpec

        if shape not in self._trainers:
            import multiengine.pipelines.rlhf.rollout as rollout_module

            if not getattr(rollout_module.generate, "_cpu_clocked", False):
                rollout_module.generate = _clocked(rollout_module.generate, "generation")
                rollout_module.generate._cpu_clocked = True
            batch, _, answer_len = SHAPES[shape]
            if self.algorithm == "grpo":
                from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
                from multiengine.pipelines.rlhf.rewards import reward_model

                gen = GenerationSettings(max_new_tokens=answer_len, do_sample=True, mode=self.gen_mode)
                trainer = GRPOTrainer(
                    self.registry, GRPOSettings(n_samples_per_prompt=GRPO_SAMPLES, rollout_batch_size=batch),
                    RolloutSpec(gen, EOS, PAD, [reward_model("reward")]), batch * GRPO_SAMPLES)
                if self.old_forward:
                    trainer.spec = dataclasses.replace(trainer.spec, old_logprobs=True)
            else:
                from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer

                gen = GenerationSettings(max_new_tokens=answer_len, do_sample=False, mode=self.gen_mode)
                trainer = PPOTrainer(self.registry, PPOSettings(rollout_batch_size=batch, epochs=1),
                                     RolloutSpec(gen, EOS, PAD, critic="critic"), batch)
            trainer.make_experience = _clocked(trainer.make_experience, "experience")
            trainer.train_on = _clocked(trainer.train_on, "train")
            self._trainers[shape] = trainer
        return self._trainers[shape]

    def step(self, batch: dict[str, torch.Tensor], step: int, shape: str) -> dict[str, float]:
        from benchmarks.variants import running

        trainer = self.trainer(shape)
        clock = CpuClock.active = CpuClock()
        try:
            with running(self.variant, any_zero3=self.stage == 3):
                dist.barrier()
                t0 = time.perf_counter()
                with clock.mark("total"):
                    m = trainer.step(batch, step)
                total = time.perf_counter() - t0
        finally:
            CpuClock.active = None
        return {"generation": m["time/generation_s"], "experience": m["time/experience_s"],
                "train": m["time/train_s"], "total": total, **cpu_times(clock)}

    def buckets(self) -> dict[str, dict[str, Any]]:
        keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                "overlap_comm", "memory_efficient_linear")
        return {r.name: {k: r.config["zero_optimization"][k] for k in keys if k in r.config["zero_optimization"]}
                for r in self.registry.roles()}


# --------------------------------------------------------------------------------------------------
# raw DeepSpeed: deepspeed.initialize per model, DeepSpeed's default ZeRO settings and its Adam
# --------------------------------------------------------------------------------------------------


def _raw_config(stage: int, batch: int, dtype: str, trainable: bool) -> dict[str, Any]:
    """What a DeepSpeed user writes: batch sizes, stage, dtype, clipping; every other ZeRO key default."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "train_batch_size": batch * dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
    }
    if trainable:
        cfg["gradient_clipping"] = 1.0
    return cfg


class Raw:
    """The same PPO step on four hand-built DeepSpeed engines (DeepSpeed-Chat's layout: frozen roles at
    stage 3 when the trainables are, else stage 0; generation through ``module.generate``, with
    ``synced_gpus`` under ZeRO-3 as DeepSpeed requires)."""

    variant = Variant("raw_deepspeed", rule="ds_default", memory_efficient_linear=True, optimizer="ds_adam",
                      local_size=True)

    def __init__(self, stage: int, model_dir: str, dtype: str = "bf16") -> None:
        import deepspeed
        from multiengine.engines.optim import build_optimizer
        from multiengine.pipelines.rlhf.models import ScalarHeadModel
        from transformers import AutoModelForCausalLM
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

        self.name, self.stage = f"raw_zero{stage}", stage
        self.batch = MICRO_BATCH
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        frozen_stage = 3 if stage == 3 else 0

        def build(kind: str, trainable: bool) -> Any:
            s = stage if trainable else frozen_stage
            cfg = _raw_config(s, self.batch, dtype, trainable)
            holder = HfDeepSpeedConfig(cfg) if s == 3 else None  # zero.Init inside from_pretrained
            try:
                if kind == "lm":
                    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
                else:
                    with deepspeed.zero.Init(config_dict_or_path=cfg, enabled=s == 3):
                        model = ScalarHeadModel.from_pretrained(model_dir, zero3=s == 3, dtype=torch_dtype,
                                                                head_seed=0)
            finally:
                unset_hf_deepspeed_config()
                del holder
            if trainable:
                opt = build_optimizer("ds_adam", model.parameters(), lr=LR, betas=BETAS)
                engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            else:
                model.requires_grad_(False).eval()
                engine, *_ = deepspeed.initialize(model=model, config=cfg)
            return engine

        from benchmarks.variants import running

        with running(self.variant, any_zero3=True):
            self.actor, self.ref = build("lm", True), build("lm", False)
            self.critic, self.reward = build("scalar", True), build("scalar", False)

    @staticmethod
    def _positions(mask: torch.Tensor) -> torch.Tensor:
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)

    def _logits(self, engine: Any, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=seq, attention_mask=mask, position_ids=self._positions(mask), use_cache=False).logits

    def _values(self, engine: Any, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return engine(input_ids=seq, attention_mask=mask, position_ids=self._positions(mask))

    marker = None  # profile_step sets a phase marker (name -> context manager) here

    @contextlib.contextmanager
    def _phase(self, name: str) -> Any:
        with CpuClock.phase(name), (self.marker(name) if self.marker else contextlib.nullcontext()):
            yield

    def step(self, batch: dict[str, torch.Tensor], step: int, shape: str) -> dict[str, float]:
        from multiengine.pipelines.rlhf import ppo
        from multiengine.pipelines.rlhf.losses import PolicyLossInputs, policy_loss
        from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings

        from benchmarks.variants import running

        clock = CpuClock.active = CpuClock()
        with running(self.variant, any_zero3=self.stage == 3), clock.mark("total"):
            dist.barrier()
            t0 = time.perf_counter()
            ids, mask = batch["input_ids"], batch["attention_mask"]
            C = ids.shape[1]
            # 1. generation: the ZeRO-3 hooks fetch every non-persistent layer for every token
            with self._phase("generation"), torch.no_grad():
                self.actor.module.eval()
                out = self.actor.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=SHAPES[shape][2],
                                                 do_sample=False, eos_token_id=EOS, pad_token_id=PAD, use_cache=True,
                                                 synced_gpus=self.stage == 3 and dist.get_world_size() > 1)
                response = ppo.truncate_after_eos(out[:, C:], EOS, PAD)
            t1 = time.perf_counter()
            # 2. experience: one forward per model, rewards, GAE, whitening over all ranks
            with self._phase("experience"), torch.no_grad():
                seq = torch.cat([ids, response], dim=1)
                action = ppo.action_mask(response, EOS)
                attn = torch.cat([mask, action.to(mask.dtype)], dim=1)
                logprobs = ppo.response_logprobs(self._logits(self.actor, seq, attn), seq, C)
                ref_logprobs = ppo.response_logprobs(self._logits(self.ref, seq, attn), seq, C)
                self.critic.module.eval()
                values = ppo.response_values(self._values(self.critic, seq, attn).float(), C)
                last = attn.sum(-1) - 1
                score = self._values(self.reward, seq, attn).float().gather(1, last.long().unsqueeze(1)).squeeze(1)
                rewards = ppo.compute_rewards(score, logprobs, ref_logprobs, action, 0.1, 5.0)
                advantages, returns = ppo.gae(rewards, values, action, 1.0, 0.95)
                advantages = ppo.masked_whiten(advantages, action)
            t2 = time.perf_counter()
            # 3. train: one mini-batch, actor then critic; 4. metrics: one all-reduce for the step
            with self._phase("train"):
                self.actor.module.train()
                self.critic.module.train()
                count = ppo.global_token_count(action.float()) / dist.get_world_size()
                logp = ppo.response_logprobs(self._logits(self.actor, seq, attn), seq, C)
                pg_loss, _ = policy_loss("ppo", PolicyLossInputs(logp, logprobs, advantages, action, denominator=count),
                                         PPOSettings(clip_eps=0.2))
                self.actor.backward(pg_loss)
                self.actor.step()
                count = ppo.global_token_count(action.float()) / dist.get_world_size()
                new_values = ppo.response_values(self._values(self.critic, seq, attn), C)
                v_loss, _ = ppo.value_loss(new_values, values, returns, action, 0.2, count)
                self.critic.backward(v_loss)
                self.critic.step()
            stats = torch.stack([score.mean(), pg_loss.detach().float(), v_loss.detach().float()]).double()
            dist.all_reduce(stats)
            t3 = time.perf_counter()
        CpuClock.active = None
        return {"generation": t1 - t0, "experience": t2 - t1, "train": t3 - t2, "total": t3 - t0,
                **cpu_times(clock)}


PHASES = ("generation", "experience", "train", "total")
CPU_PHASES = tuple(f"cpu_{p}" for p in PHASES)
KEYS = PHASES + CPU_PHASES


def cpu_times(clock: CpuClock) -> dict[str, float]:
    """cpu_<phase> seconds; cpu_total is the whole step (the phases plus what lies between them)."""
    out = {f"cpu_{p}": clock.times.get(p, 0.0) for p in PHASES}
    out["cpu_total"] = sum(clock.times.values())
    return out


@dataclass
class Timings:
    runs: dict[str, list[dict[str, float]]]

    def medians(self) -> dict[str, dict[str, float]]:
        import statistics

        return {name: {p: statistics.median(r[p] for r in rows) for p in KEYS} for name, rows in self.runs.items()}

    def paired_ratios(self, baseline: str) -> dict[str, dict[str, float]]:
        """Per variant and phase: the median over rounds of (variant / baseline) within each round, which
        cancels load that drifts between rounds."""
        import statistics

        base = self.runs[baseline]
        return {name: {p: statistics.median(r[p] / max(b[p], 1e-9) for r, b in zip(rows, base)) for p in KEYS}
                for name, rows in self.runs.items()}


def interleaved(variants: dict[str, Any], shape: str, warmup: int, rounds: int, steps_per_round: int = 1) -> Timings:
    """Warm every variant up, then ``rounds`` passes over all variants (``steps_per_round`` steps each),
    so that load changes on a shared machine hit every variant alike. Same prompts for every variant."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    batches = [prompts(shape, g) for _ in range(warmup + rounds * steps_per_round)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for v in variants.values():
        for i in range(warmup):
            v.step(batches[i], i, shape)
    i = warmup
    for _ in range(rounds):
        for name, v in variants.items():
            for k in range(steps_per_round):
                runs[name].append(v.step(batches[i + k], i + k, shape))
        i += steps_per_round
    return Timings(runs)

"""RLHF step 3: PPO with four engines - actor and critic trainable, ref and reward frozen (+ optional EMA).

    multiengine run rlhf_ppo --config tiny --nproc-per-node 2          # after rlhf_sft and rlhf_reward tiny
    multiengine run rlhf_ppo --config tiny --nproc-per-node 2 generation.mode=per_token roles.actor.stage=3
    multiengine run rlhf_ppo --config opt13b_opt350m --nproc-per-node 8

Every role is its own DeepSpeed engine with its own stage, dtype and offload (ref follows the actor,
reward the critic, unless set). Writes metrics.jsonl, summary.json, curves.png, checkpoints/ and
export/{actor,critic}[/adapter] (and export/ema) under output_dir; ``resume_from=latest`` continues a run.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import torch
from multiengine.engines import EngineRegistry, latest_tag
from multiengine.engines.metrics import MetricsLogger, read_jsonl, write_summary
from multiengine.pipelines.rlhf.data import PromptCollator, SFTCollator
from multiengine.pipelines.rlhf.export import export_causal_lm, export_scalar_model
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import LoraSettings, OptimSettings, Placement, build_rlhf_roles
from multiengine.pipelines.rlhf.runs import (
    BatchStream,
    builtin_judge,
    fixed_batches,
    gather_memory,
    load_split,
    plot_curves,
    prepare_tiny_assets,
    resolve_tokenizer,
)
from multiengine.pipelines.rlhf.trainer import PPOSettings, PPOTrainer, evaluate_policy
from multiengine.recipes.config import RecipeConfigError
from tqdm import tqdm

logger = logging.getLogger(__name__)

_TRAIN_ROLE = {
    "stage": 2, "dtype": "fp32", "offload_params": False, "offload_optimizer": False,
    "lr": 1e-5, "weight_decay": 0.0, "scheduler": "constant", "warmup_steps": 0, "grad_accum": 1,
    "gradient_checkpointing": False, "max_grad_norm": 1.0,
}
_LORA = {"enabled": False, "rank": 8, "alpha": 0.0, "dropout": 0.0,
         "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"]}

DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/rlhf_ppo",
    "seed": 0,
    "max_steps": 50,  # PPO steps: one rollout batch each
    "backend": "auto",
    "resume_from": "",  # "" | "latest" (output_dir/checkpoints; fresh start if none) | a checkpoint folder
    "model": {
        "actor": "",  # step 1's export; "" = the random tiny model (mechanics only, nothing to learn from)
        "reward": "",  # step 2's export; "" = the random tiny model with a fresh head
        "critic": "",  # "" = the reward model (DeepSpeed-Chat)
        "tiny_hidden": 64,
        "tiny_layers": 2,
    },
    "data": {
        "source": "",  # folder of {ppo,eval,sft}.jsonl, a file, or a hub name; "" = the built-in task
        "train_split": "train",  # hub split for prompts (local files: train)
        "eval_split": "test",  # hub split for evaluation prompts (local folders: eval.jsonl)
        "ptx_source": "",  # SFT data for the pretraining loss; "" = data.source's sft split
        "max_prompt_len": 16,
        "max_ptx_len": 32,
    },
    "generation": {"max_new_tokens": 8, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                   "mode": "gather"},  # gather (actor gathered once per batch) | per_token (ZeRO-3 synced_gpus)
    "ppo": {
        "rollout_batch_size": 16,  # prompts per rank per step
        "mini_batch_size": 8,  # rows per rank per forward/backward
        "ppo_epochs": 1,
        "clip_eps": 0.2,
        "value_clip": 0.2,  # 0 = unclipped value loss
        "dual_clip": 0.0,  # 0 = off; > 1 (e.g. 3) caps the loss of negative-advantage tokens
        "gamma": 1.0,
        "lam": 0.95,
        "kl_coef": 0.1,
        "adaptive_kl": False,
        "kl_target": 6.0,
        "kl_horizon": 10000,
        "clip_reward": 5.0,  # 0 = no clipping
        "whiten_advantages": True,
        "no_eos_penalty": 0.0,  # > 0: subtracted from the score of answers without EOS
        "ptx_coef": 0.0,  # > 0: unsupervised (SFT data) loss mixed into the actor, as in DeepSpeed-Chat
        "critic_warmup_steps": 0,  # first N steps train only the critic
        "shuffle_minibatches": True,
    },
    "roles": {
        "actor": dict(_TRAIN_ROLE),
        "critic": dict(_TRAIN_ROLE, lr=5e-6),
        # -1 / "" = the actor's (ref) / the critic's (reward); gather_forward: at ZeRO-3, one collective per
        # forward call instead of one per layer (1/N held between calls)
        "ref": {"stage": -1, "dtype": "", "offload_params": False, "gather_forward": False},
        "reward": {"stage": -1, "dtype": "", "offload_params": False, "gather_forward": False},
    },
    "ema": {"enabled": False, "decay": 0.992, "dtype": "", "offload_params": False},
    "lora": {"actor": dict(_LORA), "critic": dict(_LORA)},
    "eval": {
        "every": 10,  # also every N steps (always before and after)
        "size": 256,  # evaluation prompts (split evenly over ranks)
        "batch_size": 32,
        "judge": True,  # the built-in task's programmatic judge (only for its prompts)
        "greedy": True,  # also score greedy answers (the main figures use sampled answers, seeded)
        "seed": 1234,
    },
    "checkpoint": {"every": 0, "keep_last": 2},
    "export": {"enabled": True, "critic": True, "ema": True},
    "plot": True,
    "tensorboard": False,
}


def _placement(section: Any, follow: Placement | None = None) -> Placement:
    stage = section.stage if section.stage >= 0 else follow.stage
    dtype = section.dtype or follow.dtype
    return Placement(stage=stage, dtype=dtype, offload_params=bool(section.offload_params),
                     offload_optimizer=bool(section.get("offload_optimizer", False)),
                     gather_forward=bool(section.get("gather_forward", False)))


def _optim(section: Any, total_steps: int) -> OptimSettings:
    return OptimSettings(lr=section.lr, weight_decay=section.weight_decay, scheduler=section.scheduler,
                         warmup_steps=section.warmup_steps, total_steps=total_steps,
                         max_grad_norm=section.max_grad_norm or None)


def _lora(section: Any) -> LoraSettings | None:
    if not section.enabled:
        return None
    return LoraSettings(rank=section.rank, alpha=section.alpha or None, dropout=section.dropout,
                        target_modules=tuple(section.target_modules))


def ppo_settings(cfg: Any) -> PPOSettings:
    p = cfg.ppo
    return PPOSettings(
        rollout_batch_size=p.rollout_batch_size, mini_batch_size=p.mini_batch_size, ppo_epochs=p.ppo_epochs,
        clip_eps=p.clip_eps, value_clip=p.value_clip or None, dual_clip=p.dual_clip or None, gamma=p.gamma,
        lam=p.lam, kl_coef=p.kl_coef, adaptive_kl=p.adaptive_kl, kl_target=p.kl_target, kl_horizon=p.kl_horizon,
        clip_reward=p.clip_reward or None, whiten_advantages=p.whiten_advantages,
        no_eos_penalty=p.no_eos_penalty or None, ptx_coef=p.ptx_coef, critic_warmup_steps=p.critic_warmup_steps,
        ema_decay=cfg.ema.decay, shuffle_minibatches=p.shuffle_minibatches,
    )


class RLHFPPO:
    """setup() -> train() -> export() -> summary(); save_checkpoint() on the way."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.step = 0
        self.history: list[dict[str, Any]] = []  # evaluation results
        self.step_metrics: list[dict[str, float]] = []

    # --- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.registry = registry = EngineRegistry(backend=cfg.backend)
        self.builtin = not cfg.data.source
        self.assets: dict[str, str] = {}
        if self.builtin or not (cfg.model.actor and cfg.model.reward):
            self.assets = prepare_tiny_assets(os.path.join(cfg.output_dir, "tiny"), registry, cfg.seed,
                                              cfg.model.tiny_hidden, cfg.model.tiny_layers)
        self.paths = {
            "actor": self._model_path(cfg.model.actor, "actor", "rlhf_sft"),
            "reward": self._model_path(cfg.model.reward, "reward", "rlhf_reward"),
        }
        self.paths["critic"] = self._model_path(cfg.model.critic, "critic", "rlhf_reward") if cfg.model.critic \
            else self.paths["reward"]
        self.tokenizer = resolve_tokenizer(self.paths["actor"], self.assets.get("tokenizer", ""))

        roles = cfg.roles
        actor = _placement(roles.actor)
        critic = _placement(roles.critic)
        self.lora = {"actor": _lora(cfg.lora.actor), "critic": _lora(cfg.lora.critic)}
        s = self.settings = ppo_settings(cfg)
        steps_per_rollout = s.ppo_epochs * (s.rollout_batch_size // s.mini_batch_size)
        self.built = build_rlhf_roles(
            registry, self.paths["actor"], self.paths["reward"], self.paths["critic"],
            actor=actor, critic=critic,
            ref=_placement(roles.ref, actor), reward=_placement(roles.reward, critic),
            ema=Placement(actor.stage, cfg.ema.dtype or actor.dtype, cfg.ema.offload_params)
            if cfg.ema.enabled else None,
            actor_optim=_optim(roles.actor, cfg.max_steps * steps_per_rollout // roles.actor.grad_accum),
            critic_optim=_optim(roles.critic, cfg.max_steps * steps_per_rollout // roles.critic.grad_accum),
            micro_batch_size=s.mini_batch_size,
            actor_grad_accum=roles.actor.grad_accum, critic_grad_accum=roles.critic.grad_accum,
            actor_lora=self.lora["actor"], critic_lora=self.lora["critic"],
            actor_gradient_checkpointing=roles.actor.gradient_checkpointing,
            critic_gradient_checkpointing=roles.critic.gradient_checkpointing,
            seed=cfg.seed,
        )
        self.generation = GenerationSettings(
            max_new_tokens=cfg.generation.max_new_tokens, temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k, top_p=cfg.generation.top_p, mode=cfg.generation.mode, do_sample=True)
        self.greedy_generation = GenerationSettings(
            max_new_tokens=cfg.generation.max_new_tokens, mode=cfg.generation.mode, do_sample=False)
        self._setup_data()
        self.judge = builtin_judge([p for b in self.eval_batches for p in b["prompts"]], cfg.eval.judge)
        self.trainer = PPOTrainer(registry, self.generation, s, self.tokenizer.eos_token_id,
                                  self.tokenizer.pad_token_id, seed=cfg.seed, judge=self.judge, decode=self.decode)
        self.metrics = MetricsLogger(
            os.path.join(cfg.output_dir, "metrics.jsonl"), enabled=registry.is_main,
            tensorboard_dir=os.path.join(cfg.output_dir, "tensorboard") if cfg.tensorboard else None)
        if registry.is_main:
            logger.info("roles built (world size %d):\n%s", registry.world_size, registry.memory_report())
        if cfg.resume_from:
            self._resume(cfg.resume_from)

    def _model_path(self, given: str, role: str, recipe: str) -> str:
        if not given:
            logger.warning("model.%s is empty: using the random tiny model %s (run rlhf_e2e for the whole "
                           "pipeline)", role, self.assets["model"])
            return self.assets["model"]
        # a missing local folder is an error here; "org/name" (one slash) or "name" is a hub model
        if not os.path.exists(given) and (given.startswith(("/", ".", "~")) or given.count("/") >= 2):
            raise RecipeConfigError(f"model.{role}={given!r} does not exist; run `multiengine run {recipe} "
                                    f"--config tiny --nproc-per-node 2` first, or use rlhf_e2e.")
        return given

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        source = cfg.data.source or self.assets["data"]
        prompts = load_split(source, "ppo", registry, cfg.data.train_split)
        eval_rows = load_split(source, "eval", registry, cfg.data.eval_split)
        collate = PromptCollator(self.tokenizer, cfg.data.max_prompt_len)
        self.prompts = BatchStream(prompts, collate, self.settings.rollout_batch_size, registry, seed=cfg.seed)
        self.eval_batches = fixed_batches(eval_rows, collate, cfg.eval.batch_size, registry, limit=cfg.eval.size)
        self.ptx: BatchStream | None = None
        if self.settings.ptx_coef > 0:
            ptx_rows = load_split(cfg.data.ptx_source or source, "sft", registry, cfg.data.train_split)
            ptx_collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_ptx_len)
            self.ptx = BatchStream(ptx_rows, ptx_collate, self.settings.mini_batch_size, registry, seed=cfg.seed + 1)

    def decode(self, response_ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(response_ids.cpu(), skip_special_tokens=True)

    def _resume(self, resume_from: str) -> None:
        path = resume_from
        if resume_from == "latest":
            path = os.path.join(self.cfg.output_dir, "checkpoints")
            if latest_tag(path) is None:
                logger.info("resume_from=latest: no checkpoint under %s yet, starting fresh", path)
                return
        state = self.registry.load_checkpoint(path)
        self.step = int(state["step"])
        self.prompts.load_state_dict(state["prompts"])
        if self.ptx is not None and state.get("ptx") is not None:
            self.ptx.load_state_dict(state["ptx"])
        self.trainer.load_state_dict(state["trainer"])
        self.history = list(state.get("history", []))
        self.step_metrics = list(state.get("step_metrics", []))
        logger.info("resumed from %s at step %d (prompt epoch %d, kl_coef %.4f)", path, self.step,
                    self.prompts.epoch, self.trainer.kl_ctl.value)

    # --- training --------------------------------------------------------------------------------
    def train(self) -> None:
        cfg, registry = self.cfg, self.registry
        if self.step == 0:
            self.evaluate("before")
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="rlhf_ppo", disable=not registry.is_main)
        while self.step < cfg.max_steps:
            # 1. this rank's next prompt batch (left padded; sharded, resumable sampler)
            batch = next(self.prompts)
            # 2.-5. inside trainer.step: generate (actor gathered once, or per token with synced_gpus);
            #    actor/ref log-probs, critic values, reward score (every rank, every role, one forward);
            #    per-token rewards = clipped score on the last action - beta * k1 KL; GAE; whitening over
            #    all ranks; ppo_epochs x minibatches of actor step then critic step; EMA; KL controller
            metrics = self.trainer.step(batch, self.step, self.ptx)
            self.step += 1
            # 6. log (global means), periodic evaluation and checkpoints (all ranks take part)
            self.step_metrics.append(metrics)
            self.metrics.log(self.step, metrics, prefix="train")
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['kl']:.3f}")
            last = self.step == cfg.max_steps
            if cfg.eval.every and self.step % cfg.eval.every == 0 and not last:
                self.evaluate(f"step_{self.step}")
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
        bar.close()
        self.evaluate("after")

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Sampled answers (seeded, as in training) to the evaluation prompts: judge score, reward, KL to
        ref; and optionally greedy answers' judge score and reward."""
        t0 = time.perf_counter()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        result = evaluate_policy(self.registry, self.eval_batches, self.generation, eos, pad, self.decode,
                                 judge=self.judge, reward_role="reward", ref_role="ref", seed=self.cfg.eval.seed)
        samples = result.pop("samples")
        if self.cfg.eval.greedy:
            greedy = evaluate_policy(self.registry, self.eval_batches, self.greedy_generation, eos, pad,
                                     self.decode, judge=self.judge, reward_role="reward")
            result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        result["seconds"] = time.perf_counter() - t0
        self.metrics.log(self.step, {k: v for k, v in result.items()}, prefix="eval")
        self.history.append({"tag": tag, "step": self.step, **result, "samples": samples})
        logger.info("eval (%s, step %d): %s", tag, self.step,
                    ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        for prompt, answer in samples[:3]:
            logger.info("  %s -> %s", prompt, answer)
        return result

    def save_checkpoint(self) -> str:
        """actor + critic + their optimizers/schedulers (DeepSpeed), EMA partitions, step, RNG, prompt
        position, ptx position, KL controller, evaluation history."""
        state = {
            "step": self.step,
            "prompts": self.prompts.state_dict(),
            "ptx": self.ptx.state_dict() if self.ptx is not None else None,
            "trainer": self.trainer.state_dict(),
            "history": self.history,
            "step_metrics": self.step_metrics,
        }
        return self.registry.save_checkpoint(os.path.join(self.cfg.output_dir, "checkpoints"), client_state=state,
                                             keep_last=self.cfg.checkpoint.keep_last or None)

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        root = os.path.join(cfg.output_dir, "export")
        out: dict[str, Any] = {"actor": export_causal_lm(registry, "actor", os.path.join(root, "actor"),
                                                         self.tokenizer, self.paths["actor"], self.lora["actor"])}
        if cfg.export.critic:
            out["critic"] = export_scalar_model(registry, "critic", os.path.join(root, "critic"), self.tokenizer,
                                                self.paths["critic"], self.lora["critic"])
        if cfg.export.ema and "ema" in registry:
            out["ema"] = export_causal_lm(registry, "ema", os.path.join(root, "ema"), self.tokenizer,
                                          self.paths["actor"], self.lora["actor"])
        return out

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        cfg, registry = self.cfg, self.registry
        before = next((h for h in self.history if h["tag"] == "before"), None)
        after = next((h for h in reversed(self.history) if h["tag"] == "after"), None)
        steps = self.step_metrics[1:] or self.step_metrics  # the first step also builds ZeRO-3's fetch trace

        def mean(key: str) -> float | None:
            vals = [m[key] for m in steps if key in m]
            return statistics.fmean(vals) if vals else None

        metrics: dict[str, Any] = {
            "steps": self.step,
            "final": self.step_metrics[-1] if self.step_metrics else {},
            "time/step_s_mean": mean("time/step_s"),
            "time/generation_s_mean": mean("time/generation_s"),
            "time/experience_s_mean": mean("time/experience_s"),
            "time/train_s_mean": mean("time/train_s"),
            "gen/tokens_per_s_mean": mean("gen/tokens_per_s"),
            "gen/ms_per_token_mean": mean("gen/ms_per_token"),
            "generation_mode": cfg.generation.mode,
        }
        for tag, h in (("before", before), ("after", after)):
            if h:
                for key in ("judge", "reward", "kl", "response_length", "greedy/judge", "greedy/reward"):
                    if key in h:
                        metrics[f"eval/{tag}/{key}"] = h[key]
        return {
            "recipe": "rlhf_ppo",
            "world_size": registry.world_size,
            "paths": self.paths,
            "metrics": metrics,
            "evaluations": self.history,
            "memory": {"per_rank": gather_memory(registry)},
            "roles": registry.describe(),
            "export": export,
            "config": OmegaConf.to_container(cfg, resolve=True),
        }

    def plot(self) -> str | None:
        cfg = self.cfg
        if not (cfg.plot and self.registry.is_main):
            return None
        records = read_jsonl(os.path.join(cfg.output_dir, "metrics.jsonl"))
        panels = [("reward-model score", ["train/reward/mean", "eval/reward"])]
        if self.judge is not None:
            panels.append(("judge score (built-in task)", ["train/judge/mean", "eval/judge"]))
        panels.append(("KL to ref (nats per answer)", ["train/kl", "eval/kl"]))
        return plot_curves(records, os.path.join(cfg.output_dir, "curves.png"), panels,
                           title=f"rlhf_ppo ({self.registry.world_size} ranks; eval = seeded samples of "
                                 f"{self.cfg.eval.size} evaluation prompts)")

    def cleanup(self) -> None:
        self.metrics.close()


def main(cfg: Any) -> dict[str, Any]:
    run = RLHFPPO(cfg)
    run.setup()
    try:
        run.train()
        export = run.export()
        summary = run.summary(export)
        summary["plot"] = run.plot()
        if run.registry.is_main:
            write_summary(os.path.join(cfg.output_dir, "summary.json"), summary)
            logger.info("per-role memory on rank 0:\n%s", run.registry.memory_report())
            m = summary["metrics"]
            if "eval/before/judge" in m and "eval/after/judge" in m:
                logger.info("judge score: %.3f before PPO -> %.3f after (KL to ref %.3f nats per answer)",
                            m["eval/before/judge"], m["eval/after/judge"], m.get("eval/after/kl", float("nan")))
    finally:
        run.cleanup()
    return {"metrics": summary["metrics"], "export": export}

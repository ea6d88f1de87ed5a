"""RLHF step 3: PPO with four engines - actor and critic trainable, ref and reward frozen (+ optional EMA).

    multiengine run rlhf_ppo --config tiny --nproc-per-node 2          # after rlhf_sft and rlhf_reward tiny
    multiengine run rlhf_ppo --config tiny --nproc-per-node 2 generation.mode=per_token roles.actor.stage=3
    multiengine run rlhf_ppo --config opt1.3b_opt350m --nproc-per-node 8

Every role is its own DeepSpeed engine with its own stage, dtype and offload (ref follows the actor,
reward the critic, unless set). The reward is the ``reward`` role by default, or any weighted sum of
reward-model roles and Python reward functions named in ``reward.models`` / ``reward.functions`` (as in
rlhf_grpo). Writes metrics.jsonl, summary.json, curves.png, checkpoints/ and
export/{actor,critic}[/adapter] (and export/ema) under output_dir; ``resume_from=latest`` continues a run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from multiengine.engines import Placement, ShardedBatches, save_role, shard_batches
from multiengine.pipelines.rlhf.data import PromptCollator, SFTCollator
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer
from multiengine.pipelines.rlhf.roles import build_rlhf_roles
from multiengine.pipelines.rlhf.runs import builtin_judge, load_split, prepare_tiny_assets, resolve_tokenizer
from multiengine.recipes.common import (
    REWARD_DEFAULTS,
    RLHF_BETAS,
    check_model_path,
    lora_spec,
    optim_spec,
    placement,
    reward_config,
    reward_entries,
)
from multiengine.recipes.config import RecipeConfigError
from multiengine.recipes.lifecycle import Recipe, with_common

logger = logging.getLogger(__name__)

_TRAIN_ROLE = {
    "stage": 2, "dtype": "fp32", "offload_params": False, "offload_optimizer": False,
    "lr": 1e-5, "weight_decay": 0.0, "scheduler": "constant", "warmup_steps": 0, "grad_accum": 1,
    "gradient_checkpointing": False, "max_grad_norm": 1.0,
}
_LORA = {"enabled": False, "rank": 8, "alpha": 0.0, "dropout": 0.0,
         "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"]}

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/rlhf_ppo",
    "max_steps": 50,  # PPO steps: one rollout batch each
    "model": {
        "actor": "",  # step 1's export; "" = the random tiny model (mechanics only, nothing to learn from)
        "reward": "",  # step 2's export; "" = the random tiny model with a fresh head
        "critic": "",  # "" = the reward model (DeepSpeed-Chat); the actor's folder when rewards are functions only
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
    # reward-model roles and reward functions, summed with weights (see recipes/common.py); empty = the
    # `reward` role from model.reward at roles.reward, weight 1
    "reward": dict(REWARD_DEFAULTS),
    "lora": {"actor": dict(_LORA), "critic": dict(_LORA)},
    "eval": {
        "every": 10,  # also every N steps (always before and after)
        "size": 256,  # evaluation prompts (split evenly over ranks)
        "batch_size": 32,
        "judge": True,  # the built-in task's programmatic judge (only for its prompts)
        "greedy": True,  # also score greedy answers (the main figures use sampled answers, seeded)
        "seed": 1234,
    },
    "export": {"enabled": True, "critic": True, "ema": True},
})


def ppo_settings(cfg: Any) -> PPOSettings:
    p = cfg.ppo
    return PPOSettings(
        rollout_batch_size=p.rollout_batch_size, mini_batch_size=p.mini_batch_size, ppo_epochs=p.ppo_epochs,
        clip_eps=p.clip_eps, value_clip=p.value_clip or None, dual_clip=p.dual_clip or None, gamma=p.gamma,
        lam=p.lam, kl_coef=p.kl_coef, adaptive_kl=p.adaptive_kl, kl_target=p.kl_target, kl_horizon=p.kl_horizon,
        clip_reward=p.clip_reward or None, whiten_advantages=p.whiten_advantages,
        no_eos_penalty=p.no_eos_penalty or None, ptx_coef=p.ptx_coef, critic_warmup_steps=p.critic_warmup_steps,
        normalize_rewards=cfg.reward.normalize, ema_decay=cfg.ema.decay, shuffle_minibatches=p.shuffle_minibatches,
    )


def check_config(cfg: Any) -> None:
    """Reward sources and PPO settings, checked before any rank starts."""
    reward_entries(cfg.reward)
    try:
        ppo_settings(cfg)
    except ValueError as exc:
        raise RecipeConfigError(f"ppo: {exc}") from None


class RLHFPPO(Recipe):
    name = "rlhf_ppo"
    plot_xlabel = "PPO step"
    postfix_keys = ("reward/mean", "kl")

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        self.assets: dict[str, str] = {}
        entries, functions = reward_entries(cfg.reward)
        # the `reward` role's folder is model.reward when the reward config leaves it to it
        wants_rm = (not entries and not functions) or any(e["role"] == "reward" and not e["path"] for e in entries)
        if not cfg.data.source or not cfg.model.actor or (wants_rm and not cfg.model.reward):
            self.assets = prepare_tiny_assets(self.path("tiny"), registry, cfg.seed, cfg.model.tiny_hidden,
                                              cfg.model.tiny_layers)
        self.paths = {"actor": self._model_path(cfg.model.actor, "actor", "rlhf_sft")}
        roles = cfg.roles
        actor, critic = placement(roles.actor), placement(roles.critic)
        default_rm = self._model_path(cfg.model.reward, "reward", "rlhf_reward") if wants_rm else None
        reward_roles, self.rewards = reward_config(cfg.reward, default_rm,
                                                   placement(roles.reward, critic, trainable=False))
        for r in reward_roles:
            self.paths[r.role] = check_model_path(f"reward.models ({r.role}) path", r.path, "rlhf_reward")
        main_rm = next((r for r in reward_roles if r.role == "reward"), None)
        if cfg.model.critic:
            self.paths["critic"] = self._model_path(cfg.model.critic, "critic", "rlhf_reward")
        elif reward_roles:  # DeepSpeed-Chat: the critic starts from the reward model
            self.paths["critic"] = (main_rm or reward_roles[0]).path
        else:
            logger.info("rewards from functions only: the critic starts from the actor's folder with a fresh head")
            self.paths["critic"] = self.paths["actor"]
        self.reward_role = (main_rm or reward_roles[0]).role if reward_roles else None
        self.tokenizer = resolve_tokenizer(self.paths["actor"], self.assets.get("tokenizer", ""))

        s = self.settings = ppo_settings(cfg)
        steps_per_rollout = s.ppo_epochs * (s.rollout_batch_size // s.mini_batch_size)
        build_rlhf_roles(
            registry, self.paths["actor"], main_rm.path if main_rm else None, self.paths["critic"],
            actor=actor, critic=critic,
            ref=placement(roles.ref, actor, trainable=False), reward=main_rm.placement if main_rm else None,
            ema=Placement(actor.stage, cfg.ema.dtype or actor.dtype, cfg.ema.offload_params)
            if cfg.ema.enabled else None,
            actor_optim=optim_spec(roles.actor, cfg.max_steps * steps_per_rollout // roles.actor.grad_accum,
                                   betas=RLHF_BETAS),
            critic_optim=optim_spec(roles.critic, cfg.max_steps * steps_per_rollout // roles.critic.grad_accum,
                                    betas=RLHF_BETAS),
            micro_batch_size=s.mini_batch_size,
            actor_grad_accum=roles.actor.grad_accum, critic_grad_accum=roles.critic.grad_accum,
            actor_lora=lora_spec(cfg.lora.actor), critic_lora=lora_spec(cfg.lora.critic),
            actor_gradient_checkpointing=roles.actor.gradient_checkpointing,
            critic_gradient_checkpointing=roles.critic.gradient_checkpointing,
            seed=cfg.seed,
            extra_rewards=[(r.role, r.path, r.placement) for r in reward_roles if r.role != "reward"],
        )
        self.generation = GenerationSettings(
            max_new_tokens=cfg.generation.max_new_tokens, temperature=cfg.generation.temperature,
            top_k=cfg.generation.top_k, top_p=cfg.generation.top_p, mode=cfg.generation.mode, do_sample=True)
        self.greedy_generation = GenerationSettings(
            max_new_tokens=cfg.generation.max_new_tokens, mode=cfg.generation.mode, do_sample=False)
        self._setup_data()
        self.judge = builtin_judge([p for b in self.eval_batches for p in b["prompts"]], cfg.eval.judge)
        self.trainer = registry.add_state("ppo", PPOTrainer(
            registry, self.generation, s, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, seed=cfg.seed,
            judge=self.judge, decode=self.decode, rewards=self.rewards))
        only_rm = [x.name for x in self.rewards] == ["reward"]
        self.plot_panels = [("reward-model score" if only_rm else "reward (weighted sum)",
                             ["train/reward/mean", "eval/reward"])]
        if self.judge is not None:
            self.plot_panels.append(("judge score (built-in task)", ["train/judge/mean", "eval/judge"]))
        self.plot_panels.append(("KL to ref (nats per answer)", ["train/kl", "eval/kl"]))

    def _model_path(self, given: str, role: str, recipe: str) -> str:
        if not given:
            logger.warning("model.%s is empty: using the random tiny model %s (run rlhf_e2e for the whole "
                           "pipeline)", role, self.assets["model"])
            return self.assets["model"]
        # a missing local folder is an error here; "org/name" (one slash) or "name" is a hub model
        return check_model_path(f"model.{role}", given, recipe)

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        source = cfg.data.source or self.assets["data"]
        prompts = load_split(source, "ppo", registry, cfg.data.train_split)
        eval_rows = load_split(source, "eval", registry, cfg.data.eval_split)
        collate = PromptCollator(self.tokenizer, cfg.data.max_prompt_len)
        self.prompts = registry.add_state("prompts", ShardedBatches(
            prompts, collate, self.settings.rollout_batch_size, registry.world_size, registry.rank, seed=cfg.seed))
        self.eval_batches = shard_batches(eval_rows, collate, cfg.eval.batch_size, registry.world_size,
                                          registry.rank, limit=cfg.eval.size)
        self.ptx: ShardedBatches | None = None
        if self.settings.ptx_coef > 0:
            ptx_rows = load_split(cfg.data.ptx_source or source, "sft", registry, cfg.data.train_split)
            ptx_collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_ptx_len)
            self.ptx = registry.add_state("ptx", ShardedBatches(
                ptx_rows, ptx_collate, self.settings.mini_batch_size, registry.world_size, registry.rank,
                seed=cfg.seed + 1))

    def decode(self, response_ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(response_ids.cpu(), skip_special_tokens=True)

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # 1. this rank's next prompt batch (left padded; sharded, resumable sampler)
        batch = next(self.prompts)
        # 2.-5. inside trainer.step: generate (actor gathered once, or per token with synced_gpus);
        #    actor/ref log-probs, critic values, reward score (every rank, every role, one forward);
        #    per-token rewards = clipped score on the last action - beta * k1 KL; GAE; whitening over
        #    all ranks; ppo_epochs x minibatches of actor step then critic step; EMA; KL controller.
        #    The metrics come back as means over ranks.
        return self.trainer.step(batch, self.step, self.ptx)

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Sampled answers (seeded, as in training) to the evaluation prompts: judge score, reward, KL to
        ref; and optionally greedy answers' judge score and reward."""
        t0 = time.perf_counter()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        result = evaluate_policy(self.registry, self.eval_batches, self.generation, eos, pad, self.decode,
                                 judge=self.judge, reward_role=self.reward_role, ref_role="ref",
                                 seed=self.cfg.eval.seed)
        if self.cfg.eval.greedy:
            greedy = evaluate_policy(self.registry, self.eval_batches, self.greedy_generation, eos, pad,
                                     self.decode, judge=self.judge, reward_role=self.reward_role)
            result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        result["seconds"] = time.perf_counter() - t0
        return result

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        if not cfg.export.enabled:
            return {}
        out = {"actor": save_role(registry, "actor", self.path("export", "actor"), tokenizer=self.tokenizer)}
        if cfg.export.critic:
            out["critic"] = save_role(registry, "critic", self.path("export", "critic"), tokenizer=self.tokenizer)
        if cfg.export.ema and "ema" in registry:
            out["ema"] = save_role(registry, "ema", self.path("export", "ema"), tokenizer=self.tokenizer)
        return out

    def summary_metrics(self) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "final": self.step_metrics[-1] if self.step_metrics else {},
            "generation_mode": self.cfg.generation.mode,
            **{f"{key}_mean": self.mean_step_metric(key)
               for key in ("time/step_s", "time/generation_s", "time/experience_s", "time/train_s",
                           "gen/tokens_per_s", "gen/ms_per_token")},
        }
        metrics.update(self.eval_figures(("judge", "reward", "kl", "response_length", "greedy/judge",
                                          "greedy/reward")))
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths}

    def plot(self) -> str | None:
        path = super().plot()
        if self.registry.is_main:
            m = self.summary_metrics()
            if "eval/before/judge" in m and "eval/after/judge" in m:
                logger.info("judge score: %.3f before PPO -> %.3f after (KL to ref %.3f nats per answer)",
                            m["eval/before/judge"], m["eval/after/judge"], m.get("eval/after/kl", float("nan")))
        return path


main = RLHFPPO.main

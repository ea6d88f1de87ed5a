"""RLHF step 3: PPO with four engines - actor and critic trainable, ref and reward frozen (+ optional EMA).

    multiengine run rlhf_ppo --config tiny --nproc-per-node 2          # after rlhf_sft and rlhf_reward tiny
    multiengine run rlhf_ppo --config tiny --nproc-per-node 2 generation.mode=per_token roles.actor.stage=3
    multiengine run rlhf_ppo --config opt1.3b_opt350m --nproc-per-node 8

Every role is its own DeepSpeed engine with its own stage, dtype and offload (ref follows the actor,
reward the critic, unless set). Each role may have its own tokenizer (``model.tokenizer``,
``model.reward_tokenizer``, ``model.critic_tokenizer``; default: each folder's own): a reward model or critic
that tokenizes differently from the actor scores the actor's prompts and answers decoded and re-encoded with
its tokenizer (its chat template for conversations); one with the same vocabulary reads the actor's ids.
The reward is the ``reward`` role by default, or any weighted sum of
reward-model roles and Python reward functions named in ``reward.models`` / ``reward.functions`` (as in
rlhf_grpo; functions are written as for TRL and get the rows' other columns, e.g. ``answer``, by name).
Evaluation reports the held-out reward (``eval/reward``, the weighted sum, and ``eval/reward/<name>`` per
source). Writes metrics.jsonl, summary.json, curves.png, checkpoints/ and
export/{actor,critic}[/adapter] (and export/ema) under output_dir; ``resume_from=latest`` continues a run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
from multiengine.engines import Placement, ShardedBatches, save_role, shard_batches
from multiengine.pipelines.rlhf.data import PromptCollator, SFTCollator
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer
from multiengine.pipelines.rlhf.roles import build_rlhf_roles
from multiengine.pipelines.rlhf.runs import builtin_judge, prepare_tiny_assets
from multiengine.recipes.common import (
    COMMON_HELP,
    DATA_DEFAULTS,
    REWARD_DEFAULTS,
    RLHF_BETAS,
    check_data,
    check_model,
    check_model_path,
    check_reward_columns,
    check_scoring_tokenizers,
    check_stage_batches,
    check_tokenizer,
    load_data,
    lora_spec,
    optim_spec,
    placement,
    recipe_checks,
    retokenizers,
    reward_config,
    reward_entries,
    role_tokenizer,
    uses_builtin_data,
)
from multiengine.engines.recipe_config import Choice, Range, RecipeConfigError
from multiengine.recipes.lifecycle import COMMON_DEFAULTS, Recipe

logger = logging.getLogger(__name__)

KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_ppo", "everything the run writes goes under this folder"),
    "max_steps": Key(50, "PPO steps: one rollout batch each"),
    "model": Key({
        "actor": Key("", "step 1's export (actor and ref); \"\" = the random tiny model (mechanics only)"),
        "reward": Key("", "step 2's export or a *ForSequenceClassification model; \"\" = random tiny model, fresh "
                          "head"),
        "critic": Key("", "\"\" = the reward model (DeepSpeed-Chat); the actor's folder when rewards are functions "
                          "only"),
        "tokenizer": Key("", "the actor's tokenizer; \"\" = the actor folder's own"),
        "reward_tokenizer": Key("", "the reward model's; \"\" = its folder's own (re-encoded if it differs from the "
                                    "actor's)"),
        "critic_tokenizer": Key("", "the critic's; \"\" = its folder's own (model.reward_tokenizer for the reward's "
                                    "folder)"),
        "tiny_hidden": Key(64, "width of the random tiny model (empty model keys)"),
        "tiny_layers": Key(2, "layers of the random tiny model"),
    }, "the models of the four roles and their tokenizers"),
    "data": Key({
        **DATA_DEFAULTS,
        "ptx_source": Key("", "SFT rows for the pretraining loss (ppo.ptx_coef); \"\" = data.source's SFT rows"),
        "max_prompt_len": Key(16, "prompt tokens kept (a longer prompt loses its beginning)"),
        "max_ptx_len": Key(32, "response tokens kept of a pretraining row"),
    }, "prompts: prompt rows, or the prompts of any other RLHF format (docs/data.md)"),
    "generation": Key({
        "max_new_tokens": Key(8, "tokens generated per answer"),
        "temperature": Key(1.0, "sampling temperature (also divides the PPO logits)"),
        "top_k": Key(0, "0 = off"),
        "top_p": Key(1.0, "nucleus sampling (1 = off)"),
        "mode": Key("gather", "gather (actor gathered once per batch) | per_token (ZeRO-3 synced_gpus)"),
    }, "sampling of the rollouts"),
    "ppo": Key({
        "rollout_batch_size": Key(16, "prompts per rank per step"),
        "mini_batch_size": Key(8, "rows per rank per forward/backward"),
        "ppo_epochs": Key(1, "passes over one rollout"),
        "clip_eps": Key(0.2, "policy ratio clip"),
        "value_clip": Key(0.2, "0 = unclipped value loss"),
        "dual_clip": Key(0.0, "0 = off; > 1 (e.g. 3) caps the loss of negative-advantage tokens"),
        "gamma": Key(1.0, "discount"),
        "lam": Key(0.95, "GAE lambda"),
        "kl_coef": Key(0.1, "beta of the k1 KL penalty in the reward"),
        "adaptive_kl": Key(False, "adapt beta towards kl_target (Ziegler et al.)"),
        "kl_target": Key(6.0, "target KL per answer of the adaptive controller"),
        "kl_horizon": Key(10000, "horizon of the adaptive controller"),
        "clip_reward": Key(5.0, "0 = no clipping"),
        "whiten_advantages": Key(True, "whiten advantages over the whole rollout (all ranks)"),
        "no_eos_penalty": Key(0.0, "> 0: subtracted from the score of answers without EOS"),
        "ptx_coef": Key(0.0, "> 0: unsupervised (SFT data) loss mixed into the actor, as in DeepSpeed-Chat"),
        "critic_warmup_steps": Key(0, "first N steps train only the critic"),
        "shuffle_minibatches": Key(True, "seeded minibatch order"),
    }, "the PPO step"),
    "roles": Key({
        "actor": Key({
            "stage": Key(2, "ZeRO stage 0-3"),
            "dtype": Key("fp32", "fp32 | bf16 | fp16 (GPU only)"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "offload_optimizer": Key(False, "optimizer state offload to CPU"),
            "lr": Key(1e-5, "learning rate"),
            "weight_decay": Key(0.0, "AdamW weight decay"),
            "scheduler": Key("constant", "a transformers scheduler name"),
            "warmup_steps": Key(0, "linear warm-up steps"),
            "grad_accum": Key(1, "minibatches per optimizer step"),
            "gradient_checkpointing": Key(False, "recompute activations in backward (off while generating)"),
            "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
        }, "the policy"),
        "critic": Key({
            "stage": Key(2, "ZeRO stage 0-3"),
            "dtype": Key("fp32", "fp32 | bf16 | fp16 (GPU only)"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "offload_optimizer": Key(False, "optimizer state offload to CPU"),
            "lr": Key(5e-6, "learning rate"),
            "weight_decay": Key(0.0, "AdamW weight decay"),
            "scheduler": Key("constant", "a transformers scheduler name"),
            "warmup_steps": Key(0, "linear warm-up steps"),
            "grad_accum": Key(1, "minibatches per optimizer step"),
            "gradient_checkpointing": Key(False, "recompute activations in backward"),
            "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
        }, "the value model"),
        "ref": Key({
            "stage": Key(-1, "-1 = the actor's"),
            "dtype": Key("", "\"\" = the actor's"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "gather_forward": Key(False, "at ZeRO-3, one collective per forward call instead of one per layer"),
        }, "the frozen SFT policy"),
        "reward": Key({
            "stage": Key(-1, "-1 = the critic's"),
            "dtype": Key("", "\"\" = the critic's"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "gather_forward": Key(False, "at ZeRO-3, one collective per forward call instead of one per layer"),
        }, "the frozen reward model"),
    }, "placement and optimizer of each role"),
    "ema": Key({
        "enabled": Key(False, "keep and export the EMA"),
        "decay": Key(0.992, "EMA decay per step"),
        "dtype": Key("", "\"\" = the actor's"),
        "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
    }, "an exponential moving average of the actor"),
    # reward-model roles and reward functions, summed with weights (see recipes/common.py); empty = the
    # `reward` role from model.reward at roles.reward, weight 1
    "reward": Key({
        **REWARD_DEFAULTS,
    }, "the reward sources"),
    "lora": Key({
        "actor": Key({
            "enabled": Key(False, "train peft LoRA adapters only"),
            "rank": Key(8, "adapter rank"),
            "alpha": Key(0.0, "scaling (0 = the rank)"),
            "dropout": Key(0.0, "adapter dropout"),
            "target_modules": Key(["q_proj", "k_proj", "v_proj", "out_proj"], "module names that get adapters"),
        }, "on the actor"),
        "critic": Key({
            "enabled": Key(False, "train peft LoRA adapters only"),
            "rank": Key(8, "adapter rank"),
            "alpha": Key(0.0, "scaling (0 = the rank)"),
            "dropout": Key(0.0, "adapter dropout"),
            "target_modules": Key(["q_proj", "k_proj", "v_proj", "out_proj"], "module names that get adapters"),
        }, "on the critic's body (the value head trains fully)"),
    }, "LoRA adapters"),
    "eval": Key({
        "every": Key(10, "also every N steps (always before and after)"),
        "size": Key(256, "evaluation prompts (split evenly over ranks)"),
        "batch_size": Key(32, "prompts per generation batch"),
        "judge": Key(True, "the built-in task's programmatic judge (only for its prompts)"),
        "greedy": Key(True, "also score greedy answers (the main figures use sampled answers, seeded)"),
        "seed": Key(1234, "sampling seed of evaluation answers"),
    }, "sampled answers to the evaluation prompts (never the training prompts)"),
    "export": Key({
        "enabled": Key(True, "export/actor"),
        "critic": Key(True, "export/critic (*ForSequenceClassification)"),
        "ema": Key(True, "export/ema (with ema.enabled)"),
    }, "what the run writes under output_dir/export"),
}
CHECKS = recipe_checks(DEFAULTS, {
    "ppo.rollout_batch_size": Range(1), "ppo.mini_batch_size": Range(1), "ppo.ppo_epochs": Range(1),
    "ppo.clip_eps": Range(0, min_exclusive=True), "ppo.value_clip": Range(0), "ppo.dual_clip": Range(0),
    "ppo.gamma": Range(0, 1), "ppo.lam": Range(0, 1), "ppo.kl_coef": Range(0),
    "ppo.kl_target": Range(0, min_exclusive=True), "ppo.kl_horizon": Range(1), "ppo.clip_reward": Range(0),
    "ppo.no_eos_penalty": Range(0), "ppo.ptx_coef": Range(0), "ppo.critic_warmup_steps": Range(0),
    "generation.mode": Choice("gather", "per_token"),
})
HELP = {**COMMON_HELP, "reward.models": "reward-model roles [{role, path, weight, tokenizer, stage, ...}]",
        "reward.functions": "reward functions: pkg.mod:fn, /path/file.py:fn, builtin:judge or {fn, weight}",
        "reward.normalize": "running mean/std of the combined score over all ranks, before clipping"}


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


def _validate_settings(cfg: Any) -> None:
    """Reward sources and PPO settings, checked before any rank starts."""
    reward_entries(cfg.reward)
    try:
        ppo_settings(cfg)
    except ValueError as exc:
        raise RecipeConfigError(f"ppo: {exc}") from None


def _wants_reward_model(cfg: Any) -> bool:
    """The `reward` role's folder is model.reward when the reward config leaves it to it."""
    entries, functions = reward_entries(cfg.reward)
    return (not entries and not functions) or any(e["role"] == "reward" and not e["path"] for e in entries)


def _critic_source(cfg: Any) -> tuple[str, str]:
    """``(critic folder, its tokenizer key's value)`` as build() resolves them, from the config alone ("" for
    the tiny model)."""
    entries, _ = reward_entries(cfg.reward)
    if cfg.model.critic:
        return cfg.model.critic, cfg.model.critic_tokenizer
    main = next((e for e in entries if e["role"] == "reward"), entries[0] if entries else None)
    if main is not None or _wants_reward_model(cfg):
        path = (main or {}).get("path") or cfg.model.reward
        given = cfg.model.critic_tokenizer or (main or {}).get("tokenizer") or cfg.model.reward_tokenizer
        return path, given
    return cfg.model.actor, cfg.model.critic_tokenizer or cfg.model.tokenizer


def validate(cfg: Any, world_size: int = 1) -> None:
    """Every model folder, each role's tokenizer against its model's vocabulary (and its chat template when it
    re-encodes conversations), the prompts and evaluation prompts, the pretraining rows; on ``world_size`` ranks,
    a step's prompts (and pretraining rows) per rank."""
    _validate_settings(cfg)
    entries, _ = reward_entries(cfg.reward)
    check_model("model.actor", cfg.model.actor)
    check_model("model.critic", cfg.model.critic)
    if _wants_reward_model(cfg):
        check_model("model.reward", cfg.model.reward)
    for i, e in enumerate(entries):
        check_model(f"reward.models[{i}].path", e["path"])
    actor_tok = check_tokenizer("model.tokenizer", cfg.model.tokenizer, "model.actor", cfg.model.actor)
    report = check_data(cfg, "ppo", actor_tok, eval_stage="eval", tokenizer_key="model.tokenizer")
    if report is not None:  # the columns each reward function names are in the prompts' rows
        check_reward_columns(cfg.reward, report["columns"])
    ptx = None
    if cfg.ppo.ptx_coef > 0:
        ptx = check_data(cfg, "sft", actor_tok, source=cfg.data.ptx_source or None,
                         key="data.ptx_source" if cfg.data.ptx_source else None, evaluate=False)
    check_batches(cfg, report, world_size, ptx)
    conversational = bool(report and report["conversational"])
    roles = [(e["role"], e["path"] or cfg.model.reward, e.get("tokenizer") or
              (cfg.model.reward_tokenizer if e["role"] == "reward" else ""),
              f"reward.models[{i}].tokenizer" if e.get("tokenizer") else "model.reward_tokenizer")
             for i, e in enumerate(entries)]
    if not entries and _wants_reward_model(cfg):
        roles.append(("reward", cfg.model.reward, cfg.model.reward_tokenizer, "model.reward_tokenizer"))
    critic_path, critic_tok = _critic_source(cfg)
    roles.append(("critic", critic_path, critic_tok, "model.critic_tokenizer"))
    if cfg.model.actor:
        check_scoring_tokenizers(actor_tok, [r for r in roles if r[1]], conversational)



def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, ptx: dict[str, Any] | None = None,
                  setting: str = "{key}={n}") -> None:
    """A step draws ppo.rollout_batch_size prompts per rank from one stream and, with ppo.ptx_coef > 0,
    ppo.mini_batch_size pretraining rows per minibatch from another (all of its rows: none are held out)."""
    check_stage_batches(report, world_size, key="ppo.rollout_batch_size", value=cfg.ppo.rollout_batch_size,
                        unit="prompts", setting=setting)
    if cfg.ppo.ptx_coef > 0:
        check_stage_batches(ptx, world_size, key="ppo.mini_batch_size", value=cfg.ppo.mini_batch_size,
                            unit="pretraining rows", what="ppo.ptx_coef > 0 draws that many per minibatch",
                            setting=setting)

class RLHFPPO(Recipe):
    name = "rlhf_ppo"
    headline = (("judge", "judge score of sampled answers (built-in task)", True),
                ("reward", "held-out reward (weighted sum of the reward sources)", True))
    plot_xlabel = "PPO step"
    postfix_keys = ("reward/mean", "kl")

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        self.assets: dict[str, str] = {}
        wants_rm = _wants_reward_model(cfg)
        if uses_builtin_data(cfg.data) or not cfg.model.actor or (wants_rm and not cfg.model.reward):
            self.assets = prepare_tiny_assets(self.path("tiny"), registry, cfg.seed, cfg.model.tiny_hidden,
                                              cfg.model.tiny_layers)
        self.paths = {"actor": self._model_path(cfg.model.actor, "actor", "rlhf_sft")}
        roles = cfg.roles
        actor, critic = placement(roles.actor), placement(roles.critic)
        default_rm = self._model_path(cfg.model.reward, "reward", "rlhf_reward") if wants_rm else None
        reward_roles, rewards = reward_config(cfg.reward, default_rm, placement(roles.reward, critic, trainable=False))
        for r in reward_roles:
            self.paths[r.role] = check_model_path(f"reward.models ({r.role}) path", r.path, "rlhf_reward")
        main_rm = next((r for r in reward_roles if r.role == "reward"), None)
        critic_given = cfg.model.critic_tokenizer
        if cfg.model.critic:
            self.paths["critic"] = self._model_path(cfg.model.critic, "critic", "rlhf_reward")
        elif reward_roles:  # DeepSpeed-Chat: the critic starts from the reward model (and reads its tokens)
            rm = main_rm or reward_roles[0]
            self.paths["critic"] = rm.path
            critic_given = critic_given or rm.tokenizer or (cfg.model.reward_tokenizer if rm.role == "reward" else "")
        else:
            logger.info("rewards from functions only: the critic starts from the actor's folder with a fresh head")
            self.paths["critic"] = self.paths["actor"]
            critic_given = critic_given or cfg.model.tokenizer
        self.reward_role = (main_rm or reward_roles[0]).role if reward_roles else None
        tiny_tok = role_tokenizer("", self.assets["tokenizer"]) if self.assets else None
        self.tokenizer = role_tokenizer(cfg.model.tokenizer, self.paths["actor"], tiny_tok, what="model.actor")

        # the prompts first: whether they are conversations decides how other tokenizers re-encode them
        self._setup_data()
        scoring = [(r.role, r.path, r.tokenizer or (cfg.model.reward_tokenizer if r.role == "reward" else ""))
                   for r in reward_roles] + [("critic", self.paths["critic"], critic_given)]
        self.tokenizers, self.retokenizers = retokenizers(self.tokenizer, scoring, self.conversational)
        self.rewards = [replace(src, retokenizer=self.retokenizers.get(src.role)) if src.role else src
                        for src in rewards]
        check_reward_columns(self.rewards, self.data_columns)

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
        self.judge = builtin_judge([p for b in self.eval_batches for p in b["prompts"]], cfg.eval.judge)
        self.trainer = registry.add_state("ppo", PPOTrainer(
            registry, self.generation, s, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, seed=cfg.seed,
            judge=self.judge, decode=self.decode, rewards=self.rewards,
            critic_retokenizer=self.retokenizers.get("critic")))
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
        # prompts to train on; evaluation prompts that are never trained on
        data = load_data(self, "ppo", eval_stage="eval", default_source=self.assets.get("data", ""))
        collate = PromptCollator(self.tokenizer, cfg.data.max_prompt_len)
        first = collate([data.train[0]])
        self.conversational = "prompt_messages" in first
        self.data_columns = {"train": data.train.column_names,
                             "eval": data.eval.column_names if data.eval is not None else None}
        self.prompts = registry.add_state("prompts", ShardedBatches(
            data.train, collate, cfg.ppo.rollout_batch_size, registry.world_size, registry.rank, seed=cfg.seed))
        self.eval_batches = [] if data.eval is None or not cfg.eval.size else shard_batches(
            data.eval, collate, cfg.eval.batch_size, registry.world_size, registry.rank, limit=cfg.eval.size)
        self.ptx: ShardedBatches | None = None
        if cfg.ppo.ptx_coef > 0:
            ptx = load_data(self, "sft", default_source=self.assets.get("data", ""), evaluate=False,
                            source=cfg.data.ptx_source or None)
            ptx_collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_ptx_len)
            self.ptx = registry.add_state("ptx", ShardedBatches(
                ptx.train, ptx_collate, cfg.ppo.mini_batch_size, registry.world_size, registry.rank,
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
        """Sampled answers (seeded, as in training) to the evaluation prompts: judge score, the held-out reward
        (weighted sum and each source's mean, every rank scoring its own prompts), KL to ref; and optionally
        greedy answers' judge score and reward."""
        t0 = time.perf_counter()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if not self.eval_batches:
            return {}
        result = evaluate_policy(self.registry, self.eval_batches, self.generation, eos, pad, self.decode,
                                 judge=self.judge, ref_role="ref", seed=self.cfg.eval.seed, rewards=self.rewards)
        if self.cfg.eval.greedy:
            greedy = evaluate_policy(self.registry, self.eval_batches, self.greedy_generation, eos, pad,
                                     self.decode, judge=self.judge, rewards=self.rewards)
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
            out["critic"] = save_role(registry, "critic", self.path("export", "critic"),
                                      tokenizer=self.tokenizers["critic"])  # the critic's own tokenizer
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
                                          "greedy/reward", *(f"reward/{src.name}" for src in self.rewards))))
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths,
                "reencoded": {role: r is not None for role, r in self.retokenizers.items()}}

    def plot(self) -> str | None:
        path = super().plot()
        if self.registry.is_main:
            m = self.summary_metrics()
            if "eval/before/judge" in m and "eval/after/judge" in m:
                logger.info("judge score: %.3f before PPO -> %.3f after (KL to ref %.3f nats per answer)",
                            m["eval/before/judge"], m["eval/after/judge"], m.get("eval/after/kl", float("nan")))
        return path


main = RLHFPPO.main

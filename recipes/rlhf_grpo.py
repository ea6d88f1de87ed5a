"""Critic-free RL on the registry: GRPO, Dr. GRPO, RLOO or REINFORCE++ with an actor, a frozen ref and
reward sources (reward-model roles and/or Python reward functions); no critic.

    multiengine run rlhf_grpo --config tiny --nproc-per-node 2              # SFT actor trained here first
    multiengine run rlhf_grpo --config tiny --nproc-per-node 2 grpo.algorithm=rloo
    multiengine run rlhf_grpo --config tiny --nproc-per-node 2 'reward.models=[{role: reward, weight: 1.0}]' \\
        reward.functions=[] roles.reward.model=outputs/rlhf_reward/export/reward
    multiengine run rlhf_grpo --config opt1.3b --nproc-per-node 8

Each step samples ``grpo.n_samples_per_prompt`` answers to each of a rank's prompts, scores them with the
weighted reward sources, turns each prompt's group of scores into advantages (``grpo.algorithm``) and runs
clipped policy-gradient steps on the actor (KL to the ref as a k3 loss term or a k1 reward penalty). The
actor is at ZeRO-3 with gather-once generation by default; ``ref`` follows its placement. With no
``roles.actor.model`` the tiny SFT actor is trained first under ``output_dir/sft`` (rlhf_sft, in this process).
Reward functions are written as for TRL (``fn(prompts, completions, **kwargs)``: the rows' other columns,
e.g. ``answer``, arrive as keyword arguments). Evaluation reports the held-out reward (``eval/reward``, the
weighted sum, and ``eval/reward/<name>`` per source); a run whose groups are mostly flat (every answer to a
prompt scored the same) for ``grpo.flat_warn_steps`` steps gets a warning with what to change.
Writes metrics.jsonl, summary.json (``metrics["eval/before/judge"]`` / ``["eval/after/judge"]`` on the
built-in task), curves.png, checkpoints/ and export/actor under output_dir; ``resume_from=latest``
continues a run exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
from multiengine.engines import ShardedBatches, save_role, shard_batches
from multiengine.engines.recipe_config import Choice, Key, Range, RecipeConfigError, config_problem, split_keys
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PromptCollator, prompt_text
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer
from multiengine.pipelines.rlhf.rewards import judge_reward
from multiengine.pipelines.rlhf.roles import actor_spec, ref_spec, reward_spec
from multiengine.pipelines.rlhf.runs import builtin_judge
from multiengine.recipes.common import (
    DATA_KEYS,
    REWARD_KEYS,
    RLHF_TRAINABLE,
    TINY_KEYS,
    check_data,
    check_model,
    check_model_path,
    check_reward_columns,
    check_scoring_tokenizers,
    check_sft_run_batches,
    check_stage_batches,
    check_tokenizer,
    data_overrides,
    load_data,
    recipe_checks,
    retokenizers,
    reward_config,
    reward_tokenizer_checks,
    role_tokenizer,
    sft_model,
    tiny_assets,
    uses_builtin_data,
)
from multiengine.recipes.lifecycle import COMMON_KEYS, Recipe
from multiengine.recipes.schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys

logger = logging.getLogger(__name__)

ROLES = (
    Role("actor", "the policy (an SFT model); model \"\" = the tiny SFT actor trained first under output_dir/sft "
                  "(actor_sft)", trainable=True,
         keys={**RLHF_TRAINABLE, "dtype": "fp32", "lr": 1e-3, "micro_batch_size": 32,
               "gradient_checkpointing": Key(False, "recompute activations in backward (off while generating)")}),
    Role("ref", "the frozen SFT policy (the actor's folder; none when grpo.kl_coef is 0)", follows="actor",
         weights="actor"),
    Role("reward", "the frozen `reward` role (when reward.models names it) and the placement of every reward model "
                   "(each reward.models entry may override)", follows="actor"),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_grpo", "everything the run writes goes under this folder"),
    "max_steps": Key(100, "steps: one rollout and its policy update each"),
    "roles": role_keys(ROLES),
    "tiny": TINY_KEYS,
    "actor_sft": Key({
        "config": Key("tiny", "a shipped rlhf_sft config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "how the tiny SFT actor is trained (rlhf_sft) when roles.actor.model is empty"),
    "data": Key({
        **DATA_KEYS,
        "max_prompt_len": Key(16, "prompt tokens kept (a longer prompt loses its beginning)"),
    }, "prompts: prompt rows, or the prompts of any other RLHF format (docs/data.md)"),
    "generation": Key({
        "max_new_tokens": Key(8, "tokens generated per answer (Dr. GRPO's normalising constant)"),
        "temperature": Key(1.0, "sampling temperature (also divides the logits of the update)"),
        "top_k": Key(0, "0 = off"),
        "top_p": Key(1.0, "nucleus sampling (1 = off)"),
        "mode": Key("gather", "gather (actor gathered once per batch) | per_token (ZeRO-3 synced_gpus)"),
    }, "sampling of the rollouts"),
    "grpo": Key({
        "algorithm": Key("grpo", "grpo | dr_grpo | rloo | reinforce_pp"),
        "n_samples_per_prompt": Key(8, "completions per prompt (a group; >= 2 except reinforce_pp)"),
        "rollout_batch_size": Key(8, "prompts per rank per step (rows = prompts x samples, a multiple of "
                                     "roles.actor.micro_batch_size)"),
        "epochs": Key(1, "passes over one rollout (1 = ratio 1, the plain policy gradient)"),
        "clip_eps": Key(0.2, "policy ratio clip"),
        "dual_clip": Key(0.0, "0 = off; > 1 caps the loss of negative-advantage tokens"),
        "kl_coef": Key(0.04, "beta; 0 = no KL and no ref role"),
        "kl_in_reward": Key(None, "null = the algorithm's (k3 loss for grpo/dr_grpo, k1 reward for rloo/reinforce_pp)"),
        "kl_clamp": Key(0.0, "0 = off; clamp each token's KL estimate to +/- this"),
        "loss_agg": Key("", "\"\" = the algorithm's | token_mean | seq_mean_token_mean | seq_mean_token_sum_norm"),
        "gamma": Key(1.0, "discount of the returns-to-go"),
        "std_eps": Key(1.0e-6, "added to the group std (grpo)"),
        "clip_reward": Key(5.0, "0 = no clipping"),
        "no_eos_penalty": Key(0.0, "> 0: subtracted from the score of answers without EOS"),
        "shuffle_minibatches": Key(True, "seeded minibatch order"),
        "flat_warn_share": Key(0.8, "warn when more than this share of groups has all-equal rewards (1 = never) ..."),
        "flat_warn_steps": Key(5, "... for this many steps in a row"),
    }, "the critic-free estimator"),
    "reward": Key(dict(REWARD_KEYS), "the reward sources: reward-model roles and functions, summed with weights"),
    "eval": Key({
        "every": Key(25, "also every N steps (always before and after)"),
        "size": Key(256, "evaluation prompts (split evenly over ranks)"),
        "batch_size": Key(32, "prompts per generation batch"),
        "judge": Key(True, "the built-in task's programmatic judge (only for its prompts)"),
        "greedy": Key(False, "also score greedy answers"),
        "seed": Key(1234, "sampling seed of evaluation answers"),
    }, "sampled answers to the evaluation prompts (never the training prompts)"),
    "export": Key({
        "enabled": Key(True, "export/actor"),
    }, "what the run writes under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = recipe_checks(DEFAULTS, {
    "grpo.algorithm": Choice("grpo", "dr_grpo", "rloo", "reinforce_pp"),
    "grpo.n_samples_per_prompt": Range(1), "grpo.rollout_batch_size": Range(1),
    "grpo.epochs": Range(1), "grpo.clip_eps": Range(0, min_exclusive=True), "grpo.dual_clip": Range(0),
    "grpo.kl_coef": Range(0), "grpo.kl_clamp": Range(0),
    "grpo.loss_agg": Choice("", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "grpo.gamma": Range(0, 1), "grpo.std_eps": Range(0), "grpo.clip_reward": Range(0),
    "grpo.no_eos_penalty": Range(0), "generation.mode": Choice("gather", "per_token"),
    "grpo.flat_warn_share": Range(0, 1), "grpo.flat_warn_steps": Range(1),
})
RENAMED = old_keys("actor", model="model.actor", extra={
    "model.reward": "roles.reward.model", "model.reward_tokenizer": "roles.reward.tokenizer",
    "model.tiny_hidden": "tiny.hidden", "model.tiny_layers": "tiny.layers",
    "grpo.mini_batch_size": "roles.actor.micro_batch_size", "lora.actor.*": "roles.actor.lora.*",
    "lora.actor.rank": "roles.actor.lora.r",
    "lora.actor.enabled": "roles.actor.lora.r (to the adapter rank, e.g. 8; 0 = no LoRA)",
})


def grpo_settings(cfg: Any) -> GRPOSettings:
    g = cfg.grpo
    return GRPOSettings(
        algorithm=g.algorithm, n_samples_per_prompt=g.n_samples_per_prompt, rollout_batch_size=g.rollout_batch_size,
        mini_batch_size=cfg.roles.actor.micro_batch_size, epochs=g.epochs, clip_eps=g.clip_eps,
        dual_clip=g.dual_clip or None, kl_coef=g.kl_coef, kl_in_reward=g.kl_in_reward, kl_clamp=g.kl_clamp or None,
        loss_agg=g.loss_agg or None, gamma=g.gamma, std_eps=g.std_eps, clip_reward=g.clip_reward or None,
        normalize_rewards=cfg.reward.normalize, no_eos_penalty=g.no_eos_penalty or None,
        shuffle_minibatches=g.shuffle_minibatches, flat_warn_share=g.flat_warn_share,
        flat_warn_steps=g.flat_warn_steps)


def rewards_of(cfg: Any, strict: bool = True) -> tuple[list[Any], list[Any]]:
    """The reward-model roles and the reward sources (reward.models and reward.functions; the `reward` role's
    folder is roles.reward.model). ``strict=False``: a folder left empty is not an error yet (validate)."""
    named = bool(cfg.reward.models) or bool(cfg.reward.functions)
    fallback = cfg.roles.reward.model or ("" if named and not strict else None)
    return reward_config(cfg.reward, fallback, placement(cfg, ROLES, "reward"),
                         default_tokenizer=cfg.roles.reward.tokenizer)


def _validate_settings(cfg: Any) -> None:
    """Algorithm settings, reward sources and batch shapes, checked before any rank starts."""
    g, actor = cfg.grpo, cfg.roles.actor
    if g.kl_in_reward is not None and not isinstance(g.kl_in_reward, bool):
        raise RecipeConfigError(f"grpo.kl_in_reward={g.kl_in_reward!r}: use null (the algorithm's "
                                "default), true (k1 in the reward) or false (k3 loss term).")
    rows = g.rollout_batch_size * g.n_samples_per_prompt
    try:
        grpo_settings(cfg)
    except ValueError as exc:
        if "mini_batch_size" not in str(exc):
            raise RecipeConfigError(f"grpo: {exc}") from None
        raise config_problem("grpo.rollout_batch_size", g.rollout_batch_size,
                             f"x grpo.n_samples_per_prompt={g.n_samples_per_prompt} = {rows} rows per rank is not a "
                             f"multiple of roles.actor.micro_batch_size={actor.micro_batch_size} (the update's "
                             "minibatches)", "change one of the three") from None
    minibatches = rows // actor.micro_batch_size
    if minibatches % actor.grad_accum:
        raise RecipeConfigError(
            f"roles.actor.grad_accum={actor.grad_accum} does not divide the {minibatches} minibatches of a rollout "
            "(grpo.rollout_batch_size x grpo.n_samples_per_prompt / roles.actor.micro_batch_size); change one of them.")
    rewards_of(cfg, strict=False)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folders, each role's tokenizer against its model's vocabulary (and chat template when it re-encodes
    conversations), the prompts and evaluation prompts; with no roles.actor.model, the data the SFT actor trains on.
    On ``world_size`` ranks: a step's prompts per rank (and the SFT run's micro batch)."""
    _validate_settings(cfg)
    r = cfg.roles
    models, _ = rewards_of(cfg, strict=False)
    check_model("roles.actor.model", r.actor.model)
    check_model("roles.reward.model", r.reward.model)
    for m in models:
        if m.path != r.reward.model:
            check_model(f"reward.models ({m.role}).model", m.path)
    actor_tok = check_tokenizer("roles.actor.tokenizer", r.actor.tokenizer, "roles.actor.model", r.actor.model)
    report = check_data(cfg, "ppo", actor_tok, eval_stage="eval", tokenizer_key="roles.actor.tokenizer")
    if report is not None:  # the columns each reward function names are in the prompts' rows
        check_reward_columns(cfg.reward, report["columns"])
    if not r.actor.model:
        sft = check_data(cfg, "sft", None)  # the tiny SFT actor trains on the same data first
        check_sft_run_batches(cfg.actor_sft, sft, world_size, "actor_sft", "actor")
    check_batches(cfg, report, world_size)
    if r.actor.model:
        check_scoring_tokenizers(actor_tok, [s for s in reward_tokenizer_checks(models) if s[1]],
                                 bool(report and report["conversational"]))


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """A step draws grpo.rollout_batch_size prompts per rank (each sampled grpo.n_samples_per_prompt times: the
    group) from one stream; how the group's rows split into minibatches is _validate_settings'."""
    g = cfg.grpo
    check_stage_batches(report, world_size, key="grpo.rollout_batch_size", value=g.rollout_batch_size,
                        unit="prompts", setting=setting,
                        what=f"each sampled grpo.n_samples_per_prompt={g.n_samples_per_prompt} times")


class RLHFGRPO(Recipe):
    name = "rlhf_grpo"
    headline = (("judge", "judge score of sampled answers (built-in task)", True),
                ("reward", "held-out reward (weighted sum of the reward sources)", True))
    plot_xlabel = "step"
    postfix_keys = ("reward/mean", "kl")

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry, r = self.cfg, self.registry, self.cfg.roles
        # 1. the actor (SFT model, trained here on first use), tokenizer and data source
        assets = tiny_assets(self, uses_builtin_data(cfg.data) or not r.actor.model)
        builtin = assets.get("data", "")
        actor_path = check_model_path("roles.actor.model", r.actor.model, "rlhf_sft") or sft_model(
            self, cfg.actor_sft, self.path("sft"), data_overrides(cfg.data, builtin or None), assets["model"])
        tiny_tok = role_tokenizer("", assets["tokenizer"]) if assets else None
        self.tokenizer = role_tokenizer(r.actor.tokenizer, actor_path, tiny_tok, what="roles.actor.model")
        self.paths = {"actor": actor_path}

        # 2. data: prompts (checkpointed stream), evaluation prompts never trained on; the built-in judge
        collate = PromptCollator(self.tokenizer, cfg.data.max_prompt_len)
        data = load_data(self, "ppo", eval_stage="eval", default_source=builtin)
        conversational = "prompt_messages" in collate([data.train[0]])

        # 3. roles: actor (trainable), ref (frozen; none when kl_coef = 0), every reward-model role (each with
        #    its own tokenizer: re-encoded when it differs from the actor's)
        s = self.settings = grpo_settings(cfg)
        reward_roles, rewards = rewards_of(cfg)
        self.tokenizers, self.retokenizers = retokenizers(
            self.tokenizer, [(m.role, m.path, m.tokenizer) for m in reward_roles], conversational)
        self.rewards = [replace(src, retokenizer=self.retokenizers.get(src.role)) if src.role else src
                        for src in rewards]
        self._check_builtin_reward(data.train)
        check_reward_columns(self.rewards, {"train": data.train.column_names,
                                            "eval": data.eval.column_names if data.eval is not None else None})
        updates = cfg.max_steps * s.epochs * (s.rollout_batch_size * s.n_samples_per_prompt // s.mini_batch_size)
        registry.add(actor_spec(
            actor_path, placement(cfg, ROLES, "actor"), optim_spec(cfg, "actor", updates // r.actor.grad_accum),
            micro_batch_size=r.actor.micro_batch_size, grad_accum=r.actor.grad_accum, lora=lora_spec(cfg, "actor"),
            gradient_checkpointing=r.actor.gradient_checkpointing, seed=cfg.seed))
        self.ref = "ref" if s.kl_coef > 0 else None
        if self.ref:
            registry.add(ref_spec(actor_path, placement(cfg, ROLES, "ref")))
            self.paths["ref"] = actor_path
        for m in reward_roles:
            self.paths[m.role] = check_model_path(f"reward.models ({m.role}) model", m.path, "rlhf_reward")
            registry.add(reward_spec(m.path, m.placement, name=m.role))
        registry.build()
        self.reward_role = reward_roles[0].role if reward_roles else None

        self.prompts = registry.add_state("prompts", ShardedBatches(
            data.train, collate, s.rollout_batch_size, registry.world_size, registry.rank, seed=cfg.seed))
        self.eval_batches = [] if data.eval is None or not cfg.eval.size else shard_batches(
            data.eval, collate, cfg.eval.batch_size, registry.world_size, registry.rank, limit=cfg.eval.size)
        self.judge = builtin_judge([p for b in self.eval_batches for p in b["prompts"]], cfg.eval.judge)

        # 4. the trainer: its state (reward normaliser) goes into every checkpoint
        gen = cfg.generation
        self.generation = GenerationSettings(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                             top_k=gen.top_k, top_p=gen.top_p, mode=gen.mode, do_sample=True)
        self.greedy_generation = GenerationSettings(max_new_tokens=gen.max_new_tokens, mode=gen.mode, do_sample=False)
        self.trainer = registry.add_state("grpo", GRPOTrainer(
            registry, self.generation, s, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, self.rewards,
            self.decode, ref=self.ref, seed=cfg.seed, judge=self.judge))
        self.plot_panels = []
        if [src.fn for src in self.rewards] != [judge_reward] or self.judge is None:  # else the judge panel has it
            self.plot_panels.append(("reward (weighted sum)", ["train/reward/mean", "eval/reward"]))
        if self.reward_role:
            self.plot_panels.append((f"reward-model score ({self.reward_role})",
                                     [f"train/reward/{self.reward_role}", f"eval/reward/{self.reward_role}"]))
        if self.judge is not None:
            self.plot_panels.append(("judge score (built-in task)", ["train/judge/mean", "eval/judge"]))
        if self.ref:
            self.plot_panels.append(("KL to ref (nats per answer)", ["train/kl", "eval/kl"]))

    def _check_builtin_reward(self, rows: Any) -> None:
        """builtin:judge scores only the built-in task's prompts: anything else would score 0 everywhere."""
        if not any(src.fn is judge_reward for src in self.rewards):
            return
        sample = [prompt_text(rows[i]["prompt"]) for i in range(min(len(rows), 64))]
        if not all(tiny.parse_prompt(p) is not None for p in sample):
            bad = next(p for p in sample if tiny.parse_prompt(p) is None)
            raise RecipeConfigError(f"reward.functions has builtin:judge, which scores only the built-in task's prompts"
                                    f" (e.g. 'list 3 fruits :'); data.source={self.cfg.data.source!r} has {bad!r}. "
                                    "Use your own reward function or a reward model.")

    def decode(self, response_ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(response_ids.cpu(), skip_special_tokens=True)

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # 1. this rank's next prompts (left padded; sharded, resumable stream)
        batch = next(self.prompts)
        # 2.-5. inside trainer.step: each prompt n times in consecutive rows; sample (actor gathered once, or
        #    per token), seeded by (seed, step, rank); actor and ref log-probs and every reward source (every
        #    rank, every role); group advantages; epochs x minibatches of clipped policy-gradient steps (+ k3
        #    KL loss). The metrics come back as means over ranks.
        return self.trainer.step(batch, self.step)

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Sampled answers (seeded, as in training) to the evaluation prompts: judge score, the held-out reward
        (weighted sum and each source's mean, every rank scoring its own prompts), exact KL to ref; optionally
        greedy answers."""
        if not self.eval_batches:
            return {}
        t0 = time.perf_counter()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        result = evaluate_policy(self.registry, self.eval_batches, self.generation, eos, pad, self.decode,
                                 judge=self.judge, ref_role=self.ref, seed=self.cfg.eval.seed, rewards=self.rewards)
        if self.cfg.eval.greedy:
            greedy = evaluate_policy(self.registry, self.eval_batches, self.greedy_generation, eos, pad, self.decode,
                                     judge=self.judge, rewards=self.rewards)
            result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        result["seconds"] = time.perf_counter() - t0
        return result

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        return {"actor": save_role(self.registry, "actor", self.path("export", "actor"), tokenizer=self.tokenizer)}

    def summary_metrics(self) -> dict[str, Any]:
        s = self.settings
        metrics: dict[str, Any] = {
            "algorithm": s.algorithm, "loss_agg": s.resolved_loss_agg, "kl_in_reward": s.resolved_kl_in_reward,
            "final": self.step_metrics[-1] if self.step_metrics else {},
            "generation_mode": self.cfg.generation.mode,
            **{f"{key}_mean": self.mean_step_metric(key)
               for key in ("time/step_s", "time/generation_s", "time/experience_s", "time/train_s",
                           "gen/tokens_per_s", "gen/ms_per_token")},
        }
        metrics.update(self.eval_figures(("judge", "reward", "kl", "response_length", "greedy/judge",
                                          *(f"reward/{src.name}" for src in self.rewards))))
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths, "rewards": [{"name": r.name, "weight": r.weight,
                                                  "kind": "model" if r.role else "function"} for r in self.rewards]}

    def plot_title(self) -> str:
        return f"{self.name}: {self.settings.algorithm} ({self.registry.world_size} ranks)"

    def plot(self) -> str | None:
        path = super().plot()
        if self.registry.is_main:
            m = self.summary_metrics()
            if "eval/before/judge" in m and "eval/after/judge" in m:
                logger.info("%s: judge score %.3f before -> %.3f after (KL to ref %.3f nats per answer)",
                            self.settings.algorithm, m["eval/before/judge"], m["eval/after/judge"],
                            m.get("eval/after/kl", float("nan")))
        return path


main = RLHFGRPO.main

"""RLHF step 3: PPO with four engines - actor and critic trainable, ref and reward frozen (+ optional EMA).

    multiengine run rlhf_ppo --config tiny --nproc-per-node 2          # after rlhf_sft and rlhf_reward tiny
    multiengine run rlhf_ppo --config tiny --nproc-per-node 2 generation.mode=per_token roles.actor.stage=3
    multiengine run rlhf_ppo --config opt1.3b_opt350m --nproc-per-node 8

Every role is its own DeepSpeed engine with its own stage, dtype, offload and tokenizer (a scoring role that
tokenizes differently from the actor reads the actor's text re-encoded). The reward is the ``reward`` role, or a
weighted sum of reward-model roles and Python reward functions (``reward.models`` / ``reward.functions``, as in
rlhf_grpo). Evaluation reports the judge's score and the held-out reward; exports export/{actor,critic} (and
export/ema). docs/rlhf.md has the roles, the step and the math.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from multiengine.engines import ShardedBatches, save_role
from multiengine.engines import role_schema as schema
from multiengine.engines.recipe_config import Key, Range, RecipeConfigError, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, model_path, old_keys, optim_spec, placement, role_keys
from multiengine.pipelines.rlhf.data import SFTCollator
from multiengine.pipelines.rlhf.ppo_trainer import SUMMARY_TIMINGS, PPOSettings, PPOTrainer, plot_panels
from multiengine.pipelines.rlhf.retokenize import retokenizers
from multiengine.pipelines.rlhf.reward_sources import with_retokenizers
from multiengine.pipelines.rlhf.roles import build_rlhf_roles
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, REWARD_KEYS, RLHF_TRAINABLE, ROLLOUT_KEYS, TINY_KEYS

logger = logging.getLogger(__name__)

_TRAIN = {**RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-4, "micro_batch_size": 16}
ROLES = (
    Role("actor", "the policy: step 1's export; model \"\" = the random tiny OPT (mechanics only)", trainable=True,
         keys={**_TRAIN, "gradient_checkpointing": Key(False, "recompute activations in backward (off while "
                                                               "generating)")}),
    Role("critic", "the value model (LM body + value head); model \"\" = the reward model's (DeepSpeed-Chat), the "
                   "actor's when rewards are functions only",
         trainable=True, weights="reward", keys=_TRAIN),
    Role("ref", "the frozen SFT policy (the actor's folder)", follows="actor", weights="actor"),
    Role("reward", "the frozen reward model: step 2's export or a *ForSequenceClassification model; model \"\" = "
                   "the random tiny model with a fresh head", follows="critic"),
    Role("ema", "an exponential moving average of the actor (ema.enabled), built at the actor's stage",
         follows="actor", weights="actor"),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_ppo", "everything the run writes goes under this folder"),
    "max_steps": Key(150, "PPO steps: one rollout batch each"),
    "roles": role_keys(ROLES),
    "tiny": TINY_KEYS,
    "data": Key({
        **DATA_KEYS,
        "ptx_source": Key("", "SFT rows for the pretraining loss (ppo.ptx_coef); \"\" = data.source's SFT rows"),
        "max_prompt_len": common.PROMPT_LEN,
        "max_ptx_len": Key(32, "response tokens kept of a pretraining row"),
    }, "prompts: prompt rows, or the prompts of any other RLHF format (docs/data.md)"),
    "generation": Key(dict(ROLLOUT_KEYS), "sampling of the rollouts and of the evaluation answers"),
    "ppo": Key({
        "rollout_batch_size": Key(32, "prompts per rank per step (a multiple of roles.actor.micro_batch_size)"),
        "epochs": Key(2, "passes over one rollout"),
        "clip_eps": Key(0.2, "policy ratio clip"),
        "value_clip": Key(0.2, "0 = unclipped value loss", Range(0)),
        "dual_clip": Key(0.0, "0 = off; > 1 (e.g. 3) caps the loss of negative-advantage tokens"),
        "gamma": Key(1.0, "discount"),
        "lam": Key(0.95, "GAE lambda", Range(0, 1)),
        "kl_coef": Key(0.1, "beta of the k1 KL penalty in the reward"),
        "adaptive_kl": Key(False, "adapt beta towards kl_target (Ziegler et al.)"),
        "kl_target": Key(6.0, "target KL per answer of the adaptive controller", Range(0, min_exclusive=True)),
        "kl_horizon": Key(10000, "horizon of the adaptive controller", Range(1)),
        "clip_reward": Key(5.0, "0 = no clipping"),
        "whiten_advantages": Key(True, "whiten advantages over the whole rollout (all ranks)"),
        "no_eos_penalty": Key(0.0, "> 0: subtracted from the score of answers without EOS"),
        "ptx_coef": Key(0.0, "> 0: unsupervised (SFT data) loss mixed into the actor, as in DeepSpeed-Chat", Range(0)),
        "critic_warmup_steps": Key(0, "first N steps train only the critic", Range(0)),
        "shuffle_minibatches": Key(True, "seeded minibatch order"),
    }, "the PPO step"),
    "ema": Key({
        "enabled": Key(False, "keep and export the EMA (roles.ema places it)"),
        "decay": Key(0.992, "EMA decay per step"),
    }, "an exponential moving average of the actor"),
    "reward": Key(dict(REWARD_KEYS), "the reward sources: reward-model roles and functions, summed with weights"),
    "eval": common.eval_keys("sampled answers to the evaluation prompts (never the training prompts)"),
    "export": Key({
        "enabled": Key(True, "export/actor"),
        "critic": Key(True, "export/critic (*ForSequenceClassification)"),
        "ema": Key(True, "export/ema (with ema.enabled)"),
    }, "what the run writes under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("actor", model="model.actor", extra={
    "model.reward": "roles.reward.model", "model.critic": "roles.critic.model",
    "model.reward_tokenizer": "roles.reward.tokenizer", "model.critic_tokenizer": "roles.critic.tokenizer",
    **common.TINY_RENAMED,
    "ppo.mini_batch_size": "roles.actor.micro_batch_size (and roles.critic.micro_batch_size: each role's own)",
    "ppo.ppo_epochs": "ppo.epochs", "ema.dtype": "roles.ema.dtype", "ema.offload_params": "roles.ema.offload_params",
    **common.lora_renamed("actor"), **common.lora_renamed("critic"),
})


def ppo_settings(cfg: Any) -> PPOSettings:
    p = cfg.ppo
    return PPOSettings(
        rollout_batch_size=p.rollout_batch_size, mini_batch_size=cfg.roles.actor.micro_batch_size,
        critic_mini_batch_size=cfg.roles.critic.micro_batch_size,
        ppo_epochs=p.epochs, clip_eps=p.clip_eps, value_clip=p.value_clip or None, dual_clip=p.dual_clip or None,
        gamma=p.gamma, lam=p.lam, kl_coef=p.kl_coef, adaptive_kl=p.adaptive_kl, kl_target=p.kl_target,
        kl_horizon=p.kl_horizon, clip_reward=p.clip_reward or None, whiten_advantages=p.whiten_advantages,
        no_eos_penalty=p.no_eos_penalty or None, ptx_coef=p.ptx_coef, critic_warmup_steps=p.critic_warmup_steps,
        normalize_rewards=cfg.reward.normalize, ema_decay=cfg.ema.decay, shuffle_minibatches=p.shuffle_minibatches,
    )


def reward_and_critic(cfg: Any, actor_path: str, reward_path: str | None) -> tuple[list[Any], list[Any], str, str]:
    """The reward-model roles, the reward sources, and the critic's folder and tokenizer: ``roles.critic``'s,
    else the main reward model's (the ``reward`` role, else the first), else the actor's (rewards from
    functions only; a fresh value head)."""
    r = cfg.roles
    models, sources = common.reward_config(cfg.reward, reward_path, placement(cfg, ROLES, "reward"),
                                           default_tokenizer=r.reward.tokenizer)
    main = next((m for m in models if m.role == "reward"), models[0] if models else None)
    if main is None:
        return models, sources, r.critic.model or actor_path, r.critic.tokenizer or r.actor.tokenizer
    critic = model_path(cfg, ROLES, "critic", {"reward": main.path})
    return models, sources, critic, r.critic.tokenizer or ("" if r.critic.model else main.tokenizer)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Every model folder, each role's tokenizer against its model's vocabulary (and its chat template when it
    re-encodes conversations), the prompts and evaluation prompts, the pretraining rows; on ``world_size`` ranks,
    a step's prompts (and pretraining rows) per rank. First the reward sources, the minibatch split and the EMA's
    placement."""
    r = cfg.roles
    common.reward_entries(cfg.reward, default_model=r.reward.model)
    for role in ("actor", "critic"):
        mbs = r[role].micro_batch_size
        if cfg.ppo.rollout_batch_size % mbs:
            raise config_problem("ppo.rollout_batch_size", cfg.ppo.rollout_batch_size,
                                 f"is not a multiple of roles.{role}.micro_batch_size={mbs} (the update's minibatches)",
                                 f"set ppo.rollout_batch_size to a multiple of {mbs}, or a micro batch that divides it")
    ema, actor = (schema.follow_chain(cfg, ROLES, name, "stage", -1) for name in ("ema", "actor"))
    if cfg.ema.enabled and ema != actor:
        raise config_problem("roles.ema.stage", r.ema.stage, f"differs from the actor's stage {actor}: the EMA "
                             "updates the actor's local partitions", "set roles.ema.stage=-1 (the actor's)")
    if r.ema.model:
        raise config_problem("roles.ema.model", r.ema.model, "the EMA starts from the actor's weights",
                             "leave roles.ema.model empty")
    try:
        ppo_settings(cfg)
    except ValueError as exc:
        raise RecipeConfigError(f"ppo: {exc}") from None
    models, _, critic_path, critic_tok = reward_and_critic(cfg, r.actor.model, r.reward.model)
    actor_tok, report = common.check_prompts_and_rewards(
        cfg, models, (("critic", critic_path, critic_tok, "roles.critic.tokenizer"),))
    ptx = None
    if cfg.ppo.ptx_coef > 0:
        ptx = common.check_data(cfg, "sft", actor_tok, source=cfg.data.ptx_source or None,
                                key="data.ptx_source" if cfg.data.ptx_source else None, evaluate=False)
    check_batches(cfg, report, world_size, ptx)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, ptx: dict[str, Any] | None = None,
                  setting: str = "{key}={n}") -> None:
    """A step draws ppo.rollout_batch_size prompts per rank from one stream and, with ppo.ptx_coef > 0,
    roles.actor.micro_batch_size pretraining rows per minibatch from another (all of its rows: none held out)."""
    common.check_stage_batches(report, world_size, key="ppo.rollout_batch_size", value=cfg.ppo.rollout_batch_size,
                               unit="prompts", setting=setting)
    if cfg.ppo.ptx_coef > 0:
        common.check_stage_batches(ptx, world_size, key="roles.actor.micro_batch_size",
                                   value=cfg.roles.actor.micro_batch_size, unit="pretraining rows",
                                   what="ppo.ptx_coef > 0 draws that many per minibatch", setting=setting)


class RLHFPPO(Recipe):
    name = "rlhf_ppo"
    headline = (common.JUDGE_HEADLINE, common.REWARD_HEADLINE)
    plot_xlabel = "PPO step"
    postfix_keys = ("reward/mean", "kl")

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry, r = self.cfg, self.registry, self.cfg.roles
        # 1. the model folders (the random tiny OPT and the built-in task where left empty) and the reward sources
        wants_rm = common.wants_reward_role(cfg.reward)
        self.assets = common.tiny_assets(self, r.actor.model, *([r.reward.model] if wants_rm else []))
        self.paths = {"actor": self._model_path("actor")}
        reward_roles, rewards, critic_path, critic_tok = reward_and_critic(
            cfg, self.paths["actor"], self._model_path("reward") if wants_rm else None)
        for m in reward_roles:
            self.paths[m.role] = m.path
        self.paths["critic"] = critic_path
        if not reward_roles:
            logger.info("rewards from functions only: the critic starts from %s with a fresh head", critic_path)
        main_rm = next((m for m in reward_roles if m.role == "reward"), None)
        _, self.tokenizer = common.role_folder(self, "actor", self.assets, self.paths["actor"])

        # 2. the prompts first: whether they are conversations decides how other tokenizers re-encode them
        self._setup_data()
        scoring = [(m.role, m.path, m.tokenizer) for m in reward_roles] + [("critic", critic_path, critic_tok)]
        self.tokenizers, self.retokenizers = retokenizers(self.tokenizer, scoring, self.conversational)
        self.rewards = with_retokenizers(rewards, self.retokenizers)
        common.check_reward_columns(self.rewards, self.data_columns)

        # 3. the roles: actor, ref, critic, reward (+ more reward models, + EMA), each its own engine
        s = self.settings = ppo_settings(cfg)
        updates = {role: s.optimizer_steps(cfg.max_steps, r[role].micro_batch_size, r[role].grad_accum)
                   for role in ("actor", "critic")}
        build_rlhf_roles(
            registry, self.paths["actor"], main_rm.path if main_rm else None, critic_path,
            actor=placement(cfg, ROLES, "actor"), critic=placement(cfg, ROLES, "critic"),
            ref=placement(cfg, ROLES, "ref"), reward=main_rm.placement if main_rm else None,
            ema=placement(cfg, ROLES, "ema") if cfg.ema.enabled else None,
            actor_optim=optim_spec(cfg, "actor", updates["actor"]),
            critic_optim=optim_spec(cfg, "critic", updates["critic"]), micro_batch_size=r.actor.micro_batch_size,
            critic_micro_batch_size=r.critic.micro_batch_size, actor_grad_accum=r.actor.grad_accum,
            critic_grad_accum=r.critic.grad_accum, actor_lora=lora_spec(cfg, "actor"),
            critic_lora=lora_spec(cfg, "critic"), actor_gradient_checkpointing=r.actor.gradient_checkpointing,
            critic_gradient_checkpointing=r.critic.gradient_checkpointing, seed=cfg.seed,
            extra_rewards=[(m.role, m.path, m.placement) for m in reward_roles if m.role != "reward"])

        # 4. the trainer (its state goes into every checkpoint): it samples as the evaluation answers are sampled
        #    and logs the built-in task's judge next to the reward
        a = self.answers
        self.trainer = registry.add_state("ppo", PPOTrainer(
            registry, a.sampled, s, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, seed=cfg.seed,
            judge=a.judge, decode=a.decode, rewards=self.rewards, critic_retokenizer=self.retokenizers.get("critic")))
        self.plot_panels = plot_panels(self.rewards, a.judge is not None)

    def _model_path(self, role: str) -> str:
        """roles.<role>.model (validate checked the folder), else the random tiny model."""
        given = self.cfg.roles[role].model
        if not given:
            logger.warning("roles.%s.model is empty: using the random tiny model %s (run rlhf_e2e for the whole "
                           "pipeline)", role, self.assets["model"])
        return given or self.assets["model"]

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        # prompts to train on; evaluation prompts that are never trained on
        data = common.load_data(self, "ppo", self.assets, eval_stage="eval")
        self.prompts, self.conversational, self.data_columns = common.prompt_batches(
            self, data, self.tokenizer, cfg.ppo.rollout_batch_size)
        self.answers = common.policy_answers(self, data.eval, self.tokenizer)  # sampled (and greedy) answers
        self.ptx: ShardedBatches | None = None
        if cfg.ppo.ptx_coef > 0:
            ptx = common.load_data(self, "sft", self.assets, evaluate=False, source=cfg.data.ptx_source or None)
            ptx_collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_ptx_len)
            self.ptx = registry.add_state("ptx", ShardedBatches(
                ptx.train, ptx_collate, cfg.roles.actor.micro_batch_size, registry.world_size, registry.rank,
                seed=cfg.seed + 1))

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # 1. this rank's next prompt batch (left padded; sharded, resumable sampler)
        batch = next(self.prompts)
        # 2.-5. inside trainer.step: generate (actor gathered once, or per token with synced_gpus);
        #    actor/ref log-probs, critic values, reward score (every rank, every role, one forward);
        #    per-token rewards = clipped score on the last action - beta * k1 KL; GAE; whitening over
        #    all ranks; ppo.epochs x minibatches of actor step then critic step; EMA; KL controller.
        #    The metrics come back as means over ranks.
        return self.trainer.step(batch, self.step, self.ptx)

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Sampled answers (seeded, as in training) to the evaluation prompts: judge score, the held-out reward
        (weighted sum and each source's mean, every rank scoring its own prompts), KL to ref; and optionally
        greedy answers' judge score and reward."""
        t0 = time.perf_counter()
        result = self.answers(ref_role="ref", rewards=self.rewards)
        return {**result, "seconds": time.perf_counter() - t0} if result else {}

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        cfg, registry = self.cfg, self.registry
        out = common.export_role(self, self.tokenizer)
        if out and cfg.export.critic:
            out["critic"] = save_role(registry, "critic", self.path("export", "critic"),
                                      tokenizer=self.tokenizers["critic"])  # the critic's own tokenizer
        if out and cfg.export.ema and "ema" in registry:
            out["ema"] = save_role(registry, "ema", self.path("export", "ema"), tokenizer=self.tokenizer)
        return out

    def summary_metrics(self) -> dict[str, Any]:
        figures = ("judge", "reward", "kl", "response_length", "greedy/judge", "greedy/reward",
                   *(f"reward/{src.name}" for src in self.rewards))
        return {"final": self.step_metrics[-1] if self.step_metrics else {},
                "generation_mode": self.cfg.generation.mode,
                **{f"{key}_mean": self.mean_step_metric(key) for key in SUMMARY_TIMINGS}, **self.eval_figures(figures)}

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths,
                "reencoded": {role: r is not None for role, r in self.retokenizers.items()}}


main = RLHFPPO.main
plan = plans.rlhf_ppo  # what `multiengine plan` sees of this recipe

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
from dataclasses import dataclass
from typing import Any

from multiengine.engines import ShardedBatches, save_role
from multiengine.engines.settings import Range, Settings, section, setting
from multiengine.pipelines.rlhf.data import PromptData, SFTCollator, load_stage, prompt_stream
from multiengine.pipelines.rlhf.evaluation import EvalSettings, policy_answers
from multiengine.pipelines.rlhf.generation import RolloutGenerationSettings
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings, PPOTrainer, plot_panels, summary_timings
from multiengine.pipelines.rlhf.retokenize import retokenizers
from multiengine.pipelines.rlhf.reward_sources import RewardSettings, with_retokenizers
from multiengine.pipelines.rlhf.roles import (
    add_lm_role,
    add_reward_roles,
    add_rollout,
    export_role,
    role_folder,
    tiny_assets,
)
from multiengine.pipelines.rlhf.rollout import rollout_spec
from multiengine.pipelines.rlhf.tiny import TinySettings
from multiengine.recipes import common
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PPOData(PromptData):
    ptx_source: str = setting("", "SFT rows for the pretraining loss (ppo.ptx_coef); \"\" = data.source's SFT rows")
    max_ptx_len: int = setting(32, "response tokens kept of a pretraining row", Range(1))


@dataclass(frozen=True)
class EMASettings(Settings):
    enabled: bool = setting(False, "keep and export the EMA (roles.ema places it)")
    decay: float = setting(0.992, "EMA decay per step", Range(0, 1), when="enabled")


@dataclass(frozen=True)
class PPOExport(common.ExportSettings):
    critic: bool = setting(True, "export/critic (*ForSequenceClassification)", when="enabled")
    ema: bool = setting(True, "export/ema (with ema.enabled)", when="enabled")


@dataclass(frozen=True)
class PPOConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_ppo", "everything the run writes goes under this folder")
    max_steps: int = setting(150, "PPO steps: one rollout batch each", Range(1))
    tiny: TinySettings = section(TinySettings, "the random tiny OPT built under output_dir/tiny for roles whose model "
                                               "is \"\" (mechanics only)")
    data: PPOData = section(PPOData, "prompts: prompt rows, or the prompts of any other RLHF format (docs/data.md)")
    generation: RolloutGenerationSettings = section(RolloutGenerationSettings, "sampling of the rollouts and of the "
                                                    "evaluation answers")
    ppo: PPOSettings = section(PPOSettings, "the PPO step")
    ema: EMASettings = section(EMASettings, "an exponential moving average of the actor")
    reward: RewardSettings = section(RewardSettings, "the reward sources: reward-model roles and functions, summed "
                                                     "with weights")
    eval: EvalSettings = section(EvalSettings, "sampled answers to the evaluation prompts (never the training prompts)")
    export: PPOExport = section(PPOExport, "what the run writes under output_dir/export")


_TRAIN = {**common.RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-4, "micro_batch_size": 16}


class RLHFPPO(Recipe):
    name = "rlhf_ppo"
    roles = (
        Role("actor", "the policy: step 1's export; model \"\" = the random tiny OPT (mechanics only)", trainable=True,
             defaults=_TRAIN, sequences=True, routed=True),
        Role("critic", "the value model (LM body + value head); model \"\" = the reward model's (DeepSpeed-Chat), the "
                       "actor's when rewards are functions only", trainable=True, weights="reward", defaults=_TRAIN,
             sequences=True),
        Role("ref", "the frozen SFT policy (the actor's folder)", follows="actor", weights="actor",
             omit=("tokenizer",), why=common.REF_TOKENIZER, sequences=True),
        Role("reward", "the frozen reward model: step 2's export or a *ForSequenceClassification model; model \"\" = "
                       "the random tiny model with a fresh head", follows="critic", sequences=True),
        Role("rollout", common.ROLLOUT_ROLE_HELP.format(of="actor"), follows="actor", rollout=True),
        Role("ema", "an exponential moving average of the actor (ema.enabled), built at the actor's stage",
             follows="actor", omit=("model", "tokenizer", "stage", "gather_forward"),
             why="the EMA is a copy of the actor at its ZeRO stage: it has a dtype and offload_params only"),
    )
    Config = PPOConfig
    renamed = common.old_keys("actor", "model.actor", **{
        "model.reward": "roles.reward.model", "model.critic": "roles.critic.model",
        "model.reward_tokenizer": "roles.reward.tokenizer", "model.critic_tokenizer": "roles.critic.tokenizer",
        "ppo.mini_batch_size": "roles.actor.micro_batch_size (and roles.critic.micro_batch_size: each role's own)",
        "ppo.ppo_epochs": "ppo.epochs", "ema.dtype": "roles.ema.dtype",
        "ema.offload_params": "roles.ema.offload_params",
        **common.lora_renamed("actor"), **common.lora_renamed("critic")})
    headline = (common.JUDGE_HEADLINE, common.REWARD_HEADLINE)
    plot_xlabel = "PPO step"
    postfix_keys = ("reward/mean", "kl")

    @classmethod
    def reward_and_critic(cls, cfg: PPOConfig, actor_path: str, reward_path: str | None
                          ) -> tuple[list[Any], list[Any], str, str]:
        """The reward-model roles, the reward sources, and the critic's folder and tokenizer: ``roles.critic``'s,
        else the main reward model's (the ``reward`` role, else the first), else the actor's (rewards from
        functions only; a fresh value head)."""
        r = cfg.roles
        models, sources = cfg.reward.sources(reward_path, r.reward.placement(), r.reward.tokenizer)
        main = next((m for m in models if m.role == "reward"), models[0] if models else None)
        if main is None:
            return models, sources, r.critic.model or actor_path, r.critic.tokenizer or r.actor.tokenizer
        return models, sources, r.critic.model_path({"reward": main.path}), \
            r.critic.tokenizer or ("" if r.critic.model else main.tokenizer)

    @classmethod
    def validate(cls, cfg: PPOConfig, world_size: int = 1) -> None:
        """The minibatch split and the EMA's placement; every model folder, each role's tokenizer against its model's
        vocabulary (and its chat template when it re-encodes conversations), the prompts and evaluation prompts, the
        pretraining rows; on ``world_size`` ranks, a step's prompts (and pretraining rows) per rank."""
        r, p = cfg.roles, cfg.ppo
        cfg.reward.entries(r.reward.model)
        for role in ("actor", "critic"):
            mbs = r[role].micro_batch_size
            if p.rollout_batch_size % mbs:
                raise config_problem("ppo.rollout_batch_size", p.rollout_batch_size, f"is not a multiple of "
                                     f"roles.{role}.micro_batch_size={mbs} (the update's minibatches)",
                                     f"set ppo.rollout_batch_size to a multiple of {mbs}, or a micro batch that "
                                     "divides it")
        if r.ema.offload_params and r.actor.stage != 3:
            raise config_problem("roles.ema.offload_params", True, f"needs ZeRO-3 (the EMA runs at roles.actor's stage "
                                 f"{r.actor.stage}): only ZeRO-3 partitions parameters",
                                 "set roles.actor.stage=3, or roles.ema.offload_params=false")
        common.check_model("roles.ref.model", r.ref.model)
        common.check_rollout(cfg, cfg.data.max_prompt_len + cfg.generation.max_new_tokens)
        common.check_placement(cfg, world_size)
        world_size = common.trainer_ranks(cfg, world_size)
        models, _, critic_path, critic_tok = cls.reward_and_critic(cfg, r.actor.model, r.reward.model)
        if cfg.export.enabled and cfg.export.critic:
            what = "the critic" + ("" if r.critic.model else " (roles.critic.model \"\" takes this folder)")
            common.check_scalar_export("roles.critic.model", critic_path, what,
                                       "export.critic=false (the critic is not exported)")
        actor_tok, report = common.check_prompts_and_rewards(
            cfg, models, (("critic", critic_path, critic_tok, "roles.critic.tokenizer"),))
        ptx = None
        if p.ptx_coef > 0:
            ptx = common.check_data(cfg, "sft", actor_tok, source=cfg.data.ptx_source or None,
                                    key="data.ptx_source" if cfg.data.ptx_source else None, evaluate=False)
        cls.check_batches(cfg, report, world_size, ptx=ptx)

    @classmethod
    def check_batches(cls, cfg: PPOConfig, report: dict[str, Any] | None, world_size: int,
                      setting: str = "{key}={n}", ptx: dict[str, Any] | None = None) -> None:
        """A step draws ppo.rollout_batch_size prompts per rank from one stream and, with ppo.ptx_coef > 0,
        roles.actor.micro_batch_size pretraining rows per minibatch from another (all of its rows: none held out)."""
        common.check_stage_batches(report, world_size, key="ppo.rollout_batch_size", value=cfg.ppo.rollout_batch_size,
                                   unit="prompts", setting=setting)
        if cfg.ppo.ptx_coef > 0:
            common.check_stage_batches(ptx, world_size, key="roles.actor.micro_batch_size",
                                       value=cfg.roles.actor.micro_batch_size, unit="pretraining rows",
                                       what="ppo.ptx_coef > 0 draws that many per minibatch", setting=setting)

    @classmethod
    def plan(cls, cfg: PPOConfig, assume: Any = None) -> list[plans.RecipePlan]:
        """Actor, critic, a frozen ref, the reward-model roles and an EMA of the actor (ema.enabled)."""
        r, g = cfg.roles, cfg.generation
        actor_info = common.lm_info(cfg, r.actor.model, "actor", assume)
        prompt, new, rollout = cfg.data.max_prompt_len, g.max_new_tokens, cfg.ppo.rollout_batch_size
        rewards, reward_infos = common.reward_plan(cfg, rollout, assume)
        # the critic's folder as build() resolves it: roles.critic.model, else the reward model's (its declaration),
        # else the first reward model, else the actor's with a fresh head (rewards from functions only)
        if r.critic.model or (assume and "critic" in assume):
            critic_info = plans.scalar_info(common.lm_info(cfg, r.critic.model, "critic", assume))
        elif reward_infos:
            critic_info = reward_infos.get("reward") or next(iter(reward_infos.values()))
        else:
            critic_info = plans.scalar_info(actor_info)
        plan = common.policy_plan("rlhf_ppo", f"generation: {rollout} prompts x ({prompt} + {new}) tokens per rank, "
                                  f"mode {g.mode}; updates on {r.actor.micro_batch_size} rows (critic "
                                  f"{r.critic.micro_batch_size}) per forward/backward", cfg,
                                  {"actor": actor_info, "critic": critic_info}, True, rollout, rollout, rewards,
                                  assume)
        if cfg.ema.enabled:  # the actor's weights (and adapters) at the actor's stage
            plan.roles.append(plans.role_plan("ema", actor_info, r.ema.effective_dtype, trainable=False,
                                              lora=plans.lora_choice(r.actor.lora),
                                              current=plans.current_choice(plan.roles[0].current.stage, False,
                                                                           r.ema.offload_params),
                                              follows="actor", note="built at the actor's stage"))
            plan.keys["ema"] = plans.RoleKeys(None, "roles.ema.offload_params")
        return [plan]

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry, r = self.cfg, self.registry, self.cfg.roles
        # 1. the model folders (the random tiny OPT and the built-in task where left empty) and the reward sources
        wants_rm = cfg.reward.wants_reward_role()
        self.assets = tiny_assets(registry, self.path("tiny"), cfg, r.actor.model,
                                  *([r.reward.model] if wants_rm else []))
        for role in ("actor", *(("reward",) if wants_rm else ())):
            if not r[role].model:
                logger.warning("roles.%s.model is empty: using the random tiny model %s (run rlhf_e2e for the whole "
                               "pipeline)", role, self.assets["model"])
        actor_path = r.actor.model or self.assets["model"]
        reward_roles, rewards, critic_path, critic_tok = self.reward_and_critic(
            cfg, actor_path, (r.reward.model or self.assets["model"]) if wants_rm else None)
        if not reward_roles:
            logger.info("rewards from functions only: the critic starts from %s with a fresh head", critic_path)
        self.paths = {"actor": actor_path, "ref": r.ref.model_path({"actor": actor_path}),
                      **{m.role: m.path for m in reward_roles}, "critic": critic_path}
        _, self.tokenizer = role_folder(r.actor, self.assets, actor_path)

        # 2. the prompts first: whether they are conversations decides how other tokenizers re-encode them
        self._setup_data()
        scoring = [(m.role, m.path, m.tokenizer) for m in reward_roles] + [("critic", critic_path, critic_tok)]
        self.tokenizers, self.retokenizers = retokenizers(self.tokenizer, scoring, self.conversational)
        self.rewards = with_retokenizers(rewards, self.retokenizers)
        common.check_reward_columns(self.rewards, self.data_columns)

        # 3. the roles: actor, ref, critic, reward (+ EMA, + more reward models), each its own engine
        p = cfg.ppo
        add_lm_role(registry, r.actor, actor_path, cfg.seed,
                    total_steps=p.optimizer_steps(cfg.max_steps, r.actor.micro_batch_size, r.actor.grad_accum))
        add_lm_role(registry, r.ref, self.paths["ref"], cfg.seed)
        add_lm_role(registry, r.critic, critic_path, cfg.seed, scalar=True,
                    total_steps=p.optimizer_steps(cfg.max_steps, r.critic.micro_batch_size, r.critic.grad_accum))
        add_reward_roles(registry, [m for m in reward_roles if m.role == "reward"], r.reward.packing)
        if cfg.ema.enabled:  # the actor's weights and adapters, at its stage
            add_lm_role(registry, r.ema, actor_path, cfg.seed, stateful=True, lora=r.actor.lora_spec())
        add_reward_roles(registry, [m for m in reward_roles if m.role != "reward"], r.reward.packing)
        registry.build()
        add_rollout(registry, cfg, actor_path, cfg.data.max_prompt_len + cfg.generation.max_new_tokens)

        # 4. the trainer (its state goes into every checkpoint): it samples as the evaluation answers are sampled
        #    and logs the built-in task's judge next to the reward
        spec = rollout_spec(self.answers, self.tokenizer, self.rewards, cfg.seed, critic="critic",
                            critic_retokenizer=self.retokenizers.get("critic"))
        self.trainer = registry.add_state("ppo", PPOTrainer(
            registry, p, spec, r.actor.micro_batch_size, r.critic.micro_batch_size,
            normalize_rewards=cfg.reward.normalize, ema_decay=cfg.ema.decay if cfg.ema.enabled else None))
        common.schedule_rollouts(self, self.trainer, actor_path,
                                 cfg.data.max_prompt_len + cfg.generation.max_new_tokens)
        self.plot_panels = plot_panels(self.rewards, self.answers.judge is not None)

    def _setup_data(self) -> None:
        cfg, registry = self.cfg, self.registry
        # prompts to train on; evaluation prompts that are never trained on
        data = load_stage(registry, cfg.data, cfg.seed, "ppo", self.assets, eval_stage="eval")
        self.prompts, self.conversational, self.data_columns = prompt_stream(registry, cfg.data, cfg.seed, data,
                                                                             self.tokenizer, cfg.ppo.rollout_batch_size)
        # sampled (and greedy) answers
        self.answers = policy_answers(registry, data.eval, self.tokenizer, cfg.generation, cfg.eval,
                                      cfg.data.max_prompt_len)
        self.ptx: ShardedBatches | None = None
        if cfg.ppo.ptx_coef > 0:
            ptx = load_stage(registry, cfg.data, cfg.seed, "sft", self.assets, evaluate=False,
                             source=cfg.data.ptx_source or None)
            ptx_collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_ptx_len)
            self.ptx = registry.add_state("ptx", ShardedBatches(
                ptx.train, ptx_collate, cfg.roles.actor.micro_batch_size, registry.world_size, registry.rank,
                seed=cfg.seed + 1))

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # this rank's next prompt batch (left padded; sharded, resumable sampler); inside trainer.step: generate
        # (actor gathered once, or per token with synced_gpus); actor/ref log-probs, critic values, reward score
        # (every rank, every role, one forward); per-token rewards = clipped score on the last action - beta * k1 KL;
        # GAE; whitening over all ranks; ppo.epochs x minibatches of actor step then critic step; EMA; KL controller.
        # The metrics come back as means over ranks.
        return self.trainer.step(None if self.trainer.scheduled else next(self.prompts), self.step, self.ptx)

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
        out = export_role(registry, cfg.export, self.path("export"), self.tokenizer)
        if out and cfg.export.critic:
            out["critic"] = save_role(registry, "critic", self.path("export", "critic"),
                                      tokenizer=self.tokenizers["critic"])  # the critic's own tokenizer
        if out and cfg.ema.enabled and cfg.export.ema:
            out["ema"] = save_role(registry, "ema", self.path("export", "ema"), tokenizer=self.tokenizer)
        return out

    def summary_metrics(self) -> dict[str, Any]:
        figures = ("judge", "reward", "kl", "response_length", "greedy/judge", "greedy/reward",
                   *(f"reward/{src.name}" for src in self.rewards))
        return {"final": self.step_metrics[-1] if self.step_metrics else {},
                "generation_mode": self.cfg.generation.mode,
                **{f"{key}_mean": self.mean_step_metric(key) for key in summary_timings(self.cfg.generation.engine)},
                **self.eval_figures(figures)}

    def close(self) -> None:
        common.stop_rollouts(self)
        super().close()

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths,
                "reencoded": {role: r is not None for role, r in self.retokenizers.items()},
                **common.rollouts_summary(self)}


RECIPE = RLHFPPO

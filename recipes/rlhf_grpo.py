"""Critic-free RL on the registry: GRPO, Dr. GRPO, RLOO or REINFORCE++ with an actor, a frozen ref and reward
sources (reward-model roles and/or Python reward functions); no critic. docs/rlhf.md and docs/rlhf-variants.md.

    multiengine run rlhf_grpo --config tiny --nproc-per-node 2              # SFT actor trained here first
    multiengine run rlhf_grpo --config tiny --nproc-per-node 2 grpo.algorithm=rloo
    multiengine run rlhf_grpo --config tiny --nproc-per-node 2 'reward.models=[{role: reward, weight: 1.0}]' \\
        reward.functions=[] roles.reward.model=outputs/rlhf_reward/export/reward
    multiengine run rlhf_grpo --config tiny --nproc-per-node 2 grpo.loss_aggregation=token_mean grpo.clip_high=0.28 \\
        grpo.dynamic_sampling=true                                          # DAPO-style
    multiengine run rlhf_grpo --config tiny_multiturn --nproc-per-node 2    # calculator tool, several turns
    multiengine run rlhf_grpo --config opt1.3b --nproc-per-node 8

Each step samples ``grpo.n_samples_per_prompt`` answers to each of a rank's prompts, scores them with the weighted
reward sources, turns each prompt's group of scores into advantages (``grpo.algorithm``) and runs clipped
policy-gradient steps on the actor (KL to the ref as a k3 loss term or a k1 reward penalty). Reward functions are
written as for TRL (the rows' other columns arrive as keyword arguments). Mostly flat groups (every answer to a
prompt scored the same) for ``grpo.flat_warn_steps`` steps get a warning with what to change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.rlhf import multiturn
from multiengine.pipelines.rlhf.data import PromptData, load_stage, prompt_stream, prompt_text
from multiengine.pipelines.rlhf.evaluation import EvalSettings, policy_answers
from multiengine.pipelines.rlhf.generation import RolloutGenerationSettings
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer, judge_prompt_problem, plot_panels
from multiengine.pipelines.rlhf.ppo_trainer import summary_timings
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
from multiengine.recipes.language.config import RecipeConfigError, config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class GRPOConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_grpo", "everything the run writes goes under this folder")
    max_steps: int = setting(100, "steps: one rollout and its policy update each", Range(1))
    tiny: TinySettings = section(TinySettings, "the random tiny OPT the tiny SFT actor is fine-tuned from")
    actor_sft: common.StepRun = section(common.StepRun, "how the tiny SFT actor is trained (rlhf_sft) when "
                                                        "roles.actor.model is empty")
    data: PromptData = section(PromptData, "prompts: prompt rows, or the prompts of any other RLHF format "
                                           "(docs/data.md)")
    generation: RolloutGenerationSettings = section(RolloutGenerationSettings, "sampling of the rollouts and of the "
                                                    "evaluation answers (max_new_tokens: Dr. GRPO's normalising "
                                                    "constant)")
    grpo: GRPOSettings = section(GRPOSettings, "the critic-free estimator")
    reward: RewardSettings = section(RewardSettings, "the reward sources: reward-model roles and functions, summed "
                                                     "with weights")
    eval: EvalSettings = section(EvalSettings, "sampled answers to the evaluation prompts (never the training "
                                               "prompts); with grpo.env one episode per prompt", every=25,
                                 greedy=False)
    export: common.ExportSettings = section(common.ExportSettings, "export/actor")


class RLHFGRPO(Recipe):
    name = "rlhf_grpo"
    roles = (
        Role("actor", "the policy (an SFT model); model \"\" = the tiny SFT actor trained first under output_dir/sft "
                      "(actor_sft)", trainable=True, sequences=True, routed=True,
             defaults={**common.RLHF_TRAINABLE, "dtype": "fp32", "lr": 1e-3, "micro_batch_size": 32}),
        Role("ref", "the frozen SFT policy (the actor's folder; none when grpo.kl_coef is 0)", follows="actor",
             weights="actor", omit=("tokenizer",), why=common.REF_TOKENIZER, sequences=True),
        Role("reward", "the frozen `reward` role (when reward.models names it) and the placement of every reward "
                       "model (each reward.models entry may override)", follows="actor", sequences=True),
        Role("rollout", common.ROLLOUT_ROLE_HELP.format(of="actor"), follows="actor", rollout=True),
    )
    Config = GRPOConfig
    renamed = common.old_keys("actor", "model.actor", **{
        **common.lora_renamed("actor"), "model.reward": "roles.reward.model",
        "model.reward_tokenizer": "roles.reward.tokenizer", "grpo.mini_batch_size": "roles.actor.micro_batch_size",
        "grpo.loss_agg": "grpo.loss_aggregation"})
    headline = (common.JUDGE_HEADLINE, common.REWARD_HEADLINE)
    postfix_keys = ("reward/mean", "kl")

    @classmethod
    def rewards_of(cls, cfg: GRPOConfig, strict: bool = True) -> tuple[list[Any], list[Any]]:
        """The reward-model roles and the reward sources (reward.models and reward.functions; the `reward` role's
        folder is roles.reward.model; none with grpo.env: the environment's reward). ``strict=False``: a folder left
        empty is not an error yet (validate)."""
        if cfg.grpo.env:
            return [], []
        named = bool(cfg.reward.models) or bool(cfg.reward.functions)
        fallback = cfg.roles.reward.model or ("" if named and not strict else None)
        return cfg.reward.sources(fallback, cfg.roles.reward.placement(), cfg.roles.reward.tokenizer)

    @classmethod
    def validate(cls, cfg: GRPOConfig, world_size: int = 1) -> None:
        """How a rollout's rows split into minibatches and optimizer steps, the overlong buffer, the environment;
        model folders, each role's tokenizer against its model's vocabulary (and chat template when it re-encodes
        conversations), the prompts and evaluation prompts; with no roles.actor.model, the data the SFT actor trains
        on. On ``world_size`` ranks: a step's prompts per rank (and the SFT run's micro batch)."""
        g, actor, new_tokens = cfg.grpo, cfg.roles.actor, cfg.generation.max_new_tokens
        if g.overlong_buffer > new_tokens:
            raise config_problem("grpo.overlong_buffer", g.overlong_buffer, f"exceeds generation.max_new_tokens="
                                 f"{new_tokens} (the penalty ramps over the last tokens before it)",
                                 "use a buffer <= max_new_tokens, or 0 = off")
        if g.env:
            multiturn.check_env_settings(g.env, bool(cfg.reward.models or cfg.reward.functions), cfg.generation.mode)
        rows = g.rollout_batch_size * g.n_samples_per_prompt
        if rows % actor.micro_batch_size:
            raise config_problem("grpo.rollout_batch_size", g.rollout_batch_size,
                                 f"x grpo.n_samples_per_prompt={g.n_samples_per_prompt} = {rows} rows per rank is not "
                                 f"a multiple of roles.actor.micro_batch_size={actor.micro_batch_size} (the update's "
                                 "minibatches)", "change one of the three")
        minibatches = rows // actor.micro_batch_size
        if minibatches % actor.grad_accum:
            raise config_problem("roles.actor.grad_accum", actor.grad_accum, f"does not divide the {minibatches} "
                                 "minibatches of a rollout (grpo.rollout_batch_size x grpo.n_samples_per_prompt / "
                                 "roles.actor.micro_batch_size)", "change one of them")
        common.check_model("roles.ref.model", cfg.roles.ref.model)
        common.check_rollout(cfg, cls.sequence_length(cfg))
        common.check_placement(cfg, world_size, multiturn=bool(g.env), dynamic=g.dynamic_sampling)
        world_size = common.trainer_ranks(cfg, world_size)
        models, _ = cls.rewards_of(cfg, strict=False)
        _, report = common.check_prompts_and_rewards(cfg, models)
        common.check_sft_run(cfg, "actor_sft", "actor", world_size)
        cls.check_batches(cfg, report, world_size)

    @staticmethod
    def sequence_length(cfg: GRPOConfig) -> int:
        """The longest sequence a rollout holds: prompt + answer, or a multi-turn episode."""
        return cfg.grpo.max_total_tokens if cfg.grpo.env else cfg.data.max_prompt_len + cfg.generation.max_new_tokens

    @classmethod
    def check_batches(cls, cfg: GRPOConfig, report: dict[str, Any] | None, world_size: int,
                      setting: str = "{key}={n}") -> None:
        """A step draws grpo.rollout_batch_size prompts per rank (each sampled grpo.n_samples_per_prompt times: the
        group) from one stream; how the group's rows split into minibatches is validate's."""
        g = cfg.grpo
        common.check_stage_batches(report, world_size, key="grpo.rollout_batch_size", value=g.rollout_batch_size,
                                   unit="prompts", setting=setting,
                                   what=f"each sampled grpo.n_samples_per_prompt={g.n_samples_per_prompt} times")

    @classmethod
    def plan(cls, cfg: GRPOConfig, assume: Any = None) -> list[plans.RecipePlan]:
        """Actor, a frozen ref (none when ``grpo.kl_coef`` is 0) and the reward-model roles; no critic. A rollout is
        ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows per rank, generated and scored in one batch;
        the update runs on ``roles.actor.micro_batch_size`` rows at a time."""
        gr, g, a = cfg.grpo, cfg.generation, cfg.roles.actor
        info = common.lm_info(cfg, a.model, "actor", assume)
        rows = gr.rollout_batch_size * gr.n_samples_per_prompt
        rows_gen = max(rows, cfg.eval.batch_size if cfg.eval.size else 0)
        note = (f"rollout: {gr.rollout_batch_size} prompts x {gr.n_samples_per_prompt} samples = {rows} rows of "
                f"({cfg.data.max_prompt_len} + {g.max_new_tokens}) tokens per rank, generation mode {g.mode}; updates "
                f"on {a.micro_batch_size} rows per forward/backward")
        return [common.policy_plan("rlhf_grpo", note, cfg, {"actor": info}, gr.kl_coef > 0, rows, rows_gen,
                                   common.reward_plan(cfg, rows_gen, assume)[0], assume)]

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry, r, g = self.cfg, self.registry, self.cfg.roles, self.cfg.grpo
        # 1. the actor (SFT model, trained here on first use), tokenizer and data source
        if g.env == "builtin:arithmetic" and (cfg.data.builtin or not r.actor.model):
            # the calculator task's embedded assets instead of the built-in task's
            assets = multiturn.prepare_arithmetic_assets(self.path("arith"), registry, cfg.seed, cfg.tiny.hidden,
                                                         cfg.tiny.layers, cfg.tiny.heads)
        else:
            assets = tiny_assets(registry, self.path("tiny"), cfg, r.actor.model)
        actor_path = r.actor.model or common.sft_model(cfg, cfg.actor_sft, self.path("sft"), assets)
        actor_path, self.tokenizer = role_folder(r.actor, assets, actor_path)
        self.paths = {"actor": actor_path}

        # 2. data: prompts (checkpointed stream), evaluation prompts never trained on
        data = load_stage(registry, cfg.data, cfg.seed, "ppo", assets, eval_stage="eval")
        self.prompts, conversational, columns = prompt_stream(registry, cfg.data, cfg.seed, data, self.tokenizer,
                                                              g.rollout_batch_size)

        # 3. roles: actor (trainable), ref (frozen; none when kl_coef = 0), every reward-model role (each with
        #    its own tokenizer: re-encoded when it differs from the actor's)
        reward_roles, rewards = self.rewards_of(cfg)
        self.tokenizers, self.retokenizers = retokenizers(
            self.tokenizer, [(m.role, m.path, m.tokenizer) for m in reward_roles], conversational)
        self.rewards = with_retokenizers(rewards, self.retokenizers)
        bad = judge_prompt_problem(self.rewards, [prompt_text(data.train[i]["prompt"])
                                                  for i in range(min(len(data.train), 64))])
        if bad is not None:
            raise RecipeConfigError(f"reward.functions has builtin:judge, which scores only the built-in task's prompts"
                                    f" (e.g. 'list 3 fruits :'); data.source={cfg.data.source!r} has {bad!r}. "
                                    "Use your own reward function or a reward model.")
        common.check_reward_columns(self.rewards, columns)
        updates = cfg.max_steps * g.epochs * (g.rollout_batch_size * g.n_samples_per_prompt // r.actor.micro_batch_size)
        add_lm_role(registry, r.actor, actor_path, cfg.seed, total_steps=updates // r.actor.grad_accum)
        self.ref = "ref" if g.kl_coef > 0 else None
        if self.ref:
            self.paths["ref"] = r.ref.model_path({"actor": actor_path})
            add_lm_role(registry, r.ref, self.paths["ref"], cfg.seed)
        self.paths.update({m.role: m.path for m in reward_roles})
        add_reward_roles(registry, reward_roles, r.reward.packing)
        registry.build()
        add_rollout(registry, cfg, actor_path, self.sequence_length(cfg))
        self.reward_role = reward_roles[0].role if reward_roles else None

        # sampled (and greedy) answers to the evaluation prompts, judged on the built-in task; rollouts sample alike
        self.answers = policy_answers(registry, data.eval, self.tokenizer, cfg.generation, cfg.eval,
                                      cfg.data.max_prompt_len)

        # 4. the trainer (with grpo.env: multi-turn episodes): its state (reward normaliser) goes into every checkpoint
        spec = rollout_spec(self.answers, self.tokenizer, self.rewards, cfg.seed, ref=self.ref)
        self.episodes = multiturn.MultiTurnRollouts(registry, g, multiturn.TurnRenderer(self.tokenizer), spec) \
            if g.env else None
        self.trainer = registry.add_state("grpo", GRPOTrainer(
            registry, g, spec, r.actor.micro_batch_size, normalize_rewards=cfg.reward.normalize, rollout=self.episodes,
            more_prompts=(lambda: next(self.prompts)) if g.dynamic_sampling else None))
        common.schedule_rollouts(self, self.trainer, actor_path, self.sequence_length(cfg))
        self.plot_panels = plot_panels(self.rewards, self.answers.judge is not None, self.reward_role, self.ref,
                                       self.episodes is not None)

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # this rank's next prompts (a resumable stream); trainer.step samples n answers (or episodes) to each,
        # seeded by (seed, step, rank), scores them, forms group advantages and runs the policy update
        return self.trainer.step(None if self.trainer.scheduled else next(self.prompts), self.step)

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Sampled answers (seeded): judge score, held-out reward (sum and per source), KL to ref, with eval.greedy
        ``greedy/<key>`` too; with grpo.env one sampled episode per prompt: success, reward, turns, tool calls."""
        a, t0 = self.answers, time.perf_counter()
        if not a.batches:
            return {}
        if self.episodes is not None:
            result = multiturn.evaluate_multiturn(self.episodes, a.batches, a.seed + 7919 * self.registry.rank)
        else:
            result = a(ref_role=self.ref, rewards=self.rewards)
        return {**result, "seconds": time.perf_counter() - t0}

    # --- outputs ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        return export_role(self.registry, self.cfg.export, self.path("export"), self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        g = self.cfg.grpo
        figures = ("judge", "reward", "kl", "response_length", "greedy/judge", "success", "turns", "tool_calls",
                   *(f"reward/{src.name}" for src in self.rewards))
        return {"algorithm": g.algorithm, "loss_agg": g.aggregation, "kl_in_reward": g.resolved_kl_in_reward,
                "final": self.step_metrics[-1] if self.step_metrics else {},
                "generation_mode": self.cfg.generation.mode,
                **{f"{key}_mean": self.mean_step_metric(key) for key in summary_timings(self.cfg.generation.engine)},
                **self.eval_figures(figures)}

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths, "rewards": [{"name": r.name, "weight": r.weight,
                                                  "kind": "model" if r.role else "function"} for r in self.rewards],
                **common.rollouts_summary(self)}

    def plot_title(self) -> str:
        return f"{self.name}: {self.cfg.grpo.algorithm} ({self.registry.world_size} ranks)"

    def close(self) -> None:
        common.stop_rollouts(self)
        super().close()


RECIPE = RLHFGRPO

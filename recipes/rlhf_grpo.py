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

import logging
import time
from typing import Any

from multiengine.engines.recipe_config import Choice, Key, Range, RecipeConfigError, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys
from multiengine.pipelines.rlhf import multiturn
from multiengine.pipelines.rlhf.data import prompt_text
from multiengine.pipelines.rlhf.grpo import GRPOSettings, GRPOTrainer, judge_prompt_problem, plot_panels
from multiengine.pipelines.rlhf.ppo_trainer import SUMMARY_TIMINGS
from multiengine.pipelines.rlhf.retokenize import retokenizers
from multiengine.pipelines.rlhf.reward_sources import with_retokenizers
from multiengine.pipelines.rlhf.roles import actor_spec, ref_spec, reward_spec
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, REWARD_KEYS, RLHF_TRAINABLE, ROLLOUT_KEYS, TINY_KEYS

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
    "actor_sft": common.run_keys("how the tiny SFT actor is trained (rlhf_sft) when roles.actor.model is empty"),
    "data": Key({**DATA_KEYS, "max_prompt_len": common.PROMPT_LEN},
                "prompts: prompt rows, or the prompts of any other RLHF format (docs/data.md)"),
    "generation": Key({**ROLLOUT_KEYS, "max_new_tokens": Key(8, "tokens generated per answer (Dr. GRPO's normalising "
                                                                 "constant)")},
                      "sampling of the rollouts and of the evaluation answers"),
    "grpo": Key({
        "algorithm": Key("grpo", "grpo | dr_grpo | rloo | reinforce_pp",
                         Choice("grpo", "dr_grpo", "rloo", "reinforce_pp")),
        "n_samples_per_prompt": Key(8, "completions per prompt (a group; >= 2 except reinforce_pp)", Range(1)),
        "rollout_batch_size": Key(8, "prompts per rank per step (rows = prompts x samples, a multiple of "
                                     "roles.actor.micro_batch_size)"),
        "epochs": Key(1, "passes over one rollout (1 = ratio 1, the plain policy gradient)"),
        "clip_eps": Key(0.2, "policy ratio clip"),
        "dual_clip": Key(0.0, "0 = off; > 1 caps the loss of negative-advantage tokens"),
        "kl_coef": Key(0.04, "beta; 0 = no KL and no ref role"),
        "kl_in_reward": Key(None, "null = the algorithm's (k3 loss for grpo/dr_grpo, k1 reward for rloo/reinforce_pp)"),
        "kl_clamp": Key(0.0, "0 = off; clamp each token's KL estimate to +/- this", Range(0)),
        "loss_aggregation": Key("", "\"\" = the algorithm's | token_mean (DAPO) | seq_mean_token_mean (GRPO) | "
                                    "seq_mean_token_sum_norm (Dr. GRPO)",
                                Choice("", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")),
        "clip_low": Key(None, "null = clip_eps; the ratio's lower bound is 1 - clip_low", Range(0, allow_none=True)),
        "clip_high": Key(None, "null = clip_low; > clip_low is DAPO's clip-higher (e.g. 0.28)",
                         Range(0, allow_none=True)),
        "importance_level": Key("token", "token | sequence (GSPO's length-normalised sequence ratio)",
                                Choice("token", "sequence")),
        "overlong_buffer": Key(0, "0 = off; DAPO's soft overlong penalty over the last N tokens before "
                                  "generation.max_new_tokens ...", Range(0)),
        "overlong_penalty": Key(1.0, "... growing linearly to this at max_new_tokens", Range(0)),
        "dynamic_sampling": Key(False, "DAPO: drop prompt groups whose rewards are all equal, sample new prompts"),
        "max_resample_rounds": Key(4, "sampling rounds per step at most (then the batch is filled with flat groups)",
                                   Range(1)),
        "env": Key("", "\"\" = one completion per answer; builtin:arithmetic (calculator tool) or module:factory = "
                       "multi-turn episodes, the environment's reward"),
        "max_turns": Key(3, "model turns per episode at most (grpo.env)", Range(1)),
        "max_total_tokens": Key(48, "tokens per episode at most, prompt included (grpo.env)", Range(2)),
        "gamma": Key(1.0, "discount of the returns-to-go"),
        "std_eps": Key(1.0e-6, "added to the group std (grpo)", Range(0)),
        "clip_reward": Key(5.0, "0 = no clipping"),
        "no_eos_penalty": Key(0.0, "> 0: subtracted from the score of answers without EOS"),
        "shuffle_minibatches": Key(True, "seeded minibatch order"),
        "flat_warn_share": Key(0.8, "warn when more than this share of groups has all-equal rewards (1 = never) ...",
                               Range(0, 1)),
        "flat_warn_steps": Key(5, "... for this many steps in a row", Range(1)),
    }, "the critic-free estimator"),
    "reward": Key(dict(REWARD_KEYS), "the reward sources: reward-model roles and functions, summed with weights"),
    "eval": common.eval_keys("sampled answers to the evaluation prompts (never the training prompts); with grpo.env "
                             "one episode per prompt", every=25, greedy=False),
    "export": common.export_keys(),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("actor", model="model.actor", extra={
    **common.TINY_RENAMED, **common.lora_renamed("actor"), "model.reward": "roles.reward.model",
    "model.reward_tokenizer": "roles.reward.tokenizer", "grpo.mini_batch_size": "roles.actor.micro_batch_size",
    "grpo.loss_agg": "grpo.loss_aggregation"})


_SAME_NAMES = ("algorithm", "n_samples_per_prompt", "rollout_batch_size", "epochs", "clip_eps", "kl_coef",
               "kl_in_reward", "gamma", "std_eps", "shuffle_minibatches", "flat_warn_share", "flat_warn_steps",
               "clip_low", "clip_high", "importance_level", "overlong_buffer", "overlong_penalty", "dynamic_sampling",
               "max_resample_rounds")


def grpo_settings(cfg: Any) -> GRPOSettings:
    g = cfg.grpo  # 0 / "" are "off" / "the algorithm's" in the keys, None in the settings
    return GRPOSettings(
        **{k: g[k] for k in _SAME_NAMES}, mini_batch_size=cfg.roles.actor.micro_batch_size,
        dual_clip=g.dual_clip or None, kl_clamp=g.kl_clamp or None, loss_agg=g.loss_aggregation or None,
        clip_reward=g.clip_reward or None, normalize_rewards=cfg.reward.normalize,
        no_eos_penalty=g.no_eos_penalty or None)


def rewards_of(cfg: Any, strict: bool = True) -> tuple[list[Any], list[Any]]:
    """The reward-model roles and the reward sources (reward.models and reward.functions; the `reward` role's
    folder is roles.reward.model; none with grpo.env: the environment's reward). ``strict=False``: a folder left
    empty is not an error yet (validate)."""
    if cfg.grpo.env:
        return [], []
    named = bool(cfg.reward.models) or bool(cfg.reward.functions)
    fallback = cfg.roles.reward.model or ("" if named and not strict else None)
    return common.reward_config(cfg.reward, fallback, placement(cfg, ROLES, "reward"),
                                default_tokenizer=cfg.roles.reward.tokenizer)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folders, each role's tokenizer against its model's vocabulary (and chat template when it re-encodes
    conversations), the prompts and evaluation prompts; with no roles.actor.model, the data the SFT actor trains on.
    On ``world_size`` ranks: a step's prompts per rank (and the SFT run's micro batch). First the algorithm settings
    and how a rollout's rows split into minibatches."""
    g, actor = cfg.grpo, cfg.roles.actor
    if g.kl_in_reward is not None and not isinstance(g.kl_in_reward, bool):
        raise RecipeConfigError(f"grpo.kl_in_reward={g.kl_in_reward!r}: use null (the algorithm's "
                                "default), true (k1 in the reward) or false (k3 loss term).")
    if g.overlong_buffer > cfg.generation.max_new_tokens:
        raise config_problem("grpo.overlong_buffer", g.overlong_buffer, f"exceeds generation.max_new_tokens="
                             f"{cfg.generation.max_new_tokens} (the penalty ramps over the last tokens before it)",
                             "use a buffer <= max_new_tokens, or 0 = off")
    if g.env:
        try:
            multiturn.check_env_settings(g.env, bool(cfg.reward.models or cfg.reward.functions), cfg.generation.mode,
                                         g.overlong_buffer)
        except ValueError as exc:
            raise RecipeConfigError(str(exc)) from None
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
    models, _ = rewards_of(cfg, strict=False)
    _, report = common.check_prompts_and_rewards(cfg, models)
    common.check_sft_run(cfg, "actor_sft", "actor", world_size)
    check_batches(cfg, report, world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """A step draws grpo.rollout_batch_size prompts per rank (each sampled grpo.n_samples_per_prompt times: the
    group) from one stream; how the group's rows split into minibatches is validate's."""
    g = cfg.grpo
    common.check_stage_batches(report, world_size, key="grpo.rollout_batch_size", value=g.rollout_batch_size,
                               unit="prompts", setting=setting,
                               what=f"each sampled grpo.n_samples_per_prompt={g.n_samples_per_prompt} times")


class RLHFGRPO(Recipe):
    name = "rlhf_grpo"
    headline = (common.JUDGE_HEADLINE, common.REWARD_HEADLINE)
    plot_xlabel = "step"
    postfix_keys = ("reward/mean", "kl")

    # --- setup -----------------------------------------------------------------------------------
    def build(self) -> None:
        cfg, registry, r = self.cfg, self.registry, self.cfg.roles
        # 1. the actor (SFT model, trained here on first use), tokenizer and data source
        if cfg.grpo.env == "builtin:arithmetic" and (common.uses_builtin_data(cfg.data) or not r.actor.model):
            # the calculator task's embedded assets instead of the built-in task's
            assets = multiturn.prepare_arithmetic_assets(self.path("arith"), registry, cfg.seed, cfg.tiny.hidden,
                                                         cfg.tiny.layers)
        else:
            assets = common.tiny_assets(self, r.actor.model)
        actor_path, self.tokenizer = common.sft_actor(self, assets)
        self.paths = {"actor": actor_path}

        # 2. data: prompts (checkpointed stream), evaluation prompts never trained on
        data = common.load_data(self, "ppo", assets, eval_stage="eval")
        s = self.settings = grpo_settings(cfg)
        self.prompts, conversational, columns = common.prompt_batches(self, data, self.tokenizer, s.rollout_batch_size)

        # 3. roles: actor (trainable), ref (frozen; none when kl_coef = 0), every reward-model role (each with
        #    its own tokenizer: re-encoded when it differs from the actor's)
        reward_roles, rewards = rewards_of(cfg)
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
            self.paths[m.role] = m.path
            registry.add(reward_spec(m.path, m.placement, name=m.role))
        registry.build()
        self.reward_role = reward_roles[0].role if reward_roles else None

        # sampled (and greedy) answers to the evaluation prompts, judged on the built-in task; rollouts sample alike
        self.answers = common.policy_answers(self, data.eval, self.tokenizer)

        # 4. the trainer (with grpo.env: multi-turn episodes): its state (reward normaliser) goes into every checkpoint
        a, g = self.answers, cfg.grpo
        self.episodes = multiturn.MultiTurnRollouts(
            registry, multiturn.environment_factory(g.env), multiturn.TurnRenderer(self.tokenizer), a.sampled,
            n_samples_per_prompt=s.n_samples_per_prompt, max_turns=g.max_turns, max_total_tokens=g.max_total_tokens,
            ref=self.ref) if g.env else None
        self.trainer = registry.add_state("grpo", GRPOTrainer(
            registry, a.sampled, s, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, self.rewards, a.decode,
            ref=self.ref, seed=cfg.seed, judge=a.judge, rollout=self.episodes,
            more_prompts=(lambda: next(self.prompts)) if s.dynamic_sampling else None))
        self.plot_panels = plot_panels(self.rewards, a.judge is not None, self.reward_role, self.ref,
                                       self.episodes is not None)

    # --- training --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        # this rank's next prompts (a resumable stream); trainer.step samples n answers (or episodes) to each,
        # seeded by (seed, step, rank), scores them, forms group advantages and runs the policy update
        return self.trainer.step(next(self.prompts), self.step)

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
        return common.export_role(self, self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        s, gen = self.settings, self.cfg.generation
        figures = ("judge", "reward", "kl", "response_length", "greedy/judge", "success", "turns", "tool_calls",
                   *(f"reward/{src.name}" for src in self.rewards))
        return {"algorithm": s.algorithm, "loss_agg": s.resolved_loss_agg, "kl_in_reward": s.resolved_kl_in_reward,
                "final": self.step_metrics[-1] if self.step_metrics else {}, "generation_mode": gen.mode,
                **{f"{key}_mean": self.mean_step_metric(key) for key in SUMMARY_TIMINGS}, **self.eval_figures(figures)}

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths, "rewards": [{"name": r.name, "weight": r.weight,
                                                  "kind": "model" if r.role else "function"} for r in self.rewards]}

    def plot_title(self) -> str:
        return f"{self.name}: {self.settings.algorithm} ({self.registry.world_size} ranks)"


main = RLHFGRPO.main
plan = plans.rlhf_grpo  # what `multiengine plan` sees of this recipe

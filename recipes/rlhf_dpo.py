"""Offline preference optimisation: DPO (sigmoid loss, optional label smoothing) or IPO, with a trainable policy
(``actor``) and a frozen reference (``ref``, the actor's folder loaded again), each its own engine (docs/rlhf.md).

    multiengine run rlhf_dpo --config tiny --nproc-per-node 2                    # SFT actor trained here first
    multiengine run rlhf_dpo --config tiny --nproc-per-node 2 dpo.loss=ipo roles.actor.lr=5e-4
    multiengine run rlhf_dpo --config tiny --nproc-per-node 2 dpo.precompute_ref=true roles.ref.offload_params=true
    multiengine run rlhf_dpo --config opt1.3b --nproc-per-node 8

Trains on preference pairs; the ref's log-probs come from a no-grad forward per batch or (``dpo.precompute_ref``)
once for every pair before the first step. Reports held-out preference accuracy, margin and implicit rewards, and
on the built-in task the judge's score of sampled answers; exports export/actor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from multiengine.engines import ShardedBatches, shard_batches
from multiengine.engines.recipe_config import Choice, Key, Range, RecipeConfigError, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, model_path, old_keys, optim_spec, placement, role_keys
from multiengine.pipelines.rlhf.data import PairCollator
from multiengine.pipelines.rlhf.dpo import DPOSettings, DPOTrainer
from multiengine.pipelines.rlhf.preference import PreferenceCollator
from multiengine.pipelines.rlhf.roles import actor_spec, ref_spec
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, GENERATION_KEYS, RLHF_TRAINABLE, TINY_KEYS

logger = logging.getLogger(__name__)

ROLES = (
    Role("actor", "the policy being optimised", trainable=True,
         keys={**RLHF_TRAINABLE, "stage": 3, "dtype": "fp32", "lr": 1e-3, "scheduler": "cosine", "warmup_steps": 10,
               "model": Key("", "a causal-LM folder (the SFT model) or hub name; \"\" = train the tiny SFT actor "
                                "under output_dir/sft (actor_sft)"),
               "micro_batch_size": Key(32, "pairs per rank per forward/backward (2 rows each)")}),
    Role("ref", "the frozen SFT policy: the actor's folder loaded again (never a copy)", follows="actor",
         weights="actor", tokenizer_of="actor"),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_dpo", "everything the run writes goes under this folder"),
    "max_steps": Key(300, "optimizer steps"),
    "roles": role_keys(ROLES),
    "tiny": TINY_KEYS,
    "actor_sft": common.run_keys("how the tiny SFT actor is trained (rlhf_sft) when roles.actor.model is empty"),
    "data": Key({
        **DATA_KEYS,
        "max_prompt_len": common.PROMPT_LEN,
        "max_response_len": Key(16, "answer tokens kept, EOS included"),
        "heldout_size": Key(512, "evaluation pairs scored for the held-out accuracy (0 = all of them)"),
    }, "preference pairs: prompt + chosen + rejected, or chosen + rejected (docs/data.md)"),
    "dpo": Key({
        "loss": Key("sigmoid", "sigmoid (DPO) | ipo", Choice("sigmoid", "ipo")),
        "beta": Key(0.5, "strength of the KL regularisation to the ref", Range(0, min_exclusive=True)),
        "label_smoothing": Key(0.0, "sigmoid only: assumed probability of a flipped label (conservative DPO)",
                               Range(0, 0.5, max_exclusive=True)),
        "precompute_ref": Key(False, "ref log-probs of every pair once before training, not a ref forward per batch"),
        "precompute_batch_size": Key(64, "pairs per ref forward while precomputing", Range(1)),
        "sft_coef": Key(1.0, "> 0: + sft_coef x per-token NLL of the chosen answer (RPO, TRL's rpo_alpha)", Range(0)),
    }, "the preference loss"),
    "generation": Key(dict(GENERATION_KEYS), "sampling of evaluation answers"),
    "eval": common.eval_keys("held-out pairs, and sampled answers to the prompts of the evaluation rows", greedy=False),
    "export": common.export_keys(),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("actor", model="model.actor", extra={**common.TINY_RENAMED, **common.lora_renamed("actor")})


def dpo_settings(cfg: Any) -> DPOSettings:
    d = cfg.dpo
    return DPOSettings(loss=d.loss, beta=d.beta, label_smoothing=d.label_smoothing, precompute_ref=d.precompute_ref,
                       sft_coef=d.sft_coef)


def validate(cfg: Any, world_size: int = 1) -> None:
    """The loss settings, the actor (and ref) folder and the tokenizer against its vocabulary, the preference data
    (formats, columns, rows, chat template, held-out pairs); with no roles.actor.model, the data the SFT actor
    trains on. On ``world_size`` ranks: a step's pairs per rank (and the SFT run's micro batch)."""
    try:
        dpo_settings(cfg)
    except ValueError as exc:
        raise RecipeConfigError(f"dpo: {exc}") from None
    actor, ref = cfg.roles.actor, cfg.roles.ref
    if ref.tokenizer and ref.tokenizer != actor.tokenizer:
        raise RecipeConfigError(f"roles.ref.tokenizer={ref.tokenizer!r}: the ref scores the actor's tokens with the "
                                "actor's tokenizer; leave roles.ref.tokenizer empty")
    common.check_model("roles.ref.model", ref.model)
    tok = common.check_role(cfg, "actor")
    report = common.check_data(cfg, "reward", tok, tokenizer_key="roles.actor.tokenizer")
    common.check_sft_run(cfg, "actor_sft", "actor", world_size)
    check_batches(cfg, report, world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """One step draws micro_batch_size x grad_accum pairs per rank from one stream (build())."""
    a = cfg.roles.actor
    common.check_stage_batches(report, world_size, key="roles.actor.micro_batch_size", value=a.micro_batch_size,
                               factor=a.grad_accum, unit="pairs", setting=setting,
                               what=f"roles.actor.micro_batch_size x roles.actor.grad_accum={a.grad_accum}"
                               if a.grad_accum > 1 else "")


class RLHFDPO(Recipe):
    name = "rlhf_dpo"
    headline = (("accuracy", "held-out preference accuracy", True),
                common.JUDGE_HEADLINE)
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("DPO loss", ["train/loss", "eval/loss"]),
                   ("preference accuracy", ["train/accuracy", "eval/accuracy"]),
                   ("implicit reward margin", ["train/margin", "eval/margin"]),
                   ("judge score (built-in task)", ["eval/judge"]),
                   ("KL to ref (nats per answer)", ["eval/kl"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the actor (SFT model, trained here on first use) and the tokenizer
        actor = cfg.roles.actor
        assets = common.tiny_assets(self, actor.model)
        actor_path, self.tokenizer = common.sft_actor(self, assets)
        self.paths = {"actor": actor_path, "ref": model_path(cfg, ROLES, "ref", {"actor": actor_path})}

        # 2. roles: the trainable policy and the frozen ref (by default the actor's folder loaded again)
        s = dpo_settings(cfg)
        registry.add(actor_spec(actor_path, placement(cfg, ROLES, "actor"), optim_spec(cfg, "actor", cfg.max_steps),
                                micro_batch_size=2 * actor.micro_batch_size,  # chosen and rejected rows of each pair
                                grad_accum=actor.grad_accum, lora=lora_spec(cfg, "actor"),
                                gradient_checkpointing=actor.gradient_checkpointing, seed=cfg.seed))
        registry.add(ref_spec(self.paths["ref"], placement(cfg, ROLES, "ref")))
        registry.build()
        self.trainer = registry.add_state("dpo", DPOTrainer(registry, s))

        # 3. pairs: a training stream (checkpointed) and held-out pairs (evaluation rows, never trained on); ref
        #    log-probs precomputed if asked
        collate = PreferenceCollator(PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len))
        data = common.load_data(self, "reward", assets)
        train_rows = data.train
        heldout_rows = None
        if data.eval is not None:
            n = len(data.eval) if not cfg.data.heldout_size else min(cfg.data.heldout_size, len(data.eval))
            heldout_rows = data.eval.select(range(n))
        self.precompute_s = 0.0
        if s.precompute_ref:
            t0 = time.perf_counter()
            bs = cfg.dpo.precompute_batch_size
            train_rows = self.trainer.precompute_reference(train_rows, collate, bs)
            if heldout_rows is not None:
                heldout_rows = self.trainer.precompute_reference(heldout_rows, collate, bs)
            self.precompute_s = time.perf_counter() - t0
            logger.info("reference log-probs of %d pairs precomputed in %.1f s",
                        len(train_rows) + (len(heldout_rows) if heldout_rows is not None else 0), self.precompute_s)
        pairs_per_step = actor.micro_batch_size * actor.grad_accum
        self.batches = registry.add_state("batches", ShardedBatches(
            train_rows, collate, pairs_per_step, registry.world_size, registry.rank, seed=cfg.seed))
        self.heldout = [] if heldout_rows is None else shard_batches(
            heldout_rows, collate, actor.micro_batch_size, registry.world_size, registry.rank)

        # 4. sampled answers to the evaluation rows' prompts (the built-in task's judge scores them)
        self.answers = common.policy_answers(self, data.eval, self.tokenizer)

    def train_step(self) -> dict[str, float]:
        # 1. this rank's next B pairs (chosen rows then rejected rows; ref log-probs when precomputed)
        batch = next(self.batches)
        # 2.-4. inside trainer.step, per micro batch of B / G pairs: ref log-probs (a no-grad forward unless
        #    precomputed), policy log-probs of both responses, the DPO / IPO loss, backward; the policy's
        #    optimizer steps at the accumulation boundary. 5. global means over pairs.
        metrics = self.trainer.step(batch)
        metrics["lr"] = self.registry["actor"].get_lr()[0]
        return metrics

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out preference accuracy, margin, implicit rewards and loss; sampled answers' judge score and
        exact KL to ref."""
        t0 = time.perf_counter()
        result: dict[str, Any] = dict(self.trainer.evaluate(self.heldout)) if self.heldout else {}
        result.update(self.answers(ref_role="ref"))
        result["seconds"] = time.perf_counter() - t0
        return result

    def export(self) -> dict[str, Any]:
        return common.export_role(self, self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        d = self.cfg.dpo
        metrics: dict[str, Any] = {"loss_type": d.loss, "beta": d.beta, "precompute_ref": d.precompute_ref,
                                   "precompute_s": self.precompute_s,
                                   "final": self.step_metrics[-1] if self.step_metrics else {}}
        metrics.update(self.eval_figures(("accuracy", "margin", "chosen_reward", "rejected_reward", "loss", "judge",
                                          "kl", "response_length")))
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths}

    def plot_title(self) -> str:
        d = self.cfg.dpo
        extra = f", sft_coef {d.sft_coef:g}" if d.sft_coef else ""
        loss = "DPO" if d.loss == "sigmoid" else "IPO"
        return f"{self.name}: {loss}, beta {d.beta:g}{extra} ({self.registry.world_size} ranks)"


main = RLHFDPO.main
plan = plans.rlhf_dpo  # what `multiengine plan` sees of this recipe

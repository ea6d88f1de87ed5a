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
from dataclasses import dataclass
from typing import Any

from multiengine.engines import ShardedBatches, shard_batches
from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.rlhf.data import PairCollator, ResponseData, load_stage
from multiengine.pipelines.rlhf.dpo import DPOSettings, DPOTrainer
from multiengine.pipelines.rlhf.evaluation import EvalSettings, policy_answers
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.preference import PreferenceCollator
from multiengine.pipelines.rlhf.roles import add_lm_role, export_role, role_folder, tiny_assets
from multiengine.pipelines.rlhf.tiny import TinySettings
from multiengine.recipes import common
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DPOConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_dpo", "everything the run writes goes under this folder")
    max_steps: int = setting(300, "optimizer steps", Range(1))
    tiny: TinySettings = section(TinySettings, "the random tiny OPT the tiny SFT actor is fine-tuned from")
    actor_sft: common.StepRun = section(common.StepRun, "how the tiny SFT actor is trained (rlhf_sft) when "
                                                        "roles.actor.model is empty")
    data: ResponseData = section(ResponseData, "preference pairs: prompt + chosen + rejected, or chosen + rejected "
                                               "(docs/data.md)", heldout_size=512)
    dpo: DPOSettings = section(DPOSettings, "the preference loss", beta=0.5, sft_coef=1.0)
    generation: GenerationSettings = section(GenerationSettings, "sampling of evaluation answers")
    eval: EvalSettings = section(EvalSettings, "held-out pairs, and sampled answers to the prompts of the evaluation "
                                               "rows", greedy=False)
    export: common.ExportSettings = section(common.ExportSettings, "export/actor")


class RLHFDPO(Recipe):
    name = "rlhf_dpo"
    roles = (Role("actor", "the policy being optimised", trainable=True, sequences=True, routed=True,
                  omit=("token_budget",), why=common.TOKEN_BUDGET_WHY,
                  defaults={**common.RLHF_TRAINABLE, "stage": 3, "dtype": "fp32", "lr": 1e-3, "scheduler": "cosine",
                            "warmup_steps": 10,
                            "model": Key("", "a causal-LM folder (the SFT model) or hub name; \"\" = train the tiny "
                                             "SFT actor under output_dir/sft (actor_sft)"),
                            "micro_batch_size": Key(32, "pairs per rank per forward/backward (2 rows each)")}),
             Role("ref", "the frozen SFT policy: the actor's folder loaded again (never a copy)", follows="actor",
                  weights="actor", omit=("tokenizer",), why=common.REF_TOKENIZER, sequences=True))
    Config = DPOConfig
    renamed = common.old_keys("actor", "model.actor", **common.lora_renamed("actor"))
    headline = (("accuracy", "held-out preference accuracy", True), common.JUDGE_HEADLINE)
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("DPO loss", ["train/loss", "eval/loss"]),
                   ("preference accuracy", ["train/accuracy", "eval/accuracy"]),
                   ("implicit reward margin", ["train/margin", "eval/margin"]),
                   ("judge score (built-in task)", ["eval/judge"]),
                   ("KL to ref (nats per answer)", ["eval/kl"])]

    @classmethod
    def validate(cls, cfg: DPOConfig, world_size: int = 1) -> None:
        """The actor (and ref) folder and the tokenizer against its vocabulary, the preference data (formats,
        columns, rows, chat template, held-out pairs); with no roles.actor.model, the rlhf_sft run that trains it. On
        ``world_size`` ranks: a step's pairs per rank (and the SFT run's micro batch)."""
        common.check_hf_generation(cfg, cls.name)
        common.check_model("roles.ref.model", cfg.roles.ref.model)
        tok = common.check_role(cfg, "actor")
        report = common.check_data(cfg, "reward", tok, tokenizer_key="roles.actor.tokenizer")
        common.check_sft_run(cfg, "actor_sft", "actor", world_size)
        cls.check_batches(cfg, report, world_size)

    @classmethod
    def check_batches(cls, cfg: DPOConfig, report: dict[str, Any] | None, world_size: int,
                      setting: str = "{key}={n}") -> None:
        """One step draws micro_batch_size x grad_accum pairs per rank from one stream (build())."""
        a = cfg.roles.actor
        common.check_stage_batches(report, world_size, key="roles.actor.micro_batch_size", value=a.micro_batch_size,
                                   factor=a.grad_accum, unit="pairs", setting=setting,
                                   what=f"roles.actor.micro_batch_size x roles.actor.grad_accum={a.grad_accum}"
                                   if a.grad_accum > 1 else "")

    @classmethod
    def plan(cls, cfg: DPOConfig, assume: Any = None) -> list[plans.RecipePlan]:
        """A trainable policy and a frozen ref (by default from the same folder); each micro batch is
        ``roles.actor.micro_batch_size`` pairs = twice as many rows (chosen and rejected)."""
        a, r, d = cfg.roles.actor, cfg.roles.ref, cfg.dpo
        info = common.lm_info(cfg, a.model, "actor", assume)
        ref_path = r.model_path()
        ref_info = info if ref_path == a.model else common.lm_info(cfg, ref_path, "ref", assume)
        seq, rows = cfg.data.max_prompt_len + cfg.data.max_response_len, 2 * a.micro_batch_size
        ref_rows, label = (2 * d.precompute_batch_size, "precompute") if d.precompute_ref \
            else (rows, "reference forward")
        phases = {"actor": plans.lm_role_phases(a, info, train=(rows, seq), generate=common.eval_generation(cfg)),
                  "ref": plans.lm_role_phases(r, ref_info, forward=(ref_rows, seq), label=label)}
        return [plans.declared_roles(cfg, {"actor": info, "ref": ref_info}, phases, title="rlhf_dpo",
                                     notes=[f"micro batch {a.micro_batch_size} pairs = {rows} rows of {seq} tokens"
                                            + ("; ref log-probs precomputed before training" if d.precompute_ref
                                               else "")],
                                     actor={"full_gather": ("generation",)}, ref=plans.gather_options(r, label))]

    def build(self) -> None:
        cfg, registry, actor = self.cfg, self.registry, self.cfg.roles.actor
        # 1. the actor (SFT model, trained here on first use) and the tokenizer
        assets = tiny_assets(registry, self.path("tiny"), cfg, actor.model)
        actor_path = actor.model or common.sft_model(cfg, cfg.actor_sft, self.path("sft"), assets)
        actor_path, self.tokenizer = role_folder(actor, assets, actor_path)
        self.paths = {"actor": actor_path, "ref": cfg.roles.ref.model_path({"actor": actor_path})}
        # 2. roles: the trainable policy (chosen and rejected rows of each pair in one batch) and the frozen ref
        add_lm_role(registry, actor, actor_path, cfg.seed, total_steps=cfg.max_steps, rows=2)
        add_lm_role(registry, cfg.roles.ref, self.paths["ref"], cfg.seed)
        registry.build()
        self.trainer = registry.add_state("dpo", DPOTrainer(registry, cfg.dpo))
        # 3. pairs: a training stream (checkpointed) and held-out pairs (evaluation rows, never trained on); ref
        #    log-probs precomputed if asked
        collate = PreferenceCollator(PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len))
        data = load_stage(registry, cfg.data, cfg.seed, "reward", assets)
        train_rows, heldout_rows = data.train, None
        if data.eval is not None:
            n = len(data.eval) if not cfg.data.heldout_size else min(cfg.data.heldout_size, len(data.eval))
            heldout_rows = data.eval.select(range(n))
        self.precompute_s = 0.0
        if cfg.dpo.precompute_ref:
            t0 = time.perf_counter()
            train_rows = self.trainer.precompute_reference(train_rows, collate)
            if heldout_rows is not None:
                heldout_rows = self.trainer.precompute_reference(heldout_rows, collate)
            self.precompute_s = time.perf_counter() - t0
            logger.info("reference log-probs of %d pairs precomputed in %.1f s",
                        len(train_rows) + (len(heldout_rows) if heldout_rows is not None else 0), self.precompute_s)
        self.batches = registry.add_state("batches", ShardedBatches(
            train_rows, collate, actor.micro_batch_size * actor.grad_accum, registry.world_size, registry.rank,
            seed=cfg.seed))
        self.heldout = [] if heldout_rows is None else shard_batches(
            heldout_rows, collate, actor.micro_batch_size, registry.world_size, registry.rank)
        # 4. sampled answers to the evaluation rows' prompts (the built-in task's judge scores them)
        self.answers = policy_answers(registry, data.eval, self.tokenizer, cfg.generation, cfg.eval,
                                      cfg.data.max_prompt_len)

    def train_step(self) -> dict[str, float]:
        # this rank's next B pairs; per micro batch of B / G pairs: ref log-probs (a no-grad forward unless
        # precomputed), the policy's of both responses, the DPO / IPO loss and backward; the policy's optimizer steps
        # at the accumulation boundary; global means over pairs
        metrics = self.trainer.step(next(self.batches))
        metrics["lr"] = self.registry["actor"].get_lr()[0]
        return metrics

    def evaluate(self, tag: str) -> dict[str, Any]:
        """Held-out preference accuracy, margin, implicit rewards and loss; sampled answers' judge score and exact
        KL to the ref."""
        t0 = time.perf_counter()
        result: dict[str, Any] = dict(self.trainer.evaluate(self.heldout)) if self.heldout else {}
        result.update(self.answers(ref_role="ref"))
        result["seconds"] = time.perf_counter() - t0
        return result

    def export(self) -> dict[str, Any]:
        return export_role(self.registry, self.cfg.export, self.path("export"), self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        d = self.cfg.dpo
        return {"loss_type": d.loss, "beta": d.beta, "precompute_ref": d.precompute_ref,
                "precompute_s": self.precompute_s, "final": self.step_metrics[-1] if self.step_metrics else {},
                **self.eval_figures(("accuracy", "margin", "chosen_reward", "rejected_reward", "loss", "judge", "kl",
                                     "response_length"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": self.paths}

    def plot_title(self) -> str:
        d = self.cfg.dpo
        extra = f", sft_coef {d.sft_coef:g}" if d.sft_coef else ""
        return (f"{self.name}: {'DPO' if d.loss == 'sigmoid' else 'IPO'}, beta {d.beta:g}{extra} "
                f"({self.registry.world_size} ranks)")


RECIPE = RLHFDPO

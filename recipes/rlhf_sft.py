"""RLHF step 1: supervised fine-tuning of the actor on demonstrations (prompt + response; docs/rlhf.md).

    multiengine run rlhf_sft --config tiny --nproc-per-node 2
    multiengine run rlhf_sft --config opt1.3b --nproc-per-node 8

One trainable role (``actor``), any ZeRO stage, optional LoRA. The loss covers the response and its EOS only;
conversations are rendered with the chat template and only assistant tokens are learned. Reports the held-out
loss on evaluation rows that are never trained on (docs/data.md) and, on the built-in task, the judge's score of
sampled and greedy answers; exports export/actor (an HF folder with the tokenizer).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import mean_over_ranks, moe
from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.rlhf.data import ResponseData, SFTCollator, load_stage, training_batches
from multiengine.pipelines.rlhf.evaluation import EvalSettings, policy_answers
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import add_lm_role, export_role, role_folder, tiny_assets
from multiengine.pipelines.rlhf.steps import causal_lm_loss
from multiengine.pipelines.rlhf.tiny import TinySettings
from multiengine.recipes import common
from multiengine.recipes.language import plans
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class SFTConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_sft", "everything the run writes goes under this folder")
    max_steps: int = setting(300, "optimizer steps", Range(1))
    tiny: TinySettings = section(TinySettings, "the random tiny OPT built under output_dir/tiny for roles whose model "
                                               "is \"\" (mechanics only)")
    data: ResponseData = section(ResponseData, "demonstrations: prompt + response, messages or text rows "
                                               "(docs/data.md)")
    generation: GenerationSettings = section(GenerationSettings, "sampling of evaluation answers")
    eval: EvalSettings = section(EvalSettings, "judge score of sampled answers (seeded; what PPO optimises) and of "
                                               "greedy answers", every=100)
    export: common.ExportSettings = section(common.ExportSettings, "export/actor: an HF folder with the tokenizer")


class RLHFSFT(Recipe):
    name = "rlhf_sft"
    roles = (Role("actor", "the policy being fine-tuned; model \"\" = the random tiny OPT (tiny.*)", trainable=True,
                  sequences=True, routed=True,
                  omit=("token_budget",), why=common.TOKEN_BUDGET_WHY,
                  defaults={**common.RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 1e-3, "scheduler": "cosine",
                            "warmup_steps": 20, "micro_batch_size": 16}),)
    Config = SFTConfig
    renamed = common.old_keys("actor")
    headline = (("heldout_loss", "held-out loss", False), common.JUDGE_HEADLINE)
    plot_panels = [("cross-entropy", ["train/loss", "eval/heldout_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/greedy/judge"])]

    @classmethod
    def validate(cls, cfg: SFTConfig, world_size: int = 1) -> None:
        """Model folder, tokenizer vs vocabulary, data (formats, columns, rows, chat template, evaluation rows), and a
        micro batch of training rows per rank on ``world_size`` ranks."""
        common.check_hf_generation(cfg, cls.name)
        cls.check_batches(cfg, common.check_data(cfg, "sft", common.check_role(cfg, "actor")), world_size)

    @classmethod
    def check_batches(cls, cfg: SFTConfig, report: dict[str, Any] | None, world_size: int,
                      setting: str = "{key}={n}") -> None:
        """One stream of micro batches per rank (grad_accum draws it again, across epochs)."""
        common.check_stage_batches(report, world_size, key="roles.actor.micro_batch_size",
                                   value=cfg.roles.actor.micro_batch_size, setting=setting)

    @classmethod
    def plan(cls, cfg: SFTConfig, assume: Any = None) -> list[plans.RecipePlan]:
        a = cfg.roles.actor
        info = common.lm_info(cfg, a.model, "actor", assume)
        seq = cfg.data.max_prompt_len + cfg.data.max_response_len
        phases = plans.lm_role_phases(a, info, train=(a.micro_batch_size, seq), generate=common.eval_generation(cfg))
        return [plans.declared_roles(cfg, {"actor": info}, {"actor": phases}, title="rlhf_sft",
                                     notes=[f"sequences of {seq} tokens, micro batch {a.micro_batch_size}"],
                                     actor={"full_gather": ("generation",)})]

    def build(self) -> None:
        cfg, registry, actor = self.cfg, self.registry, self.cfg.roles.actor
        # 1. the model and its tokenizer (the random tiny OPT and the built-in task when left empty)
        assets = tiny_assets(registry, self.path("tiny"), cfg, actor.model)
        self.model_path, self.tokenizer = role_folder(actor, assets)
        add_lm_role(registry, actor, self.model_path, cfg.seed, total_steps=cfg.max_steps)
        registry.build()
        # 2. demonstrations to train on; evaluation rows (never trained on) for the held-out loss and prompts
        data = load_stage(registry, cfg.data, cfg.seed, "sft", assets)
        collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = training_batches(registry, cfg.data, cfg.seed, data, collate,
                                                      actor.micro_batch_size)
        # 3. sampled and greedy answers to the evaluation rows' prompts (the built-in task's judge scores them)
        self.answers = policy_answers(registry, data.eval, self.tokenizer, cfg.generation, cfg.eval,
                                      cfg.data.max_prompt_len)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        actor = registry["actor"]
        losses, routing = [], []
        for _ in range(actor.gradient_accumulation_steps()):
            # next micro batch of prompt + response + EOS (labels -100 on prompt and padding); token-mean
            # cross-entropy on the response (+ an MoE router's auxiliary loss over those tokens); backward; the
            # optimizer steps at the accumulation boundary
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            with moe.tapped(actor) as tap:
                loss = causal_lm_loss(actor, batch)
            aux, figures = moe.aux_term(actor, tap, batch["labels"] != -100)
            actor.backward(loss + aux)
            actor.step()
            losses.append(loss.item())
            routing.append(figures)
        means = {k: statistics.fmean(f[k] for f in routing) for k in routing[0]}
        return mean_over_ranks({"loss": statistics.fmean(losses), **means, "lr": actor.get_lr()[0]})

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        from multiengine.pipelines.rlhf.scoring import eval_mode

        registry = self.registry
        with eval_mode(registry, "actor") as actor:
            losses = [causal_lm_loss(actor, {k: v.to(registry.device) for k, v in b.items()}).item()
                      for b in self.heldout]
        result: dict[str, Any] = {}
        if losses:
            result["heldout_loss"] = mean_over_ranks({"loss": statistics.fmean(losses)})["loss"]
        return {**result, **self.answers()}

    def export(self) -> dict[str, Any]:
        return export_role(self.registry, self.cfg.export, self.path("export"), self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        losses = [m["loss"] for m in self.step_metrics]
        return {"first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                **self.eval_figures(("heldout_loss", "judge", "response_length", "greedy/judge"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


RECIPE = RLHFSFT

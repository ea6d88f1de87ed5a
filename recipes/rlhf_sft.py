"""RLHF step 1: supervised fine-tuning of the actor on demonstrations (prompt + response).

    multiengine run rlhf_sft --config tiny --nproc-per-node 2
    multiengine run rlhf_sft --config opt1.3b --nproc-per-node 8

One trainable role (``actor``) on the registry, any ZeRO stage, optional LoRA. The loss covers the
response and its EOS only (prompt tokens are labelled -100); conversations are rendered with the
tokenizer's chat template and only assistant tokens are learned. Data: ``data.source`` / ``data.sources``
with ``data.columns.<field>``; evaluation rows from ``data.eval_source`` / ``data.eval_split`` (by default
the source's eval/test split, else 5% held out), never the training rows (docs/data.md). Reports held-out
loss and, on the built-in
task, the judge's score of sampled and greedy answers before and after. Writes metrics.jsonl,
summary.json, curves.png and export/actor (an HF folder with the tokenizer; merged weights + adapter/
for LoRA) under output_dir; ``resume_from=latest`` continues a run from its checkpoints.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from multiengine.engines import mean_over_ranks, save_role
from multiengine.engines.recipe_config import Key, split_keys
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import actor_spec
from multiengine.pipelines.rlhf.runs import builtin_judge
from multiengine.pipelines.rlhf.steps import causal_lm_loss
from multiengine.recipes.common import (
    DATA_KEYS,
    RLHF_TRAINABLE,
    TINY_KEYS,
    check_data,
    check_model,
    check_stage_batches,
    check_tokenizer,
    demonstrations,
    evaluation_prompts,
    load_data,
    recipe_checks,
    role_tokenizer,
    tiny_assets,
    uses_builtin_data,
)
from multiengine.recipes.lifecycle import COMMON_KEYS, Recipe
from multiengine.recipes.schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys

ROLES = (
    Role("actor", "the policy being fine-tuned; model \"\" = the random tiny OPT (tiny.*)", trainable=True,
         keys={**RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 1e-3, "scheduler": "cosine", "warmup_steps": 20,
               "micro_batch_size": 16}),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_sft", "everything the run writes goes under this folder"),
    "max_steps": Key(300, "optimizer steps"),
    "roles": role_keys(ROLES),
    "tiny": TINY_KEYS,
    "data": Key({
        **DATA_KEYS,
        "max_prompt_len": Key(16, "prompt tokens kept (a longer prompt loses its beginning)"),
        "max_response_len": Key(16, "response tokens kept, EOS included"),
        "heldout_size": Key(128, "evaluation rows scored for the held-out loss (0 = all of them)"),
    }, "demonstrations: prompt + response, messages or text rows (docs/data.md)"),
    "generation": Key({
        "max_new_tokens": Key(8, "tokens generated per answer"),
        "temperature": Key(1.0, "sampling temperature"),
    }, "sampling of evaluation answers"),
    "eval": Key({
        "every": Key(100, "also evaluate every N steps (0 = only before and after)"),
        "size": Key(256, "evaluation prompts (the prompts of the evaluation rows), split over ranks"),
        "batch_size": Key(32, "prompts per generation batch"),
        "judge": Key(True, "the built-in task's programmatic judge (only for its prompts)"),
        "greedy": Key(True, "also score greedy answers"),
        "seed": Key(1234, "sampling seed of evaluation answers"),
    }, "judge score of sampled answers (seeded; what PPO optimises) and of greedy answers"),
    "export": Key({
        "enabled": Key(True, "export/actor: an HF folder with the tokenizer (merged weights + adapter/ for LoRA)"),
    }, "what the run writes under output_dir/export"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = recipe_checks(DEFAULTS)
RENAMED = old_keys("actor", extra={"model.tiny_hidden": "tiny.hidden", "model.tiny_layers": "tiny.layers"})


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder, tokenizer vs vocabulary, data (formats, columns, rows, chat template, evaluation rows), and a
    micro batch of training rows per rank on ``world_size`` ranks."""
    actor = cfg.roles.actor
    check_model("roles.actor.model", actor.model)
    tok = check_tokenizer("roles.actor.tokenizer", actor.tokenizer, "roles.actor.model", actor.model)
    check_batches(cfg, check_data(cfg, "sft", tok), world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """demonstrations(): one stream of micro batches per rank (grad_accum draws it again, across epochs)."""
    check_stage_batches(report, world_size, key="roles.actor.micro_batch_size", value=cfg.roles.actor.micro_batch_size,
                        setting=setting)


class RLHFSFT(Recipe):
    name = "rlhf_sft"
    headline = (("heldout_loss", "held-out loss", False),
                ("judge", "judge score of sampled answers (built-in task)", True))
    plot_panels = [("cross-entropy", ["train/loss", "eval/heldout_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/greedy/judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the model and its tokenizer (the random tiny OPT and the built-in task when left empty)
        actor = cfg.roles.actor
        assets = tiny_assets(self, uses_builtin_data(cfg.data) or not actor.model)
        self.model_path = actor.model or assets["model"]
        self.tokenizer = role_tokenizer(actor.tokenizer, self.model_path,
                                        role_tokenizer("", assets["tokenizer"]) if assets else None,
                                        what="roles.actor.model")
        registry.add(actor_spec(self.model_path, placement(cfg, ROLES, "actor"),
                                optim_spec(cfg, "actor", cfg.max_steps), micro_batch_size=actor.micro_batch_size, grad_accum=actor.grad_accum,
                                lora=lora_spec(cfg, "actor"), gradient_checkpointing=actor.gradient_checkpointing,
                                seed=cfg.seed))
        registry.build()

        # 2. demonstrations to train on; evaluation rows (never trained on) for the held-out loss and prompts
        data = load_data(self, "sft", default_source=assets.get("data", ""))
        self.batches, self.heldout = demonstrations(self, data, self.tokenizer, actor.micro_batch_size)
        self.eval_prompts = evaluation_prompts(self, data.eval, self.tokenizer)
        self.judge = builtin_judge([p for b in self.eval_prompts for p in b["prompts"]], cfg.eval.judge)
        self.generation = GenerationSettings(max_new_tokens=cfg.generation.max_new_tokens, do_sample=True,
                                             temperature=cfg.generation.temperature)
        self.greedy_generation = GenerationSettings(max_new_tokens=cfg.generation.max_new_tokens, do_sample=False)

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids.cpu(), skip_special_tokens=True)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        actor = registry["actor"]
        losses = []
        for _ in range(actor.gradient_accumulation_steps()):
            # 1. next micro batch of prompt + response + EOS (labels -100 on prompt and padding)
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            # 2. token-mean cross-entropy on the response; 3. backward; 4. step at the boundary
            loss = causal_lm_loss(actor, batch)
            actor.backward(loss)
            actor.step()
            losses.append(loss.item())
        # 5. the loss averaged over micro batches and ranks
        return mean_over_ranks({"loss": statistics.fmean(losses), "lr": actor.get_lr()[0]})

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        registry = self.registry
        module = registry.role("actor").module
        was_training = module.training
        module.eval()
        losses = [causal_lm_loss(registry["actor"], {k: v.to(registry.device) for k, v in b.items()}).item()
                  for b in self.heldout]
        module.train(was_training)
        result: dict[str, Any] = {}
        if losses:
            result["heldout_loss"] = mean_over_ranks({"loss": statistics.fmean(losses)})["loss"]
        if self.eval_prompts:
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            gen = evaluate_policy(registry, self.eval_prompts, self.generation, eos, pad, self.decode,
                                  judge=self.judge, seed=self.cfg.eval.seed)
            result.update(gen)
            if self.cfg.eval.greedy:
                greedy = evaluate_policy(registry, self.eval_prompts, self.greedy_generation, eos, pad, self.decode,
                                         judge=self.judge)
                result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        return result

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        return {"actor": save_role(self.registry, "actor", self.path("export", "actor"), tokenizer=self.tokenizer)}

    def summary_metrics(self) -> dict[str, Any]:
        losses = [m["loss"] for m in self.step_metrics]
        return {"first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                **self.eval_figures(("heldout_loss", "judge", "response_length", "greedy/judge"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


main = RLHFSFT.main

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
from typing import Any

import torch
from multiengine.engines import mean_over_ranks
from multiengine.engines.recipe_config import Key, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys
from multiengine.pipelines.rlhf.data import SFTCollator
from multiengine.pipelines.rlhf.roles import actor_spec
from multiengine.pipelines.rlhf.steps import causal_lm_loss
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, GENERATION_KEYS, RLHF_TRAINABLE, TINY_KEYS

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
        "max_prompt_len": common.PROMPT_LEN,
        "max_response_len": Key(16, "response tokens kept, EOS included"),
        "heldout_size": Key(128, "evaluation rows scored for the held-out loss (0 = all of them)"),
    }, "demonstrations: prompt + response, messages or text rows (docs/data.md)"),
    "generation": Key(dict(GENERATION_KEYS), "sampling of evaluation answers"),
    "eval": common.eval_keys("judge score of sampled answers (seeded; what PPO optimises) and of greedy answers",
                             every=100),
    "export": common.export_keys("actor", ": an HF folder with the tokenizer (merged weights + adapter/ for LoRA)"),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("actor", extra=common.TINY_RENAMED)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder, tokenizer vs vocabulary, data (formats, columns, rows, chat template, evaluation rows), and a
    micro batch of training rows per rank on ``world_size`` ranks."""
    check_batches(cfg, common.check_data(cfg, "sft", common.check_role(cfg, "actor")), world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """One stream of micro batches per rank (grad_accum draws it again, across epochs)."""
    common.check_stage_batches(report, world_size, key="roles.actor.micro_batch_size",
                               value=cfg.roles.actor.micro_batch_size, setting=setting)


class RLHFSFT(Recipe):
    name = "rlhf_sft"
    headline = (("heldout_loss", "held-out loss", False),
                common.JUDGE_HEADLINE)
    plot_panels = [("cross-entropy", ["train/loss", "eval/heldout_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/greedy/judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the model and its tokenizer (the random tiny OPT and the built-in task when left empty)
        actor = cfg.roles.actor
        assets = common.tiny_assets(self, actor.model)
        self.model_path, self.tokenizer = common.role_folder(self, "actor", assets)
        registry.add(actor_spec(self.model_path, placement(cfg, ROLES, "actor"),
                                optim_spec(cfg, "actor", cfg.max_steps), micro_batch_size=actor.micro_batch_size,
                                grad_accum=actor.grad_accum, lora=lora_spec(cfg, "actor"),
                                gradient_checkpointing=actor.gradient_checkpointing, seed=cfg.seed))
        registry.build()

        # 2. demonstrations to train on; evaluation rows (never trained on) for the held-out loss and prompts
        data = common.load_data(self, "sft", assets)
        collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = common.training_batches(self, data, collate, actor.micro_batch_size)
        # 3. sampled and greedy answers to the evaluation rows' prompts (the built-in task's judge scores them)
        self.answers = common.policy_answers(self, data.eval, self.tokenizer)

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
        return {**result, **self.answers()}

    def export(self) -> dict[str, Any]:
        return common.export_role(self, self.tokenizer)

    def summary_metrics(self) -> dict[str, Any]:
        losses = [m["loss"] for m in self.step_metrics]
        return {"first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                **self.eval_figures(("heldout_loss", "judge", "response_length", "greedy/judge"))}

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


main = RLHFSFT.main
plan = plans.rlhf_sft  # what `multiengine plan` sees of this recipe

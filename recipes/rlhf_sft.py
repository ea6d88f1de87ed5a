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
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import actor_spec
from multiengine.pipelines.rlhf.runs import builtin_judge
from multiengine.pipelines.rlhf.steps import causal_lm_loss
from multiengine.recipes.common import (
    COMMON_HELP,
    DATA_DEFAULTS,
    RLHF_BETAS,
    check_data,
    check_model,
    check_stage_batches,
    check_tokenizer,
    demonstrations,
    evaluation_prompts,
    load_data,
    lora_spec,
    optim_spec,
    placement,
    recipe_checks,
    role_tokenizer,
    tiny_assets,
    uses_builtin_data,
)
from multiengine.recipes.lifecycle import COMMON_DEFAULTS, Recipe

DEFAULTS: dict[str, Any] = {
    **COMMON_DEFAULTS,
    "output_dir": "outputs/rlhf_sft",  # everything the run writes goes under this folder
    "max_steps": 300,  # optimizer steps
    "model": {  # the model to fine-tune
        "pretrained": "",  # a causal-LM folder (save_pretrained) or hub name; "" = the random tiny OPT
        "tokenizer": "",  # a tokenizer folder or hub name; "" = the model folder's own
        "tiny_hidden": 64,  # width of the random tiny OPT (model.pretrained="")
        "tiny_layers": 2,  # layers of the random tiny OPT
    },
    "data": {  # demonstrations: prompt + response, messages or text rows (docs/data.md)
        **DATA_DEFAULTS,
        "max_prompt_len": 16,  # prompt tokens kept (a longer prompt loses its beginning)
        "max_response_len": 16,  # response tokens kept, EOS included
        "heldout_size": 128,  # evaluation rows scored for the held-out loss (0 = all of them)
    },
    "train": {  # the actor's optimizer and batches
        "micro_batch_size": 16,  # rows per rank per forward/backward
        "grad_accum": 1,  # micro batches per optimizer step
        "lr": 1e-3,  # peak learning rate
        "weight_decay": 0.0,  # AdamW weight decay
        "scheduler": "cosine",  # a transformers scheduler name
        "warmup_steps": 20,  # linear warm-up steps
        "max_grad_norm": 1.0,  # gradient clipping (0 = none)
        "gradient_checkpointing": False,  # recompute activations in backward (less memory)
    },
    "roles": {  # placement of each role
        "actor": {  # the policy being fine-tuned
            "stage": 2,  # ZeRO stage 0-3
            "dtype": "fp32",  # fp32 | bf16 | fp16 (GPU only)
            "offload_params": False,  # ZeRO-3 parameter offload to CPU
            "offload_optimizer": False,  # optimizer state offload to CPU
        },
    },
    "lora": {  # LoRA adapters instead of full fine-tuning
        "enabled": False,  # train peft LoRA adapters only
        "rank": 8,  # adapter rank
        "alpha": 0.0,  # scaling (0 = the rank)
        "dropout": 0.0,  # adapter dropout
        "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"],  # module names that get adapters
    },
    "generation": {  # sampling of evaluation answers
        "max_new_tokens": 8,  # tokens generated per answer
        "temperature": 1.0,  # sampling temperature
    },
    "eval": {  # judge score of sampled answers (seeded; what PPO optimises) and of greedy answers
        "every": 100,  # also evaluate every N steps (0 = only before and after)
        "size": 256,  # evaluation prompts (the prompts of the evaluation rows), split over ranks
        "batch_size": 32,  # prompts per generation batch
        "judge": True,  # the built-in task's programmatic judge (only for its prompts)
        "greedy": True,  # also score greedy answers
        "seed": 1234,  # sampling seed of evaluation answers
    },
    "export": {  # what the run writes under output_dir/export
        "enabled": True,  # export/actor: an HF folder with the tokenizer (merged weights + adapter/ for LoRA)
    },
}
CHECKS = recipe_checks(DEFAULTS)
HELP = dict(COMMON_HELP)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder, tokenizer vs vocabulary, data (formats, columns, rows, chat template, evaluation rows), and a
    micro batch of training rows per rank on ``world_size`` ranks."""
    check_model("model.pretrained", cfg.model.pretrained)
    tok = check_tokenizer("model.tokenizer", cfg.model.tokenizer, "model.pretrained", cfg.model.pretrained)
    check_batches(cfg, check_data(cfg, "sft", tok), world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """demonstrations(): one stream of micro batches per rank (grad_accum draws it again, across epochs)."""
    check_stage_batches(report, world_size, key="train.micro_batch_size", value=cfg.train.micro_batch_size,
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
        assets = tiny_assets(self, uses_builtin_data(cfg.data) or not cfg.model.pretrained)
        self.model_path = cfg.model.pretrained or assets["model"]
        self.tokenizer = role_tokenizer(cfg.model.tokenizer, self.model_path,
                                        role_tokenizer("", assets["tokenizer"]) if assets else None,
                                        what="model.pretrained")
        t = cfg.train
        registry.add(actor_spec(self.model_path, placement(cfg.roles.actor),
                                optim_spec(t, cfg.max_steps, betas=RLHF_BETAS), micro_batch_size=t.micro_batch_size,
                                grad_accum=t.grad_accum, lora=lora_spec(cfg.lora),
                                gradient_checkpointing=t.gradient_checkpointing,
                                seed=cfg.seed))
        registry.build()

        # 2. demonstrations to train on; evaluation rows (never trained on) for the held-out loss and prompts
        data = load_data(self, "sft", default_source=assets.get("data", ""))
        self.batches, self.heldout = demonstrations(self, data, self.tokenizer, t.micro_batch_size)
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

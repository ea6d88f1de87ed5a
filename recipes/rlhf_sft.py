"""RLHF step 1: supervised fine-tuning of the actor on demonstrations (prompt + response).

    multiengine run rlhf_sft --config tiny --nproc-per-node 2
    multiengine run rlhf_sft --config opt1.3b --nproc-per-node 8

One trainable role (``actor``) on the registry, any ZeRO stage, optional LoRA. The loss covers the
response and its EOS only (prompt tokens are labelled -100). Reports held-out loss and, on the built-in
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
from multiengine.pipelines.rlhf.runs import builtin_judge, resolve_tokenizer
from multiengine.pipelines.rlhf.steps import causal_lm_loss
from multiengine.recipes.common import (
    RLHF_BETAS,
    demonstrations,
    evaluation_prompts,
    lora_spec,
    optim_spec,
    placement,
    tiny_assets,
)
from multiengine.recipes.lifecycle import Recipe, with_common

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/rlhf_sft",
    "max_steps": 300,  # optimizer steps
    "model": {"pretrained": "", "tiny_hidden": 64, "tiny_layers": 2},  # "" = the random tiny OPT
    "data": {
        "source": "",  # folder of {sft,eval}.jsonl, a file, or a hub name; "" = the built-in task
        "train_split": "train",
        "eval_split": "test",
        "max_prompt_len": 16,
        "max_response_len": 16,
        "heldout_size": 128,  # the last rows of the SFT data, never trained on (held-out loss)
    },
    "train": {"micro_batch_size": 16, "grad_accum": 1, "lr": 1e-3, "weight_decay": 0.0, "scheduler": "cosine",
              "warmup_steps": 20, "max_grad_norm": 1.0, "gradient_checkpointing": False},
    "roles": {"actor": {"stage": 2, "dtype": "fp32", "offload_params": False, "offload_optimizer": False}},
    "lora": {"enabled": False, "rank": 8, "alpha": 0.0, "dropout": 0.0,
             "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"]},
    "generation": {"max_new_tokens": 8, "temperature": 1.0},
    # judge score of sampled answers (seeded; what PPO optimises) and of greedy answers
    "eval": {"every": 100, "size": 256, "batch_size": 32, "judge": True, "greedy": True, "seed": 1234},
    "export": {"enabled": True},
})


class RLHFSFT(Recipe):
    name = "rlhf_sft"
    plot_panels = [("cross-entropy", ["train/loss", "eval/heldout_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/greedy/judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        assets = tiny_assets(self, not (cfg.data.source and cfg.model.pretrained))
        self.model_path = cfg.model.pretrained or assets["model"]
        self.tokenizer = resolve_tokenizer(self.model_path, assets.get("tokenizer", ""))
        t = cfg.train
        registry.add(actor_spec(self.model_path, placement(cfg.roles.actor),
                                optim_spec(t, cfg.max_steps, betas=RLHF_BETAS), micro_batch_size=t.micro_batch_size,
                                grad_accum=t.grad_accum, lora=lora_spec(cfg.lora),
                                gradient_checkpointing=t.gradient_checkpointing,
                                seed=cfg.seed))
        registry.build()

        source = cfg.data.source or assets["data"]
        self.batches, self.heldout = demonstrations(self, source, self.tokenizer, t.micro_batch_size)
        self.eval_prompts = evaluation_prompts(self, source, self.tokenizer)
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

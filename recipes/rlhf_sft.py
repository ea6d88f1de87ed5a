"""RLHF step 1: supervised fine-tuning of the actor on demonstrations (prompt + response).

    multiengine run rlhf_sft --config tiny --nproc-per-node 2
    multiengine run rlhf_sft --config opt13b --nproc-per-node 8

One trainable role (``actor``) on the registry, any ZeRO stage, optional LoRA. The loss covers the
response and its EOS only (prompt tokens are labelled -100). Reports held-out loss and, on the built-in
task, the judge's score of greedy answers before and after. Writes metrics.jsonl, summary.json and
export/actor (an HF folder with the tokenizer; merged weights + adapter/ for LoRA) under output_dir.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.metrics import MetricsLogger, write_summary
from multiengine.pipelines.rlhf.data import PromptCollator, SFTCollator
from multiengine.pipelines.rlhf.export import export_causal_lm
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import LoraSettings, OptimSettings, Placement, actor_spec
from multiengine.pipelines.rlhf.runs import (
    BatchStream,
    builtin_judge,
    fixed_batches,
    gather_memory,
    load_split,
    prepare_tiny_assets,
    resolve_tokenizer,
)
from multiengine.pipelines.rlhf.trainer import all_reduce_mean, causal_lm_loss, evaluate_policy
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/rlhf_sft",
    "seed": 0,
    "max_steps": 300,  # optimizer steps
    "backend": "auto",
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
    "tensorboard": False,
}


class RLHFSFT:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.step = 0
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.history: list[dict[str, Any]] = []

    def setup(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.registry = registry = EngineRegistry(backend=cfg.backend)
        self.builtin = not cfg.data.source
        assets = {}
        if self.builtin or not cfg.model.pretrained:
            assets = prepare_tiny_assets(os.path.join(cfg.output_dir, "tiny"), registry, cfg.seed,
                                         cfg.model.tiny_hidden, cfg.model.tiny_layers)
        self.model_path = cfg.model.pretrained or assets["model"]
        self.tokenizer = resolve_tokenizer(self.model_path, assets.get("tokenizer", ""))
        t = cfg.train
        self.lora = LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha or None, dropout=cfg.lora.dropout,
                                 target_modules=tuple(cfg.lora.target_modules)) if cfg.lora.enabled else None
        r = cfg.roles.actor
        registry.add(actor_spec(
            self.model_path, Placement(r.stage, r.dtype, r.offload_params, r.offload_optimizer),
            OptimSettings(lr=t.lr, weight_decay=t.weight_decay, scheduler=t.scheduler, warmup_steps=t.warmup_steps,
                          total_steps=cfg.max_steps, max_grad_norm=t.max_grad_norm or None),
            micro_batch_size=t.micro_batch_size, grad_accum=t.grad_accum, lora=self.lora,
            gradient_checkpointing=t.gradient_checkpointing, seed=cfg.seed))
        registry.build()

        source = cfg.data.source or assets["data"]
        rows = load_split(source, "sft", registry, cfg.data.train_split)
        n_heldout = min(cfg.data.heldout_size, len(rows) // 10)
        train_rows = rows.select(range(len(rows) - n_heldout))
        collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches = BatchStream(train_rows, collate, t.micro_batch_size, registry, seed=cfg.seed)
        self.heldout = fixed_batches(rows.select(range(len(rows) - n_heldout, len(rows))), collate,
                                     t.micro_batch_size, registry)
        self.eval_prompts: list[dict[str, Any]] = []
        if cfg.eval.size:
            eval_rows = load_split(source, "eval", registry, cfg.data.eval_split)
            self.eval_prompts = fixed_batches(eval_rows, PromptCollator(self.tokenizer, cfg.data.max_prompt_len),
                                              cfg.eval.batch_size, registry, limit=cfg.eval.size)
        self.judge = builtin_judge([p for b in self.eval_prompts for p in b["prompts"]], cfg.eval.judge)
        self.generation = GenerationSettings(max_new_tokens=cfg.generation.max_new_tokens, do_sample=True,
                                             temperature=cfg.generation.temperature)
        self.greedy_generation = GenerationSettings(max_new_tokens=cfg.generation.max_new_tokens, do_sample=False)
        self.metrics = MetricsLogger(
            os.path.join(cfg.output_dir, "metrics.jsonl"), enabled=registry.is_main,
            tensorboard_dir=os.path.join(cfg.output_dir, "tensorboard") if cfg.tensorboard else None)

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids.cpu(), skip_special_tokens=True)

    def train(self) -> None:
        cfg, registry = self.cfg, self.registry
        actor = registry["actor"]
        self.evaluate("before")
        bar = tqdm(total=cfg.max_steps, desc="rlhf_sft", disable=not registry.is_main)
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            losses = []
            for _ in range(actor.gradient_accumulation_steps()):
                # 1. next micro batch of prompt + response + EOS (labels -100 on prompt and padding)
                batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
                # 2. token-mean cross-entropy on the response; 3. backward; 4. step at the boundary
                loss = causal_lm_loss(actor, batch)
                actor.backward(loss)
                actor.step()
                losses.append(loss.item())
            self.step += 1
            # 5. log the loss averaged over ranks; periodic evaluation (all ranks)
            loss = all_reduce_mean(statistics.fmean(losses))
            self.losses.append(loss)
            self.step_times.append(time.perf_counter() - t0)
            self.metrics.log(self.step, {"loss": loss, "lr": actor.get_lr()[0], "step_time_s": self.step_times[-1]},
                             prefix="train")
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.max_steps:
                self.evaluate(f"step_{self.step}")
        bar.close()
        self.evaluate("after")

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, Any]:
        registry = self.registry
        module = registry.role("actor").module
        was_training = module.training
        module.eval()
        losses = [causal_lm_loss(registry["actor"], {k: v.to(registry.device) for k, v in b.items()}).item()
                  for b in self.heldout]
        module.train(was_training)
        result: dict[str, Any] = {"heldout_loss": all_reduce_mean(statistics.fmean(losses)) if losses else None}
        samples: list[Any] = []
        if self.eval_prompts:
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            gen = evaluate_policy(registry, self.eval_prompts, self.generation, eos, pad, self.decode,
                                  judge=self.judge, seed=self.cfg.eval.seed)
            samples = gen.pop("samples")
            result.update(gen)
            if self.cfg.eval.greedy:
                greedy = evaluate_policy(registry, self.eval_prompts, self.greedy_generation, eos, pad, self.decode,
                                         judge=self.judge)
                result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        self.metrics.log(self.step, {k: v for k, v in result.items() if v is not None}, prefix="eval")
        self.history.append({"tag": tag, "step": self.step, **result, "samples": samples})
        logger.info("eval (%s, step %d): %s", tag, self.step,
                    ", ".join(f"{k} {v:.4f}" for k, v in result.items() if v is not None))
        for prompt, answer in samples[:3]:
            logger.info("  %s -> %s", prompt, answer)
        return result

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        out = os.path.join(self.cfg.output_dir, "export", "actor")
        return {"actor": export_causal_lm(self.registry, "actor", out, self.tokenizer, self.model_path, self.lora)}

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        before, after = self.history[0], self.history[-1]
        times = self.step_times[1:] or self.step_times
        metrics = {
            "steps": self.step,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "step_time_s_mean": statistics.fmean(times) if times else None,
        }
        for tag, h in (("before", before), ("after", after)):
            for key in ("heldout_loss", "judge", "response_length", "greedy/judge"):
                if h.get(key) is not None:
                    metrics[f"eval/{tag}/{key}"] = h[key]
        return {
            "recipe": "rlhf_sft",
            "world_size": self.registry.world_size,
            "model_path": self.model_path,
            "metrics": metrics,
            "evaluations": self.history,
            "memory": {"per_rank": gather_memory(self.registry)},
            "roles": self.registry.describe(),
            "export": export,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }


def main(cfg: Any) -> dict[str, Any]:
    run = RLHFSFT(cfg)
    run.setup()
    try:
        run.train()
        export = run.export()
        summary = run.summary(export)
        if run.registry.is_main:
            write_summary(os.path.join(cfg.output_dir, "summary.json"), summary)
    finally:
        run.metrics.close()
    return {"metrics": summary["metrics"], "export": export}

"""RLHF step 2: reward model (LM body + scalar head) trained on preference pairs.

    multiengine run rlhf_reward --config tiny --nproc-per-node 2
    multiengine run rlhf_reward --config opt350m --nproc-per-node 8

One trainable role (``reward``, a :class:`ScalarHeadModel`) on the registry. Loss: Bradley-Terry
``-log sigmoid(s_chosen - s_rejected)`` on the score at the last real token (the EOS). Reports held-out
pair accuracy before and after. Writes metrics.jsonl, summary.json and export/reward (body +
value_head.safetensors + tokenizer; loads as step 3's reward model and critic) under output_dir.
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
from multiengine.pipelines.rlhf.data import PairCollator
from multiengine.pipelines.rlhf.export import export_scalar_model
from multiengine.pipelines.rlhf.roles import LoraSettings, OptimSettings, Placement, critic_spec
from multiengine.pipelines.rlhf.runs import (
    BatchStream,
    fixed_batches,
    gather_memory,
    load_split,
    prepare_tiny_assets,
    resolve_tokenizer,
)
from multiengine.pipelines.rlhf.trainer import all_reduce_mean, pair_accuracy, reward_loss
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/rlhf_reward",
    "seed": 0,
    "max_steps": 300,  # optimizer steps
    "backend": "auto",
    # "" = the random tiny OPT; InstructGPT starts the reward model from the SFT model, DeepSpeed-Chat from
    # a separate pretrained model (OPT-350m): any causal-LM folder or a previous reward export works.
    "model": {"pretrained": "", "tiny_hidden": 64, "tiny_layers": 2},
    "data": {
        "source": "",  # folder with reward.jsonl, a file, or a hub name; "" = the built-in task
        "train_split": "train",
        "eval_split": "test",  # hub datasets: held-out pairs come from this split
        "max_prompt_len": 16,
        "max_response_len": 16,
        "heldout_size": 512,  # local data: the last rows, never trained on
    },
    "train": {"micro_batch_size": 16, "grad_accum": 1, "lr": 5e-4, "weight_decay": 0.0, "scheduler": "cosine",
              "warmup_steps": 20, "max_grad_norm": 1.0, "gradient_checkpointing": False},
    "roles": {"reward": {"stage": 2, "dtype": "fp32", "offload_params": False, "offload_optimizer": False}},
    "lora": {"enabled": False, "rank": 8, "alpha": 0.0, "dropout": 0.0,
             "target_modules": ["q_proj", "k_proj", "v_proj", "out_proj"]},
    "eval": {"every": 100},
    "export": {"enabled": True},
    "tensorboard": False,
}


class RLHFReward:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.step = 0
        self.losses: list[float] = []
        self.accuracies: list[float] = []
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
        t, r = cfg.train, cfg.roles.reward
        self.lora = LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha or None, dropout=cfg.lora.dropout,
                                 target_modules=tuple(cfg.lora.target_modules)) if cfg.lora.enabled else None
        registry.add(critic_spec(
            self.model_path, Placement(r.stage, r.dtype, r.offload_params, r.offload_optimizer),
            OptimSettings(lr=t.lr, weight_decay=t.weight_decay, scheduler=t.scheduler, warmup_steps=t.warmup_steps,
                          total_steps=cfg.max_steps, max_grad_norm=t.max_grad_norm or None),
            micro_batch_size=t.micro_batch_size * 2,  # chosen and rejected rows of each pair in one batch
            grad_accum=t.grad_accum, lora=self.lora, gradient_checkpointing=t.gradient_checkpointing,
            seed=cfg.seed, name="reward"))
        registry.build()

        source = cfg.data.source or assets["data"]
        rows = load_split(source, "reward", registry, cfg.data.train_split)
        collate = PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        if os.path.exists(source):
            n_heldout = min(cfg.data.heldout_size, len(rows) // 5)
            train_rows = rows.select(range(len(rows) - n_heldout))
            heldout_rows = rows.select(range(len(rows) - n_heldout, len(rows)))
        else:
            train_rows = rows
            heldout_rows = load_split(source, "reward", registry, cfg.data.eval_split)
            heldout_rows = heldout_rows.select(range(min(cfg.data.heldout_size, len(heldout_rows))))
        self.batches = BatchStream(train_rows, collate, t.micro_batch_size, registry, seed=cfg.seed)
        self.heldout = fixed_batches(heldout_rows, collate, t.micro_batch_size, registry)
        self.metrics = MetricsLogger(
            os.path.join(cfg.output_dir, "metrics.jsonl"), enabled=registry.is_main,
            tensorboard_dir=os.path.join(cfg.output_dir, "tensorboard") if cfg.tensorboard else None)

    def train(self) -> None:
        cfg, registry = self.cfg, self.registry
        engine = registry["reward"]
        self.evaluate("before")
        bar = tqdm(total=cfg.max_steps, desc="rlhf_reward", disable=not registry.is_main)
        while self.step < cfg.max_steps:
            t0 = time.perf_counter()
            losses, accs = [], []
            for _ in range(engine.gradient_accumulation_steps()):
                # 1. next micro batch: chosen rows then rejected rows, right padded
                batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
                # 2. scores at the last real token; pairwise loss; 3. backward; 4. step at the boundary
                loss, acc = reward_loss(engine, batch)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                accs.append(acc.item())
            self.step += 1
            # 5. log loss and batch accuracy averaged over ranks; periodic held-out accuracy
            loss, acc = all_reduce_mean(statistics.fmean(losses)), all_reduce_mean(statistics.fmean(accs))
            self.losses.append(loss)
            self.accuracies.append(acc)
            self.step_times.append(time.perf_counter() - t0)
            self.metrics.log(self.step, {"loss": loss, "accuracy": acc, "lr": engine.get_lr()[0],
                                         "step_time_s": self.step_times[-1]}, prefix="train")
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}")
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.max_steps:
                self.evaluate(f"step_{self.step}")
        bar.close()
        self.evaluate("after")

    def evaluate(self, tag: str) -> dict[str, float]:
        result = pair_accuracy(self.registry, "reward", self.heldout)
        self.metrics.log(self.step, result, prefix="eval")
        self.history.append({"tag": tag, "step": self.step, **result})
        logger.info("held-out pairs (%s, step %d): accuracy %.4f, margin %.4f over %d pairs", tag, self.step,
                    result["accuracy"], result["margin"], result["pairs"])
        return result

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        out = os.path.join(self.cfg.output_dir, "export", "reward")
        return {"reward": export_scalar_model(self.registry, "reward", out, self.tokenizer, self.model_path,
                                              self.lora)}

    def summary(self, export: dict[str, Any]) -> dict[str, Any]:
        from omegaconf import OmegaConf

        times = self.step_times[1:] or self.step_times
        metrics = {
            "steps": self.step,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "final_train_accuracy": self.accuracies[-1] if self.accuracies else None,
            "heldout_accuracy_before": self.history[0]["accuracy"],
            "heldout_accuracy": self.history[-1]["accuracy"],
            "heldout_margin": self.history[-1]["margin"],
            "heldout_pairs": self.history[-1]["pairs"],
            "step_time_s_mean": statistics.fmean(times) if times else None,
        }
        return {
            "recipe": "rlhf_reward",
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
    run = RLHFReward(cfg)
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

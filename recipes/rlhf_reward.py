"""RLHF step 2: reward model (LM body + scalar head) trained on preference pairs.

    multiengine run rlhf_reward --config tiny --nproc-per-node 2
    multiengine run rlhf_reward --config opt350m --nproc-per-node 8

One trainable role (``reward``, a :class:`ScalarHeadModel`) on the registry. Loss: Bradley-Terry
``-log sigmoid(s_chosen - s_rejected)`` on the score at the last real token (the EOS). Reports held-out
pair accuracy before and after. Writes metrics.jsonl, summary.json, curves.png and export/reward (body +
value_head.safetensors + tokenizer; loads as step 3's reward model and critic) under output_dir;
``resume_from=latest`` continues a run from its checkpoints.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from multiengine.engines import ShardedBatches, mean_over_ranks, save_role, shard_batches
from multiengine.pipelines.rlhf.data import PairCollator
from multiengine.pipelines.rlhf.roles import critic_spec
from multiengine.pipelines.rlhf.runs import load_split, prepare_tiny_assets, resolve_tokenizer
from multiengine.pipelines.rlhf.trainer import pair_accuracy, reward_loss
from multiengine.recipes.common import RLHF_BETAS, lora_spec, optim_spec, placement
from multiengine.recipes.lifecycle import Recipe, with_common

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/rlhf_reward",
    "max_steps": 300,  # optimizer steps
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
})


class RLHFReward(Recipe):
    name = "rlhf_reward"
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("pairwise loss", ["train/loss"]), ("pair accuracy", ["train/accuracy", "eval/accuracy"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        assets: dict[str, str] = {}
        if not cfg.data.source or not cfg.model.pretrained:
            assets = prepare_tiny_assets(self.path("tiny"), registry, cfg.seed, cfg.model.tiny_hidden,
                                         cfg.model.tiny_layers)
        self.model_path = cfg.model.pretrained or assets["model"]
        self.tokenizer = resolve_tokenizer(self.model_path, assets.get("tokenizer", ""))
        t = cfg.train
        registry.add(critic_spec(
            self.model_path, placement(cfg.roles.reward), optim_spec(t, cfg.max_steps, betas=RLHF_BETAS),
            micro_batch_size=t.micro_batch_size * 2,  # chosen and rejected rows of each pair in one batch
            grad_accum=t.grad_accum, lora=lora_spec(cfg.lora), gradient_checkpointing=t.gradient_checkpointing,
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
        self.batches = registry.add_state("batches", ShardedBatches(
            train_rows, collate, t.micro_batch_size, registry.world_size, registry.rank, seed=cfg.seed))
        self.heldout = shard_batches(heldout_rows, collate, t.micro_batch_size, registry.world_size, registry.rank)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        engine = registry["reward"]
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
        # 5. loss and batch accuracy averaged over micro batches and ranks
        return mean_over_ranks({"loss": statistics.fmean(losses), "accuracy": statistics.fmean(accs),
                                "lr": engine.get_lr()[0]})

    def evaluate(self, tag: str) -> dict[str, Any]:
        return pair_accuracy(self.registry, "reward", self.heldout)

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        return {"reward": save_role(self.registry, "reward", self.path("export", "reward"), tokenizer=self.tokenizer)}

    def summary_metrics(self) -> dict[str, Any]:
        before, after = self.evaluation("before"), self.evaluation("after")
        last = self.step_metrics[-1] if self.step_metrics else {}
        return {
            "first_loss": self.step_metrics[0]["loss"] if self.step_metrics else None,
            "final_loss": last.get("loss"),
            "final_train_accuracy": last.get("accuracy"),
            "heldout_accuracy_before": before["accuracy"] if before else None,
            "heldout_accuracy": after["accuracy"],
            "heldout_margin": after["margin"],
            "heldout_pairs": after["pairs"],
        }

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


main = RLHFReward.main

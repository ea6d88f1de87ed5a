"""RLHF step 2: reward model (LM body + scalar head) trained on preference pairs.

    multiengine run rlhf_reward --config tiny --nproc-per-node 2
    multiengine run rlhf_reward --config opt350m --nproc-per-node 8

One trainable role (``reward``, a :class:`ScalarHeadModel`) on the registry. Loss: Bradley-Terry
``-log sigmoid(s_chosen - s_rejected)`` on the score at the last real token (the EOS). Reports held-out
pair accuracy before and after, on evaluation rows that are never trained on (``data.eval_source`` /
``data.eval_split``). Writes metrics.jsonl, summary.json, curves.png and export/reward (a
``*ForSequenceClassification`` folder + tokenizer; loads as step 3's reward model and critic and with
``AutoModelForSequenceClassification``) under output_dir; ``resume_from=latest`` continues a run.
"""

from __future__ import annotations

import statistics
from typing import Any

from multiengine.engines import ShardedBatches, mean_over_ranks, save_role, shard_batches
from multiengine.pipelines.rlhf.data import PairCollator
from multiengine.pipelines.rlhf.evaluation import pair_accuracy
from multiengine.pipelines.rlhf.roles import critic_spec
from multiengine.pipelines.rlhf.steps import reward_loss
from multiengine.recipes.common import (
    COMMON_HELP,
    DATA_DEFAULTS,
    RLHF_BETAS,
    check_data,
    check_model,
    check_stage_batches,
    check_tokenizer,
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

KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_reward", "everything the run writes goes under this folder"),
    "max_steps": Key(300, "optimizer steps"),
    # InstructGPT starts the reward model from the SFT model, DeepSpeed-Chat from a separate pretrained model
    # (OPT-350m): any causal-LM folder, a previous reward export or a TRL reward model works
    "model": Key({
        "pretrained": Key("", "causal-LM folder, SFT or reward export, *ForSequenceClassification folder; \"\" = "
                              "tiny OPT"),
        "tokenizer": Key("", "a tokenizer folder or hub name; \"\" = the model folder's own"),
        "tiny_hidden": Key(64, "width of the random tiny OPT (model.pretrained=\"\")"),
        "tiny_layers": Key(2, "layers of the random tiny OPT"),
    }, "the reward model's starting point"),
    "data": Key({
        **DATA_DEFAULTS,
        "max_prompt_len": Key(16, "prompt tokens kept (a longer prompt loses its beginning)"),
        "max_response_len": Key(16, "answer tokens kept, EOS included"),
        "heldout_size": Key(512, "evaluation pairs scored for the held-out accuracy (0 = all of them)"),
    }, "preference pairs: prompt + chosen + rejected, or chosen + rejected (docs/data.md)"),
    "train": Key({
        "micro_batch_size": Key(16, "pairs per rank per forward/backward (2 rows each)"),
        "grad_accum": Key(1, "micro batches per optimizer step"),
        "lr": Key(5e-4, "peak learning rate"),
        "weight_decay": Key(0.0, "AdamW weight decay"),
        "scheduler": Key("cosine", "a transformers scheduler name"),
        "warmup_steps": Key(20, "linear warm-up steps"),
        "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
        "gradient_checkpointing": Key(False, "recompute activations in backward (less memory)"),
    }, "the reward model's optimizer and batches"),
    "roles": Key({
        "reward": Key({
            "stage": Key(2, "ZeRO stage 0-3"),
            "dtype": Key("fp32", "fp32 | bf16 | fp16 (GPU only)"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "offload_optimizer": Key(False, "optimizer state offload to CPU"),
        }, "the reward model being trained (LM body + scalar head)"),
    }, "placement of each role"),
    "lora": Key({
        "enabled": Key(False, "train peft LoRA adapters only"),
        "rank": Key(8, "adapter rank"),
        "alpha": Key(0.0, "scaling (0 = the rank)"),
        "dropout": Key(0.0, "adapter dropout"),
        "target_modules": Key(["q_proj", "k_proj", "v_proj", "out_proj"], "module names that get adapters"),
    }, "LoRA adapters on the body (the head trains fully)"),
    "eval": Key({
        "every": Key(100, "also evaluate every N steps (0 = only before and after)"),
    }, "held-out pair accuracy"),
    "export": Key({
        "enabled": Key(True, "export/reward: a *ForSequenceClassification folder with the tokenizer"),
    }, "what the run writes under output_dir/export"),
}
CHECKS = recipe_checks(DEFAULTS)
HELP = dict(COMMON_HELP)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder, tokenizer vs vocabulary, preference data (formats, columns, rows, chat template, held-out
    pairs), and a micro batch of training pairs per rank on ``world_size`` ranks."""
    check_model("model.pretrained", cfg.model.pretrained)
    tok = check_tokenizer("model.tokenizer", cfg.model.tokenizer, "model.pretrained", cfg.model.pretrained)
    check_batches(cfg, check_data(cfg, "reward", tok), world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """One stream of micro batches of pairs per rank (grad_accum draws it again, across epochs)."""
    check_stage_batches(report, world_size, key="train.micro_batch_size", value=cfg.train.micro_batch_size,
                        unit="pairs", setting=setting)


class RLHFReward(Recipe):
    name = "rlhf_reward"
    headline = (("accuracy", "held-out pair accuracy", True),)
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("pairwise loss", ["train/loss"]), ("pair accuracy", ["train/accuracy", "eval/accuracy"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the model (LM body + scalar head) and its tokenizer
        assets = tiny_assets(self, uses_builtin_data(cfg.data) or not cfg.model.pretrained)
        self.model_path = cfg.model.pretrained or assets["model"]
        self.tokenizer = role_tokenizer(cfg.model.tokenizer, self.model_path,
                                        role_tokenizer("", assets["tokenizer"]) if assets else None,
                                        what="model.pretrained")
        t = cfg.train
        registry.add(critic_spec(
            self.model_path, placement(cfg.roles.reward), optim_spec(t, cfg.max_steps, betas=RLHF_BETAS),
            micro_batch_size=t.micro_batch_size * 2,  # chosen and rejected rows of each pair in one batch
            grad_accum=t.grad_accum, lora=lora_spec(cfg.lora), gradient_checkpointing=t.gradient_checkpointing,
            seed=cfg.seed, name="reward"))
        registry.build()

        # 2. pairs to train on and held-out pairs (evaluation rows, never trained on)
        data = load_data(self, "reward", default_source=assets.get("data", ""))
        collate = PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches = registry.add_state("batches", ShardedBatches(
            data.train, collate, t.micro_batch_size, registry.world_size, registry.rank, seed=cfg.seed))
        self.heldout = [] if data.eval is None else shard_batches(
            data.eval, collate, t.micro_batch_size, registry.world_size, registry.rank, limit=cfg.data.heldout_size)

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
        return pair_accuracy(self.registry, "reward", self.heldout) if self.heldout else {}

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        return {"reward": save_role(self.registry, "reward", self.path("export", "reward"), tokenizer=self.tokenizer)}

    def summary_metrics(self) -> dict[str, Any]:
        before, after = self.evaluation("before") or {}, self.evaluation("after") or {}
        last = self.step_metrics[-1] if self.step_metrics else {}
        return {
            "first_loss": self.step_metrics[0]["loss"] if self.step_metrics else None,
            "final_loss": last.get("loss"),
            "final_train_accuracy": last.get("accuracy"),
            "heldout_accuracy_before": before.get("accuracy"),
            "heldout_accuracy": after.get("accuracy"),
            "heldout_margin": after.get("margin"),
            "heldout_pairs": after.get("pairs"),
        }

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


main = RLHFReward.main

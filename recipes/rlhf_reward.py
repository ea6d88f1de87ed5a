"""RLHF step 2: reward model (LM body + scalar head) trained on preference pairs (docs/rlhf.md).

    multiengine run rlhf_reward --config tiny --nproc-per-node 2
    multiengine run rlhf_reward --config opt350m --nproc-per-node 8

One trainable role (``reward``). Loss: Bradley-Terry ``-log sigmoid(s_chosen - s_rejected)`` on the score at the
last real token (the EOS). Reports held-out pair accuracy on evaluation rows never trained on; exports
export/reward (a ``*ForSequenceClassification`` folder + tokenizer: step 3's reward model and critic).
"""

from __future__ import annotations

import statistics
from typing import Any

from multiengine.engines import mean_over_ranks
from multiengine.engines.recipe_config import Key, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys
from multiengine.pipelines.rlhf.data import PairCollator
from multiengine.pipelines.rlhf.evaluation import pair_accuracy
from multiengine.pipelines.rlhf.roles import critic_spec
from multiengine.pipelines.rlhf.steps import reward_loss
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, RLHF_TRAINABLE, TINY_KEYS

# InstructGPT starts the reward model from the SFT model, DeepSpeed-Chat from a separate pretrained model
# (OPT-350m): any causal-LM folder, a previous reward export or a TRL reward model works.
ROLES = (
    Role("reward", "the reward model being trained: LM body + scalar head (LoRA adapts the body, the head "
                   "trains fully)", trainable=True,
         keys={**RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-3, "scheduler": "cosine", "warmup_steps": 20,
               "model": Key("", "a causal-LM folder, SFT or reward export, *ForSequenceClassification folder or hub "
                                "name; \"\" = the random tiny OPT (tiny.*)"),
               "micro_batch_size": Key(32, "pairs per rank per forward/backward (2 rows each)")}),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/rlhf_reward", "everything the run writes goes under this folder"),
    "max_steps": Key(1000, "optimizer steps"),
    "roles": role_keys(ROLES),
    "tiny": TINY_KEYS,
    "data": Key({
        **DATA_KEYS,
        "max_prompt_len": common.PROMPT_LEN,
        "max_response_len": Key(16, "answer tokens kept, EOS included"),
        "heldout_size": Key(512, "evaluation pairs scored for the held-out accuracy (0 = all of them)"),
    }, "preference pairs: prompt + chosen + rejected, or chosen + rejected (docs/data.md)"),
    "eval": Key({
        "every": Key(250, "also evaluate every N steps (0 = only before and after)"),
    }, "held-out pair accuracy"),
    "export": common.export_keys("reward", ": a *ForSequenceClassification folder with the tokenizer"),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("reward", extra=common.TINY_RENAMED)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Model folder, tokenizer vs vocabulary, preference data (formats, columns, rows, chat template, held-out
    pairs), and a micro batch of training pairs per rank on ``world_size`` ranks."""
    tok = common.check_role(cfg, "reward")
    check_batches(cfg, common.check_data(cfg, "reward", tok, tokenizer_key="roles.reward.tokenizer"), world_size)


def check_batches(cfg: Any, report: dict[str, Any] | None, world_size: int, setting: str = "{key}={n}") -> None:
    """One stream of micro batches of pairs per rank (grad_accum draws it again, across epochs)."""
    common.check_stage_batches(report, world_size, key="roles.reward.micro_batch_size",
                               value=cfg.roles.reward.micro_batch_size, unit="pairs", setting=setting)


class RLHFReward(Recipe):
    name = "rlhf_reward"
    headline = (("accuracy", "held-out pair accuracy", True),)
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("pairwise loss", ["train/loss"]), ("pair accuracy", ["train/accuracy", "eval/accuracy"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the model (LM body + scalar head) and its tokenizer
        reward = cfg.roles.reward
        assets = common.tiny_assets(self, reward.model)
        self.model_path, self.tokenizer = common.role_folder(self, "reward", assets)
        registry.add(critic_spec(
            self.model_path, placement(cfg, ROLES, "reward"), optim_spec(cfg, "reward", cfg.max_steps),
            micro_batch_size=reward.micro_batch_size * 2,  # chosen and rejected rows of each pair in one batch
            grad_accum=reward.grad_accum, lora=lora_spec(cfg, "reward"),
            gradient_checkpointing=reward.gradient_checkpointing, seed=cfg.seed, name="reward"))
        registry.build()

        # 2. pairs to train on and held-out pairs (evaluation rows, never trained on)
        data = common.load_data(self, "reward", assets)
        collate = PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = common.training_batches(self, data, collate, reward.micro_batch_size)

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
        return common.export_role(self, self.tokenizer, role="reward")

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
plan = plans.rlhf_reward  # what `multiengine plan` sees of this recipe

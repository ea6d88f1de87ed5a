"""RLHF step 2: reward model (LM body + scalar head) trained on preference pairs (docs/rlhf.md).

    multiengine run rlhf_reward --config tiny --nproc-per-node 2
    multiengine run rlhf_reward --config opt350m --nproc-per-node 8

One trainable role (``reward``). Loss: Bradley-Terry ``-log sigmoid(s_chosen - s_rejected)`` on the score at the
last real token (the EOS). Reports held-out pair accuracy on evaluation rows never trained on; exports
export/reward (a ``*ForSequenceClassification`` folder + tokenizer: step 3's reward model and critic).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from multiengine.engines import mean_over_ranks
from multiengine.engines import planner as P
from multiengine.engines.settings import Range, Settings, section, setting
from multiengine.pipelines.rlhf.data import PairCollator, ResponseData, load_stage, training_batches
from multiengine.pipelines.rlhf.evaluation import pair_accuracy
from multiengine.pipelines.rlhf.roles import add_lm_role, export_role, role_folder, tiny_assets
from multiengine.pipelines.rlhf.steps import reward_loss
from multiengine.pipelines.rlhf.tiny import TinySettings
from multiengine.recipes import common
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class PairEval(Settings):
    every: int = setting(250, "also evaluate every N steps (0 = only before and after)", Range(0))


@dataclass(frozen=True)
class RewardConfig(RunConfig):
    output_dir: str = setting("outputs/rlhf_reward", "everything the run writes goes under this folder")
    max_steps: int = setting(1000, "optimizer steps", Range(1))
    tiny: TinySettings = section(TinySettings, "the random tiny OPT built under output_dir/tiny for roles whose model "
                                               "is \"\" (mechanics only)")
    data: ResponseData = section(ResponseData, "preference pairs: prompt + chosen + rejected, or chosen + rejected "
                                               "(docs/data.md)", heldout_size=512)
    eval: PairEval = section(PairEval, "held-out pair accuracy")
    export: common.ExportSettings = section(common.ExportSettings, "export/reward: a *ForSequenceClassification "
                                                                   "folder with the tokenizer")


class RLHFReward(Recipe):
    name = "rlhf_reward"
    # InstructGPT starts the reward model from the SFT model, DeepSpeed-Chat from a separate pretrained model
    # (OPT-350m): any causal-LM folder, a previous reward export or a TRL reward model works.
    roles = (Role("reward", "the reward model being trained: LM body + scalar head (LoRA adapts the body, the head "
                            "trains fully)", trainable=True, sequences=True,
                  omit=("token_budget",), why=common.TOKEN_BUDGET_WHY,
                  defaults={**common.RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-3, "scheduler": "cosine",
                            "warmup_steps": 20,
                            "model": Key("", "a causal-LM folder, SFT or reward export, *ForSequenceClassification "
                                             "folder or hub name; \"\" = the random tiny OPT (tiny.*)"),
                            "micro_batch_size": Key(32, "pairs per rank per forward/backward (2 rows each)")}),)
    Config = RewardConfig
    renamed = common.old_keys("reward")
    headline = (("accuracy", "held-out pair accuracy", True),)
    postfix_keys = ("loss", "accuracy")
    plot_panels = [("pairwise loss", ["train/loss"]), ("pair accuracy", ["train/accuracy", "eval/accuracy"])]

    @classmethod
    def validate(cls, cfg: RewardConfig, world_size: int = 1) -> None:
        """Model folder, tokenizer vs vocabulary, preference data (formats, columns, rows, chat template, held-out
        pairs), and a micro batch of training pairs per rank on ``world_size`` ranks."""
        tok = common.check_role(cfg, "reward")
        if cfg.export.enabled:
            common.check_scalar_export("roles.reward.model", cfg.roles.reward.model_path(), "the reward model",
                                       "export.enabled=false")
        cls.check_batches(cfg, common.check_data(cfg, "reward", tok, tokenizer_key="roles.reward.tokenizer"),
                          world_size)

    @classmethod
    def check_batches(cls, cfg: RewardConfig, report: dict[str, Any] | None, world_size: int,
                      setting: str = "{key}={n}") -> None:
        """One stream of micro batches of pairs per rank (grad_accum draws it again, across epochs)."""
        common.check_stage_batches(report, world_size, key="roles.reward.micro_batch_size",
                                   value=cfg.roles.reward.micro_batch_size, unit="pairs", setting=setting)

    @classmethod
    def plan(cls, cfg: RewardConfig, assume: Any = None) -> list[plans.RecipePlan]:
        r = cfg.roles.reward
        info = plans.scalar_info(common.lm_info(cfg, r.model, "reward", assume))
        seq, rows = cfg.data.max_prompt_len + cfg.data.max_response_len, 2 * r.micro_batch_size
        phases = plans.lm_role_phases(r, info, train=(rows, seq), logits=False)
        return [plans.declared_roles(cfg, {"reward": info}, {"reward": phases}, title="rlhf_reward",
                                     notes=[f"pairs of {seq}-token sequences, micro batch {r.micro_batch_size} pairs "
                                            f"({rows} rows)"],
                                     reward={"extra_trainable": P.transformer_dims(info.config).hidden})]

    def build(self) -> None:
        cfg, registry, reward = self.cfg, self.registry, self.cfg.roles.reward
        # 1. the model (LM body + scalar head) and its tokenizer
        assets = tiny_assets(registry, self.path("tiny"), cfg, reward.model)
        self.model_path, self.tokenizer = role_folder(reward, assets)
        add_lm_role(registry, reward, self.model_path, cfg.seed, scalar=True, total_steps=cfg.max_steps,
                    rows=2)  # chosen and rejected rows of each pair in one batch
        registry.build()
        # 2. pairs to train on and held-out pairs (evaluation rows, never trained on)
        data = load_stage(registry, cfg.data, cfg.seed, "reward", assets)
        collate = PairCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = training_batches(registry, cfg.data, cfg.seed, data, collate,
                                                      reward.micro_batch_size)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        engine = registry["reward"]
        losses, accs = [], []
        for _ in range(engine.gradient_accumulation_steps()):
            # next micro batch (chosen rows then rejected rows, right padded); scores at the last real token;
            # pairwise loss; backward; the optimizer steps at the accumulation boundary
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            loss, acc = reward_loss(engine, batch)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            accs.append(acc.item())
        return mean_over_ranks({"loss": statistics.fmean(losses), "accuracy": statistics.fmean(accs),
                                "lr": engine.get_lr()[0]})

    def evaluate(self, tag: str) -> dict[str, Any]:
        return pair_accuracy(self.registry, "reward", self.heldout) if self.heldout else {}

    def export(self) -> dict[str, Any]:
        return export_role(self.registry, self.cfg.export, self.path("export"), self.tokenizer, "reward")

    def summary_metrics(self) -> dict[str, Any]:
        before, after = self.evaluation("before") or {}, self.evaluation("after") or {}
        last = self.step_metrics[-1] if self.step_metrics else {}
        return {"first_loss": self.step_metrics[0]["loss"] if self.step_metrics else None,
                "final_loss": last.get("loss"), "final_train_accuracy": last.get("accuracy"),
                "heldout_accuracy_before": before.get("accuracy"), "heldout_accuracy": after.get("accuracy"),
                "heldout_margin": after.get("margin"), "heldout_pairs": after.get("pairs")}

    def summary_extra(self) -> dict[str, Any]:
        return {"model_path": self.model_path}


RECIPE = RLHFReward

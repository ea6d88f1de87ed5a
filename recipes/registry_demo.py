"""Registry demo: three roles at three ZeRO stages in one process group, trained for a few steps.

An actor (trainable, ZeRO-3), a reward model (frozen, asked for ZeRO-2, built at stage 0) and an
encoder (frozen, stage 0), each its own DeepSpeed engine, each loaded with from_pretrained from a
tiny model this recipe saves on first run. Prints the per-role memory table.

    multiengine run registry_demo --config tiny --nproc-per-node 2
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch
from multiengine.engines import (
    OptimSpec,
    Placement,
    barrier,
    frozen_role,
    mean_over_ranks,
    save_role,
    trainable_role,
)
from multiengine.recipes.lifecycle import Recipe, with_common

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/registry_demo",
    "max_steps": 10,
    "dtype": "fp32",
    "lr": 1e-3,
    "micro_batch_size": 4,
    "grad_accum": 1,
    "seq_len": 32,
    "model": {"hidden_size": 64, "layers": 2, "vocab_size": 512},
    "roles": {
        "actor": {"stage": 3, "offload_params": False},
        "reward": {"stage": 2},
        "encoder": {"stage": 0},
    },
})


def _save_tiny_lm(path: str, hidden: int, layers: int, vocab: int, seed: int) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden,
                       num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=hidden,
                       dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    OPTForCausalLM(config).save_pretrained(path)


class RegistryDemo(Recipe):
    name = "registry_demo"
    plot_panels = [("actor loss", ["train/loss"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        model_dir = self.path("tiny_lm")
        if registry.is_main and not os.path.isfile(os.path.join(model_dir, "config.json")):
            _save_tiny_lm(model_dir, cfg.model.hidden_size, cfg.model.layers, cfg.model.vocab_size, cfg.seed)
        barrier()
        from transformers import AutoModel, AutoModelForCausalLM

        roles = cfg.roles
        registry.add(trainable_role(
            "actor", lambda: AutoModelForCausalLM.from_pretrained(model_dir),
            Placement(stage=roles.actor.stage, dtype=cfg.dtype, offload_params=roles.actor.offload_params),
            OptimSpec(lr=cfg.lr, total_steps=cfg.max_steps), micro_batch_size=cfg.micro_batch_size,
            grad_accum=cfg.grad_accum))
        registry.add(frozen_role("reward", lambda: AutoModelForCausalLM.from_pretrained(model_dir),
                                 Placement(stage=roles.reward.stage, dtype=cfg.dtype)))
        registry.add(frozen_role("encoder", lambda: AutoModel.from_pretrained(model_dir),
                                 Placement(stage=roles.encoder.stage, dtype=cfg.dtype)))
        registry.build()
        self.micro = 0

    def batch(self) -> torch.Tensor:
        """A learnable synthetic sequence: each token is the previous one plus a per-row stride."""
        g = self.registry.generator(self.micro, "tokens")
        self.micro += 1
        vocab, n, t = self.cfg.model.vocab_size, self.cfg.micro_batch_size, self.cfg.seq_len
        start = torch.randint(3, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        return 3 + (start + stride * torch.arange(t)) % (vocab - 3)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        actor = registry["actor"]
        losses, rewards, hidden = [], [], []
        for _ in range(actor.gradient_accumulation_steps()):
            ids = self.batch().to(registry.device)
            # 1. frozen roles: forward only (no graph is built)
            rewards.append(registry["reward"](input_ids=ids).logits[:, -1].mean().item())
            hidden.append(registry["encoder"](input_ids=ids).last_hidden_state.mean().item())
            # 2. trainable role: loss, backward, step (the engine steps at its accumulation boundary)
            loss = actor(input_ids=ids, labels=ids).loss
            actor.backward(loss)
            actor.step()
            losses.append(loss.item())
        # 3. means over micro batches and ranks
        return mean_over_ranks({"loss": statistics.fmean(losses), "reward_logit": statistics.fmean(rewards),
                                "encoder_mean": statistics.fmean(hidden)})

    def state_dict(self) -> dict[str, Any]:
        return {"micro": self.micro}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro = int(state.get("micro", 0))

    def export(self) -> dict[str, Any]:
        return {"actor": save_role(self.registry, "actor", self.path("export", "actor"))["model"]}

    def summary_metrics(self) -> dict[str, Any]:
        losses = [m["loss"] for m in self.step_metrics]
        return {"first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
                "memory_table": str(self.registry.memory_report())}


main = RegistryDemo.main

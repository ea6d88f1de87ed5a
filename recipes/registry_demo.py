"""Registry demo: three roles at three ZeRO stages in one process group, trained for a few steps.

An actor (trainable, ZeRO-3), a reward model (frozen, asked for ZeRO-2, built at stage 0) and an
encoder (frozen, stage 0), each its own DeepSpeed engine, each loaded with from_pretrained from a
tiny model this recipe saves on first run. Prints the per-role memory table.

    multiengine run registry_demo --config tiny --nproc-per-node 2
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import torch
from multiengine.engines import (
    barrier,
    frozen_role,
    mean_over_ranks,
    save_role,
    trainable_role,
    trust_remote_code,
)
from multiengine.engines.recipe_config import Key, Range, Satisfies, config_problem, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, optim_spec, placement, role_keys
from multiengine.recipes import plans

_TINY = "model \"\" = the tiny OPT saved under output_dir/tiny_lm on first run (the only model: not settable)"
ROLES = (
    Role("actor", f"trainable, ZeRO-3; {_TINY}", trainable=True,
         keys={"dtype": "fp32", "lr": 1e-3, "micro_batch_size": 4}),
    Role("reward", f"frozen, asks for ZeRO-2 (built at stage 0: nothing to shard); {_TINY}", follows="actor",
         keys={"stage": 2}),
    Role("encoder", f"frozen, stage 0 (the OPT without its head); {_TINY}", follows="actor", keys={"stage": 0}),
)
_MAX_POSITIONS = 128  # of the tiny OPT
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/registry_demo", "everything the run writes goes under this folder"),
    "max_steps": Key(10, "optimizer steps of the actor"),
    "seq_len": Key(32, "tokens per synthetic sequence", Range(2, _MAX_POSITIONS)),
    "roles": role_keys(ROLES),
    "model": Key({
        "hidden_size": Key(64, "a multiple of its 4 attention heads",
                           [Range(4), Satisfies(lambda h: h % 4 == 0, "a multiple of 4 (the attention heads)")]),
        "layers": Key(2, "decoder layers"),
        "vocab_size": Key(512, "vocabulary size", Range(8)),
    }, "the tiny OPT saved under output_dir/tiny_lm on first run (every role loads it)"),
}
DEFAULTS, HELP = split_keys(KEYS)
CHECKS = {f"roles.*.{k}": Satisfies(lambda v: not v, "\"\": every role loads the tiny OPT under output_dir")
          for k in ("model", "tokenizer")}
RENAMED = {"lr": "roles.actor.lr", "max_grad_norm": "roles.actor.max_grad_norm",
           "micro_batch_size": "roles.actor.micro_batch_size", "grad_accum": "roles.actor.grad_accum",
           "dtype": "roles.actor.dtype (the frozen roles follow it)"}


def validate(cfg: Any) -> None:
    """The tiny model saved by an earlier run in this output_dir must be the one the config asks for: it is
    reused as it is, so a changed model.* would otherwise be ignored without a word."""
    path = os.path.join(str(cfg.output_dir), "tiny_lm", "config.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    for key, field in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers"), ("vocab_size", "vocab_size")):
        if saved.get(field) != cfg.model[key]:
            raise config_problem(f"model.{key}", cfg.model[key], f"differs from the tiny model an earlier run saved in "
                                 f"{os.path.dirname(path)} ({field}={saved.get(field)})",
                                 f"use a new output_dir, delete {os.path.dirname(path)}, or set "
                                 f"model.{key}={saved.get(field)}")


def tiny_opt_config(hidden: int, layers: int, vocab: int) -> Any:
    """The demo's tiny OPT (model.*), which every role loads (the planner builds it on the meta device)."""
    from transformers import OPTConfig

    return OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden,
                     num_attention_heads=4, max_position_embeddings=_MAX_POSITIONS, word_embed_proj_dim=hidden,
                     dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _save_tiny_lm(path: str, hidden: int, layers: int, vocab: int, seed: int) -> None:
    from transformers import OPTForCausalLM

    torch.manual_seed(seed)
    OPTForCausalLM(tiny_opt_config(hidden, layers, vocab)).save_pretrained(path)


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

        remote = {"trust_remote_code": trust_remote_code()}
        actor = cfg.roles.actor
        registry.add(trainable_role(
            "actor", lambda: AutoModelForCausalLM.from_pretrained(model_dir, **remote), placement(cfg, ROLES, "actor"),
            optim_spec(cfg, "actor", cfg.max_steps), micro_batch_size=actor.micro_batch_size,
            grad_accum=actor.grad_accum, gradient_checkpointing=actor.gradient_checkpointing))
        registry.add(frozen_role("reward", lambda: AutoModelForCausalLM.from_pretrained(model_dir, **remote),
                                 placement(cfg, ROLES, "reward")))
        registry.add(frozen_role("encoder", lambda: AutoModel.from_pretrained(model_dir, **remote),
                                 placement(cfg, ROLES, "encoder")))
        registry.build()
        self.micro = 0

    def batch(self) -> torch.Tensor:
        """A learnable synthetic sequence: each token is the previous one plus a per-row stride."""
        g = self.registry.generator(self.micro, "tokens")
        self.micro += 1
        vocab, n, t = self.cfg.model.vocab_size, self.cfg.roles.actor.micro_batch_size, self.cfg.seq_len
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
plan = plans.registry_demo  # what `multiengine plan` sees of this recipe

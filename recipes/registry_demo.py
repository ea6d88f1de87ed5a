"""Registry demo: an actor (trainable, ZeRO-3), a reward model (frozen, asked for ZeRO-2, built at stage 0) and an
encoder (frozen, stage 0), each its own DeepSpeed engine on a tiny saved model, trained for a few steps.

    multiengine run registry_demo --config tiny --nproc-per-node 2"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import barrier, mean_over_ranks, save_role, trust_remote_code
from multiengine.engines import planner as P
from multiengine.engines.settings import Range, Satisfies, Settings, section, setting
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import config_problem
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role

_MAX_POSITIONS = 128  # of the tiny OPT
_OWN_MODEL = ("model", "tokenizer")
_WHY = "every role loads the tiny OPT this recipe saves under output_dir/tiny_lm (its shape: model.*)"


@dataclass(frozen=True)
class TinyOPT(Settings):
    hidden_size: int = setting(64, "a multiple of its 4 attention heads",
                               [Range(4), Satisfies(lambda h: h % 4 == 0, "a multiple of 4 (the attention heads)")])
    layers: int = setting(2, "decoder layers", Range(1))
    vocab_size: int = setting(512, "vocabulary size", Range(8))


@dataclass(frozen=True)
class RegistryDemoConfig(RunConfig):
    output_dir: str = setting("outputs/registry_demo", "everything the run writes goes under this folder")
    max_steps: int = setting(10, "optimizer steps of the actor", Range(1))
    seq_len: int = setting(32, "tokens per synthetic sequence", Range(2, _MAX_POSITIONS))
    model: TinyOPT = section(TinyOPT, "the tiny OPT saved under output_dir/tiny_lm on first run (every role loads it)")


def tiny_opt_config(m: TinyOPT) -> Any:
    """The demo's tiny OPT (model.*), which every role loads (the planner builds it on the meta device)."""
    from transformers import OPTConfig

    return OPTConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.layers,
                     ffn_dim=4 * m.hidden_size, num_attention_heads=4, max_position_embeddings=_MAX_POSITIONS,
                     word_embed_proj_dim=m.hidden_size, dropout=0.0, attention_dropout=0.0, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)


class RegistryDemo(Recipe):
    name = "registry_demo"
    roles = (Role("actor", "trainable, ZeRO-3", trainable=True, omit=_OWN_MODEL, why=_WHY,
                  defaults={"dtype": "fp32", "lr": 1e-3, "micro_batch_size": 4}),
             Role("reward", "frozen, asks for ZeRO-2 (built at stage 0: nothing to shard)", follows="actor",
                  omit=_OWN_MODEL, why=_WHY, defaults={"stage": 2}),
             Role("encoder", "frozen, stage 0 (the OPT without its head)", follows="actor", omit=_OWN_MODEL,
                  why=_WHY, defaults={"stage": 0}))
    Config = RegistryDemoConfig
    renamed = {"lr": "roles.actor.lr", "max_grad_norm": "roles.actor.max_grad_norm",
               "micro_batch_size": "roles.actor.micro_batch_size", "grad_accum": "roles.actor.grad_accum",
               "dtype": "roles.actor.dtype (the frozen roles follow it)"}
    plot_panels = [("actor loss", ["train/loss"])]

    @classmethod
    def validate(cls, cfg: RegistryDemoConfig, world_size: int = 1) -> None:
        """A tiny model an earlier run saved in this output_dir is reused as it is: it must be the one model.* asks
        for, or a changed model.* would be ignored without a word."""
        path = os.path.join(str(cfg.output_dir), "tiny_lm", "config.json")
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        for key, field in (("hidden_size", "hidden_size"), ("layers", "num_hidden_layers"),
                           ("vocab_size", "vocab_size")):
            value = getattr(cfg.model, key)
            if saved.get(field) != value:
                raise config_problem(f"model.{key}", value, f"differs from the tiny model an earlier run saved in "
                                     f"{os.path.dirname(path)} ({field}={saved.get(field)})",
                                     f"use a new output_dir, delete {os.path.dirname(path)}, or set "
                                     f"model.{key}={saved.get(field)}")

    @classmethod
    def plan(cls, cfg: RegistryDemoConfig, assume: Any = None) -> list[plans.RecipePlan]:
        folder = os.path.join(str(cfg.output_dir), "tiny_lm")
        if (assume and "actor" in assume) or os.path.isfile(os.path.join(folder, "config.json")):
            info = plans.resolve_model(folder, "actor", assume=assume)
        else:  # the recipe's own tiny OPT, on the meta device
            from transformers import OPTForCausalLM

            m, config = cfg.model, tiny_opt_config(cfg.model)
            with torch.device("meta"):
                tensors = plans.module_info("", OPTForCausalLM(config)).tensors
            info = P.ModelInfo(f"registry_demo's tiny OPT (hidden {m.hidden_size}, {m.layers} layers, vocab "
                               f"{m.vocab_size})", tensors, config=config.to_dict(), class_name="OPTForCausalLM")
        roles, rows = cfg.roles, (cfg.roles.actor.micro_batch_size, cfg.seq_len)
        phases = {"actor": plans.lm_role_phases(roles.actor, info, train=rows),
                  "reward": plans.lm_role_phases(roles.reward, info, forward=rows),
                  "encoder": plans.lm_role_phases(roles.encoder, info, forward=rows, logits=False)}
        # the demo's roles are planned without optimizer offload, and its frozen roles without parameter offload
        return [plans.declared_roles(cfg, {"actor": info, "reward": info, "encoder": info.without("lm_head.")},
                                     phases, title="registry_demo", actor={"choices": P.trainable_choices(False)},
                                     reward={"choices": P.frozen_choices(False)},
                                     encoder={"choices": P.frozen_choices(False)})]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        model_dir = self.path("tiny_lm")
        if registry.is_main and not os.path.isfile(os.path.join(model_dir, "config.json")):
            from transformers import OPTForCausalLM

            torch.manual_seed(cfg.seed)
            OPTForCausalLM(tiny_opt_config(cfg.model)).save_pretrained(model_dir)
        barrier()
        from transformers import AutoModel, AutoModelForCausalLM

        def load(cls: Any) -> Any:
            return lambda: cls.from_pretrained(model_dir, trust_remote_code=trust_remote_code())

        roles = cfg.roles
        registry.add(roles.actor.spec(load(AutoModelForCausalLM), seed=cfg.seed, total_steps=cfg.max_steps))
        registry.add(roles.reward.spec(load(AutoModelForCausalLM), seed=cfg.seed))
        registry.add(roles.encoder.spec(load(AutoModel), seed=cfg.seed))
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


RECIPE = RegistryDemo

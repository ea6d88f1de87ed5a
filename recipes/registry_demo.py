"""Registry demo: three roles at three ZeRO stages in one process group, trained for a few steps.

An actor (trainable, ZeRO-3), a reward model (frozen, asked for ZeRO-2, built at stage 0) and an
encoder (frozen, stage 0), each its own DeepSpeed engine, each loaded with from_pretrained from a
tiny model this recipe saves on first run. Prints the per-role memory table.

    multiengine run registry_demo --config tiny --nproc-per-node 2
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, peak_rss_bytes, train_ds_config
from multiengine.engines.dist import barrier
from multiengine.engines.metrics import MetricsLogger, write_summary
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "output_dir": "outputs/registry_demo",
    "seed": 0,
    "max_steps": 10,
    "backend": "auto",
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
}


def _save_tiny_lm(path: str, hidden: int, layers: int, vocab: int, seed: int) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    config = OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, ffn_dim=4 * hidden,
                       num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=hidden,
                       dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    OPTForCausalLM(config).save_pretrained(path)


class RegistryDemo:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.registry: EngineRegistry | None = None

    def setup(self) -> None:
        cfg = self.cfg
        self.registry = registry = EngineRegistry(backend=cfg.backend)
        model_dir = os.path.join(cfg.output_dir, "tiny_lm")
        if registry.is_main and not os.path.isfile(os.path.join(model_dir, "config.json")):
            _save_tiny_lm(model_dir, cfg.model.hidden_size, cfg.model.layers, cfg.model.vocab_size, cfg.seed)
        barrier()
        from transformers import AutoModel, AutoModelForCausalLM

        roles = cfg.roles
        registry.add(RoleSpec(
            "actor", lambda: AutoModelForCausalLM.from_pretrained(model_dir),
            train_ds_config(stage=roles.actor.stage, dtype=cfg.dtype, micro_batch_size=cfg.micro_batch_size,
                            grad_accum=cfg.grad_accum, offload_params=roles.actor.offload_params),
            optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr),
        ))
        registry.add(RoleSpec("reward", lambda: AutoModelForCausalLM.from_pretrained(model_dir),
                              eval_ds_config(stage=roles.reward.stage, dtype=cfg.dtype)))
        registry.add(RoleSpec("encoder", lambda: AutoModel.from_pretrained(model_dir),
                              eval_ds_config(stage=roles.encoder.stage, dtype=cfg.dtype)))
        registry.build()
        self.metrics = MetricsLogger(os.path.join(cfg.output_dir, "metrics.jsonl"), enabled=registry.is_main)

    def batch(self, step: int) -> torch.Tensor:
        """A learnable synthetic sequence: each token is the previous one plus a per-row stride."""
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + step * 101 + self.registry.rank)
        vocab, n, t = self.cfg.model.vocab_size, self.cfg.micro_batch_size, self.cfg.seq_len
        start = torch.randint(3, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        return 3 + (start + stride * torch.arange(t)) % (vocab - 3)

    def train(self) -> dict[str, float]:
        registry, cfg = self.registry, self.cfg
        actor = registry["actor"]
        first = last = float("nan")
        steps = cfg.max_steps * actor.gradient_accumulation_steps()
        for micro in tqdm(range(steps), desc="registry_demo", disable=not registry.is_main):
            t0 = time.perf_counter()
            ids = self.batch(micro).to(registry.device)
            # 1. frozen roles: forward only (no graph is built)
            reward = registry["reward"](input_ids=ids).logits[:, -1].mean()
            hidden = registry["encoder"](input_ids=ids).last_hidden_state.mean()
            # 2. trainable role: loss, backward, step (the engine steps at its accumulation boundary)
            loss = actor(input_ids=ids, labels=ids).loss
            actor.backward(loss)
            actor.step()
            first = loss.item() if micro == 0 else first
            last = loss.item()
            self.metrics.log(micro, {"loss": last, "reward_logit": reward.item(), "encoder_mean": hidden.item(),
                                     "step_time_s": time.perf_counter() - t0}, prefix="actor")
        return {"first_loss": first, "final_loss": last}

    def save_checkpoint(self) -> None:
        self.registry.save_checkpoint(os.path.join(self.cfg.output_dir, "checkpoints"),
                                      client_state={"step": self.cfg.max_steps}, keep_last=1)

    def cleanup(self) -> None:
        self.metrics.close()


def main(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    torch.manual_seed(cfg.seed)
    demo = RegistryDemo(cfg)
    demo.setup()
    registry = demo.registry
    metrics = demo.train()
    demo.save_checkpoint()
    export = registry.export(os.path.join(cfg.output_dir, "export"), roles=["actor"])
    report = registry.memory_report()
    if registry.is_main:
        logger.info("per-role memory on rank 0 (world size %d):\n%s", registry.world_size, report)
    summary = {
        "recipe": "registry_demo",
        "world_size": registry.world_size,
        "metrics": metrics,
        "memory": {"rank0_roles": list(report), "peak_rss_bytes": peak_rss_bytes()},
        "roles": registry.describe(),
        "export": export,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if registry.is_main:
        write_summary(os.path.join(cfg.output_dir, "summary.json"), summary)
    demo.cleanup()
    return {"metrics": metrics, "memory_table": str(report)}

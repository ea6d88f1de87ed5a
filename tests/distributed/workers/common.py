"""Helpers shared by the distributed test workers (run under torch.distributed.run)."""

from __future__ import annotations

import json
import os
import sys

import torch


def out_dir() -> str:
    return sys.argv[1]


def finish() -> None:
    """End a worker: leave the process group together (a rank that exits while its peer is mid-collective
    aborts it), then exit without the interpreter's teardown, which with gloo and DeepSpeed loaded aborted
    a finished rank in C++ about once in 40 runs ("terminate called without an active exception")."""
    from multiengine.engines.dist import shutdown

    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def link_into(folder: str, links: dict[str, str]) -> None:
    """A run folder holding ``links`` (name -> an earlier run's folder, e.g. its tiny data or pipeline): rank 0
    creates it (``exist_ok``: the other rank's config check creates output_dir too), then a barrier, so no rank
    reads its config before the links exist."""
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        for name, target in links.items():
            os.symlink(target, os.path.join(folder, name))
    torch.distributed.barrier()


def dump(result: dict) -> None:
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(out_dir(), f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


class MLP(torch.nn.Module):
    """Wide enough that its weights are above the ZeRO-3 persistence threshold (10 x width)."""

    def __init__(self, width: int = 64, depth: int = 3, dropout: float = 0.0) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Dropout(dropout)]
        layers.append(torch.nn.Linear(width, 1))
        self.net = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def seeded(factory, seed: int = 0):
    """A model factory that builds the same initial weights on every call and every rank."""

    def build():
        torch.manual_seed(seed)
        return factory()

    return build


def full_params(registry, name: str) -> list[torch.Tensor]:
    """Full copies of a role's parameters (gathered on every rank under ZeRO-3)."""
    with registry.gathered(name):
        return [p.detach().float().clone() for p in registry[name].module.parameters()]


def gathered_state_dict(registry, role: str) -> dict[str, torch.Tensor] | None:
    """Full CPU copies of a role's weights on rank 0 (None elsewhere); collective under ZeRO-3."""
    state = None
    with registry.gathered(role):
        if registry.is_main:
            state = {k: v.detach().to("cpu").clone() for k, v in registry.role(role).module.state_dict().items()}
    return state


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def batch(step: int, rank: int, n: int = 4, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, width, generator=g)
    return x, x[:, :4].sum(-1)


def save_tiny_models(root: str) -> dict[str, str]:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, OPTConfig, OPTForCausalLM

    paths = {k: os.path.join(root, k) for k in ("opt", "clip", "unet")}
    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                             max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(paths["opt"])
    CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 vocab_size=100, max_position_embeddings=16, bos_token_id=0, eos_token_id=1,
                                 pad_token_id=1)).save_pretrained(paths["clip"])
    UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                         layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                         attention_head_dim=4, norm_num_groups=8).save_pretrained(paths["unet"])
    return paths

"""Mixture-of-experts actors at ZeRO-3 whose two ranks use different experts, through the registry.

Per family (tiny transformers folders, and "toy": a model that keeps one module per expert and runs only the
experts its tokens reach, so its ZeRO-3 gathers depend on the data unless the registry makes its expert block a
leaf module):
- toy only, the router's own choice: the ranks are fed tokens whose layer-0 routing differs (the toy has no
  attention, so a token's routing depends on its id alone; both ranks find them in the same pass);
- every family, forced: rank 0's tokens go to experts {0, 1} only, rank 1's to {2, 3} (router replay,
  engines.moe.tapped), then backward and step.

argv: out_dir, a JSON file {family: causal-LM folder}.
"""

import json
import re
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from common import dump, finish, full_params
from deepspeed.utils import z3_leaf_module
from multiengine.engines import EngineRegistry, OptimSpec, Placement, moe, trainable_role
from torch import nn
from transformers import AutoModelForCausalLM

VOCAB, HIDDEN, EXPERTS, TOP_K = 64, 32, 4, 2


class ToyRouter(nn.Module):
    """``[N, H]`` -> (logits, renormalised top-k weights, top-k indices), as transformers' ``*TopKRouter``."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.num_experts = TOP_K, EXPERTS
        self.proj = nn.Linear(HIDDEN, EXPERTS, bias=False)

    def forward(self, x: torch.Tensor):
        logits = self.proj(x)
        weights, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), indices


class ToyMoeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = ToyRouter()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.SiLU(),
                                                   nn.Linear(2 * HIDDEN, HIDDEN)) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, indices = self.gate(x)
        out = torch.zeros_like(x)
        for e in indices.unique().tolist():  # only the experts this rank's tokens reach
            rows, slot = (indices == e).nonzero(as_tuple=True)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * weights[rows, slot].unsqueeze(-1))
        return out


class ToyMoeLM(nn.Module):
    """Embedding, 2 residual MoE blocks (no attention), LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(ToyMoeBlock() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_):
        h = self.embed(input_ids).view(-1, HIDDEN)
        for block in self.layers:
            h = h + block(h)
        logits = self.head(h).view(*input_ids.shape, VOCAB)
        loss = None if labels is None else F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


def per_expert(registry) -> list[list[float]]:
    """``[E]`` full copies of each expert's weights, flattened: toy ``experts.<e>.*`` parameters, or the ``[E, ...]``
    slices of a fused experts module's parameters."""
    with registry.gathered("actor"):
        parts = [[] for _ in range(EXPERTS)]
        for name, p in registry["actor"].module.named_parameters():
            own = re.search(r"experts\.(\d+)\.", name)
            if own:
                parts[int(own.group(1))].append(p.detach().flatten().clone())
            elif ".experts." in name and p.shape[0] == EXPERTS:
                for e in range(EXPERTS):
                    parts[e].append(p.detach()[e].flatten().clone())
        return [torch.cat(x) for x in parts]


def step(registry, ids: torch.Tensor, routing: torch.Tensor | None = None) -> dict:
    """Forward (``routing`` imposed where given), backward and step; the experts each layer's routers chose."""
    actor = registry["actor"]
    with moe.tapped(actor, routing) as tap:
        loss = actor(input_ids=ids, labels=ids).loss
        chosen = tap.chosen()
    actor.backward(loss)
    actor.step()
    return {"loss": loss.item(), "experts": [sorted(set(c.flatten().tolist())) for c in chosen],
            "replayed": tap.replayed}


folders = {"toy": None, **json.load(open(sys.argv[2]))}
results = {}
for family, folder in folders.items():
    factory = ToyMoeLM if folder is None else (lambda p=folder: AutoModelForCausalLM.from_pretrained(p))
    registry = EngineRegistry(seed=0)
    registry.add(trainable_role("actor", factory, Placement(stage=3, dtype="fp32"),
                                OptimSpec(name="sgd", lr=0.5, max_grad_norm=0), micro_batch_size=2,
                                hidden_size=HIDDEN if folder is None else None))
    registry.build()
    rank = registry.rank
    module = registry["actor"].module
    r = {"leaves": sorted({type(m).__name__ for m in module.modules() if z3_leaf_module(m)}),
         "routers": len(moe.routers(module))}
    if folder is None:
        # every token alone, the same pass on both ranks: rank 0 gets the tokens of the commonest layer-0 choice,
        # rank 1 those of another choice
        with torch.no_grad(), moe.tapped(registry["actor"]) as tap:
            registry["actor"](input_ids=torch.arange(VOCAB).view(-1, 1))
        choice = [tuple(sorted(c)) for c in tap.chosen()[0].tolist()]
        kinds = sorted(set(choice), key=lambda c: -choice.count(c))
        tokens = [t for t, c in enumerate(choice) if c == kinds[rank]]
        ids = torch.tensor(tokens * 8)[:16].view(2, 8)
        r["own"] = step(registry, ids)
    g = torch.Generator().manual_seed(100 + rank)  # different rows on each rank
    ids = torch.randint(4, 40, (2, 8), generator=g)
    forced = torch.tensor([[0, 1], [2, 3]][rank]).expand(*ids.shape, r["routers"], TOP_K)
    before, experts_before = full_params(registry, "actor"), per_expert(registry)
    r["forced"] = step(registry, ids, forced)
    after, experts_after = full_params(registry, "actor"), per_expert(registry)
    r["changed"] = max((a - b).abs().max().item() for a, b in zip(after, before))
    r["expert_changed"] = [(a - b).abs().max().item() for a, b in zip(experts_after, experts_before)]
    results[family] = r
    del registry
dump(results)
finish()

"""Mixture-of-experts models: their shape, their routers' choices recorded and replayed, the load-balancing loss.

transformers 5.x gives every MoE family it ships (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, DeepSeek-V3) a
router module whose forward maps the ``[N, hidden]`` tokens of a pass to ``(logits [N, E], weights [N, k],
indices [N, k])``; the expert block then runs the chosen experts. :class:`RouterTap` hooks those modules: it keeps
each layer's logits (for :func:`load_balancing_loss`) and chosen indices (router replay records them at rollout
time), and, given indices, makes each router choose those (weights recomputed from its own logits, so the router
still learns) wherever an index is ``>= 0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MoeShape", "RouterTap", "expert_load", "is_moe", "load_balancing_loss", "moe_shape", "routers",
           "set_leaf_modules"]

# config attributes that hold the number of routed experts, per family
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts config's routing: ``experts`` routed experts, ``top_k`` chosen per token, the router's
    auxiliary loss coefficient ``aux_coef`` (its ``router_aux_loss_coef``, 0 where it has none)."""

    experts: int
    top_k: int
    aux_coef: float


def moe_shape(config: Any) -> MoeShape | None:
    """The routing of a transformers config (or a dict of one), or None for a dense model."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config")  # multimodal wrappers keep the decoder's config inside
    if text is not None and not any(get(k) for k in _EXPERT_KEYS):
        return moe_shape(text)
    experts = next((int(get(k)) for k in _EXPERT_KEYS if get(k)), 0)
    top_k = int(get("num_experts_per_tok") or get("moe_topk") or 0)
    if experts <= 1 or top_k <= 0:
        return None
    return MoeShape(experts, top_k, float(get("router_aux_loss_coef") or 0.0))


def is_moe(config: Any) -> bool:
    """Whether a transformers config is a mixture of experts (:func:`moe_shape`)."""
    return moe_shape(config) is not None


def _unwrapped(model: Any) -> torch.nn.Module:
    module = getattr(model, "module", model)  # a DeepSpeed engine
    return module


def routers(model: Any) -> list[torch.nn.Module]:
    """The router modules of a model (through a DeepSpeed engine or peft wrapper), in layer order: the modules with
    ``top_k`` and ``num_experts`` whose class name ends in ``Router`` (transformers 5.x's ``*TopKRouter``)."""
    return [m for m in _unwrapped(model).modules()
            if type(m).__name__.lower().endswith("router") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def set_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Make each expert block that keeps one module per expert (an ``experts`` ``ModuleList``) a ZeRO-3 leaf: its
    parameters are fetched together, so ranks whose tokens reach different experts still make the same gathers.
    Fused expert blocks (one module holding every expert's weights, transformers 5.x) need nothing. Returns the
    class names made leaves."""
    classes = {type(m) for m in model.modules()
               if isinstance(getattr(m, "experts", None), torch.nn.ModuleList) and any(True for _ in routers(m))}
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(classes))
    return sorted(c.__name__ for c in classes)


class RouterTap:
    """Hooks on a model's routers for one or more forward passes.

    ``logits[i]`` / ``indices[i]``: the ``[N, E]`` logits and ``[N, k]`` chosen experts of router ``i`` in the
    last pass (``keep_logits``: logits with their graph, for the loss). ``replay``: ``[layers, N, k]`` indices to
    impose on the next pass (rows of ``-1`` route as the router chooses), set with :meth:`impose`."""

    def __init__(self, model: Any, keep_logits: bool = True) -> None:
        self.routers = routers(model)
        self.keep_logits = keep_logits
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.replay: torch.Tensor | None = None
        self.replayed = 0  # tokens given recorded routing, over the passes since the tap opened
        self._handles: list[Any] = []

    def impose(self, indices: torch.Tensor | None) -> None:
        """Route the next passes' tokens by ``indices`` (``[layers, N, k]``, -1 = the router's own choice)."""
        if indices is not None and indices.shape[0] != len(self.routers):
            raise ValueError(f"recorded routing for {indices.shape[0]} MoE layers, the model has "
                             f"{len(self.routers)}")
        self.replay = indices

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            logits, weights, chosen = out
            if layer == 0:
                self.logits, self.indices = [], []
            if self.replay is not None:
                given = self.replay[layer].to(chosen.device)
                if given.shape != chosen.shape:
                    raise ValueError(f"recorded routing of {tuple(given.shape)} for a pass of {tuple(chosen.shape)}")
                use = given[:, 0] >= 0
                self.replayed += int(use.sum()) if layer == 0 else 0
                chosen = torch.where(use.unsqueeze(1), given, chosen)
                probs = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
                if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises its top k
                    probs = probs / probs.sum(-1, keepdim=True)
                weights = torch.where(use.unsqueeze(1), probs.to(weights.dtype), weights)
            self.logits.append(logits if self.keep_logits else logits.detach())
            self.indices.append(chosen.detach())
            return logits, weights, chosen
        return hook

    def __enter__(self) -> RouterTap:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def chosen(self) -> torch.Tensor:
        """``[layers, N, k]`` experts chosen in the last pass."""
        return torch.stack(self.indices)


@contextlib.contextmanager
def tapped(model: Any, replay: torch.Tensor | None = None, keep_logits: bool = True) -> Iterator[RouterTap | None]:
    """A :class:`RouterTap` on ``model`` for the block (None for a dense model), imposing ``replay`` if given."""
    tap = RouterTap(model, keep_logits)
    if not tap.routers:
        yield None
        return
    tap.impose(replay)
    with tap:
        yield tap


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss over every layer's ``[N, E]`` router logits: ``E * sum_e f_e P_e``
    with ``f_e`` the share of top-k choices that go to expert ``e`` and ``P_e`` its mean router probability, over
    the tokens where ``mask`` (``[N]``, or any shape of N elements) is set (transformers'
    ``load_balancing_loss_func``, which the tests compare it with). 1 at perfect balance for ``top_k=1``."""
    experts = logits[0].shape[-1]
    device = logits[0].device
    w = torch.ones(logits[0].shape[0], device=device) if mask is None else mask.reshape(-1).to(device).float()
    counts = torch.zeros(experts, device=device)
    probs = torch.zeros(experts, device=device)
    for z in logits:
        p = torch.softmax(z.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts = counts + torch.zeros(experts, device=device).scatter_add(0, chosen.reshape(-1),
                                                                          w.repeat_interleave(top_k))
        probs = probs + (p * w.unsqueeze(-1)).sum(0)
    rows = w.sum() * len(logits)
    if float(rows) == 0:
        return logits[0].sum() * 0.0
    return (counts / rows * (probs / rows)).sum() * experts


def expert_load(indices: list[torch.Tensor], experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[layers, E]`` share of each layer's top-k choices that went to each expert, over the tokens in ``mask``
    (each row sums to 1; 1 / E everywhere at perfect balance)."""
    loads = []
    for chosen in indices:
        w = torch.ones(chosen.shape[0]) if mask is None else mask.reshape(-1).float().cpu()
        c = torch.zeros(experts).scatter_add(0, chosen.reshape(-1).cpu(), w.repeat_interleave(chosen.shape[1]))
        loads.append(c / c.sum().clamp(min=1))
    return torch.stack(loads) if loads else torch.zeros(0, experts)

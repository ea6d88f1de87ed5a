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

__all__ = ["MoeShape", "RouterTap", "aux_term", "expert_load", "generated_routing", "load_balancing_loss", "moe_shape",
           "router_logits_off", "routers", "set_leaf_modules", "tap_of", "tapped"]

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


def _unwrapped(model: Any) -> torch.nn.Module:
    return getattr(model, "module", model)  # a DeepSpeed engine's model


def routers(model: Any) -> list[torch.nn.Module]:
    """The router modules of a model (through a DeepSpeed engine or peft wrapper), in layer order: the modules with
    ``top_k`` and ``num_experts`` whose class name ends in ``Router`` (transformers 5.x's ``*TopKRouter``). Found
    once per model and kept on it: the training and scoring passes ask on every forward, dense models included."""
    module = _unwrapped(model)
    found = module.__dict__.get("_moe_routers")
    if found is None:
        found = [m for m in module.modules()
                 if type(m).__name__.lower().endswith("router") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
        module.__dict__["_moe_routers"] = found
    return found


def set_leaf_modules(model: torch.nn.Module) -> list[str]:
    """Make each expert block that keeps one module per expert (an ``experts`` ``ModuleList``) a ZeRO-3 leaf: its
    parameters are fetched together, so ranks whose tokens reach different experts still make the same gathers.
    Fused expert blocks (one module holding every expert's weights, transformers 5.x) need nothing. Returns the
    class names made leaves."""
    classes = {type(m) for m in model.modules()
               if isinstance(getattr(m, "experts", None), torch.nn.ModuleList) and routers(m)}
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, list(classes))
    return sorted(c.__name__ for c in classes)


class RouterTap:
    """Hooks on a model's routers for one or more forward passes.

    ``logits[i]`` / ``indices[i]``: router ``i``'s ``[N, E]`` logits (with their graph) and ``[N, k]`` chosen experts
    in the last pass, ``N`` its tokens. ``routing``: ``[B, L, layers, k]`` experts to impose, in the caller's padded
    layout (``-1``: the router's own choice); a packed pass maps it through :meth:`packed`. ``record``: every pass's
    ``[layers, N, k]`` choices are kept in ``passes`` (a rollout's prefill and decode steps)."""

    def __init__(self, model: Any, routing: torch.Tensor | None = None, record: bool = False) -> None:
        self.routers = routers(model)
        self.module = _unwrapped(model)
        if routing is not None and routing.shape[2] != len(self.routers):
            raise ValueError(f"recorded routing of {routing.shape[2]} MoE layers for a model of {len(self.routers)}")
        self.routing = routing
        self.record = record
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        self.passes: list[torch.Tensor] = []
        self.replayed = 0  # tokens given recorded routing, over the passes since the tap opened
        self._layout: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self._rows: torch.Tensor | None = None
        self._handles: list[Any] = []

    def packed(self, index: torch.Tensor | None, slots: torch.Tensor | None = None, tokens: int = 0) -> None:
        """The next passes run packed: the real token at flat padded place ``index[i]`` sits at ``slots[i]`` of a
        pass of ``tokens`` (engines.packing.Packed); ``index`` None: padded, as the caller's rows."""
        self._layout = None if index is None else (index, slots, tokens)

    def to_pass(self, x: torch.Tensor, fill: float) -> torch.Tensor:
        """Per-token values ``[B * L, ...]`` in the padded layout -> the pass's layout (``fill`` elsewhere)."""
        if self._layout is None:
            return x
        index, slots, tokens = self._layout
        out = x.new_full((tokens, *x.shape[1:]), fill)
        out[slots] = x[index.to(x.device)]
        return out

    def from_pass(self, y: torch.Tensor, total: int, fill: float) -> torch.Tensor:
        """Per-token values ``[N, ...]`` of the pass -> the padded layout of ``total`` tokens."""
        if self._layout is None:
            return y
        index, slots, _ = self._layout
        out = y.new_full((total, *y.shape[1:]), fill)
        out[index.to(y.device)] = y[slots.to(y.device)]
        return out

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: Any, out: Any) -> Any:
            logits, weights, chosen = out
            if layer == 0:
                self.logits, self.indices = [], []
                self._rows = None
                if self.routing is not None:
                    flat = self.routing.reshape(-1, *self.routing.shape[2:]).to(chosen.device, chosen.dtype)
                    self._rows = self.to_pass(flat, -1)
            if self._rows is not None:
                given = self._rows[:, layer]
                if given.shape != chosen.shape:
                    raise ValueError(f"recorded routing of {tuple(given.shape)} for a pass of {tuple(chosen.shape)}")
                use = given[:, 0] >= 0
                self.replayed += int(use.sum()) if layer == 0 else 0
                chosen = torch.where(use.unsqueeze(1), given, chosen)
                weights = torch.where(use.unsqueeze(1), _weights(module, logits, chosen).to(weights.dtype), weights)
            self.logits.append(logits)
            self.indices.append(chosen.detach())
            if self.record and layer == len(self.routers) - 1:
                self.passes.append(torch.stack(self.indices))
            return logits, weights, chosen
        return hook

    def __enter__(self) -> RouterTap:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        self.module._moe_tap = self  # engines.packing tells an open tap how it packed the pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.module.__dict__.pop("_moe_tap", None)

    def chosen(self, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """Experts chosen in the last pass: ``[layers, N, k]``, or with ``shape`` ``(B, L)`` ``[B, L, layers, k]`` in
        the padded layout (-1 at padding)."""
        c = torch.stack(self.indices)
        if shape is None:
            return c
        flat = self.from_pass(c.permute(1, 0, 2), shape[0] * shape[1], -1)
        return flat.view(*shape, *flat.shape[1:])

    def aux_loss(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`load_balancing_loss` of the last pass over the tokens of ``mask`` (padded layout ``[B, L]``)."""
        return load_balancing_loss(self.logits, self.routers[0].top_k, self._mask(mask))

    def load(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`expert_load` of the last pass over the tokens of ``mask`` (padded layout ``[B, L]``)."""
        return expert_load(self.indices, self.routers[0].num_experts, self._mask(mask))

    def _mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else self.to_pass(mask.reshape(-1).float(), 0.0)


def _weights(router: torch.nn.Module, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The weights ``router`` gives the experts ``chosen`` from its ``logits``, as its own forward computes them:
    a softmax over the experts (or over the top k: the same once renormalised), renormalised over the top k unless
    the config says not (Mixtral and GPT-OSS always do); DeepSeek-V3's sigmoid scores with their scaling factor."""
    if hasattr(router, "e_score_correction_bias"):  # sigmoid routing (DeepSeek-V3)
        w = logits.float().sigmoid().gather(1, chosen)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
    return w / w.sum(-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else w


def tap_of(engine: Any) -> RouterTap | None:
    """The :class:`RouterTap` open on ``engine``'s model, if any."""
    return getattr(_unwrapped(engine), "_moe_tap", None)


@contextlib.contextmanager
def tapped(model: Any, routing: torch.Tensor | None = None, record: bool = False) -> Iterator[RouterTap | None]:
    """A :class:`RouterTap` on ``model`` for the block (None for a dense model), imposing ``routing`` if given."""
    tap = RouterTap(model, routing, record)
    if not tap.routers:
        yield None
        return
    with tap:
        yield tap


def router_logits_off(model: Any) -> dict[str, bool]:
    """``output_router_logits=False`` for the forward or ``generate`` of an MoE model (whatever its config says:
    transformers' own load-balancing loss fails on a cached decoding step's logits, and the trainers add theirs), {}
    for a dense one."""
    return {"output_router_logits": False} if routers(model) else {}


def aux_term(engine: Any, tap: RouterTap | None, mask: torch.Tensor | None) -> tuple[Any, dict[str, float]]:
    """The router's auxiliary loss term of a training pass under ``tap`` (``engine.router_aux_coef`` x the
    load-balancing loss over the trained tokens ``mask``, ``[B, L]``) and its figures: ``moe/aux_loss`` (unscaled)
    and ``moe/load_max`` / ``moe/load_min`` (the busiest / idlest expert's share x experts, a mean over layers: 1 at
    balance); with replay ``moe/replayed``, the share of those tokens given recorded routing. ``(0.0, {})`` without a
    tap (a dense model)."""
    if tap is None or not tap.logits:
        return 0.0, {}
    aux = tap.aux_loss(mask)
    load = tap.load(mask) * tap.routers[0].num_experts
    figures = {"moe/aux_loss": float(aux.detach()), "moe/load_max": float(load.max(-1).values.mean()),
               "moe/load_min": float(load.min(-1).values.mean())}
    if tap.routing is not None and mask is not None:  # router replay: the share of those tokens routed as recorded
        given = (tap.routing[..., 0, 0] >= 0).to(mask.device) & mask.bool()
        figures["moe/replayed"] = float(given.sum()) / max(float(mask.bool().sum()), 1.0)
    coef = float(getattr(engine, "router_aux_coef", 0.0) or 0.0)
    return (coef * aux if coef else 0.0), figures


def generated_routing(passes: list[torch.Tensor], rows: int, width: int) -> torch.Tensor:
    """``[rows, width, layers, k]`` routing of generated sequences from a rollout's passes (each ``[layers,
    rows * n, k]``: the prompt's prefill, then one token per step); the last token, never fed back, gets -1."""
    parts = [p.view(p.shape[0], rows, -1, p.shape[-1]) for p in passes]
    routing = torch.cat(parts, dim=2).permute(1, 2, 0, 3)
    if routing.shape[1] < width:
        pad = routing.new_full((rows, width - routing.shape[1], *routing.shape[2:]), -1)
        routing = torch.cat([routing, pad], dim=1)
    return routing[:, :width].to(torch.int16)


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

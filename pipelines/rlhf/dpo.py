"""Offline preference optimisation on the registry: DPO (sigmoid, optional label smoothing) and IPO.

Roles: a trainable policy (``actor``) and a frozen reference (``ref``), each its own engine with
its own stage (e.g. the policy at ZeRO-2 and the ref at ZeRO-3). Batches are
:class:`preference.PreferenceCollator` batches (``2B`` rows, chosen then rejected). The reference
log-probs are computed on the fly (one no-grad ref forward per batch) or, with
:meth:`DPOTrainer.precompute_reference`, once for the whole dataset; the ref role can then be
left out of the registry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from multiengine.engines import EngineRegistry, all_reduce_sum

from .evaluation import preference_accuracy
from .losses import DPO_LOSSES, chosen_nll, dpo_loss
from .preference import REF_KEYS, PreferenceCollator, pair_logprobs, preference_response_mask
from .scoring import eval_mode

__all__ = ["DPOSettings", "DPOTrainer"]


@dataclass
class DPOSettings:
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid only: assumed probability of a flipped label
    precompute_ref: bool = False  # ref log-probs from the batch (precompute_reference), not a ref forward
    sft_coef: float = 0.0  # > 0: + sft_coef x per-token NLL of the chosen answer (RPO; TRL's rpo_alpha)

    def __post_init__(self) -> None:
        if self.loss not in DPO_LOSSES:
            raise ValueError(f"loss={self.loss!r}; use one of {list(DPO_LOSSES)}.")
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0, got {self.beta}.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}.")
        if self.loss == "ipo" and self.label_smoothing:
            raise ValueError("label_smoothing applies to loss=sigmoid only; set it to 0 for ipo.")
        if self.sft_coef < 0:
            raise ValueError(f"sft_coef must be >= 0, got {self.sft_coef}.")


class DPOTrainer:
    """One optimizer step of DPO / IPO per :meth:`step` call (``G`` micro-batches of the batch).

    Args:
        registry: with the trainable ``policy`` role and, unless ``settings.precompute_ref`` and the
            log-probs were precomputed, the frozen ``ref`` role.
        settings: :class:`DPOSettings`.
        policy / ref: role names.
    """

    def __init__(self, registry: EngineRegistry, settings: DPOSettings, *, policy: str = "actor",
                 ref: str | None = "ref") -> None:
        if policy not in registry or not registry.role(policy).trainable:
            raise ValueError(f"policy role {policy!r} must be a trainable role of the registry ({registry.names()}).")
        if ref is not None and ref not in registry:
            raise ValueError(f"ref role {ref!r} is not in the registry ({registry.names()}); pass ref=None with "
                             "precompute_ref=True and precomputed rows.")
        if ref is None and not settings.precompute_ref:
            raise ValueError("no ref role: set precompute_ref=True and feed rows from precompute_reference().")
        self.registry = registry
        self.settings = settings
        self.policy = policy
        self.ref = ref
        self.steps = 0

    # ---------------------------------------------------------------------------------------------
    def reference_logprobs(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen [B], rejected [B])`` reference log-probs: from the batch when it carries them,
        else one ref forward (collective under ZeRO-3)."""
        if all(k in batch for k in REF_KEYS.values()):
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.settings.precompute_ref or self.ref is None:
            raise ValueError("precompute_ref=True but the batch has no ref_chosen_logps / ref_rejected_logps: "
                             "build the rows with precompute_reference() and a PreferenceCollator.")
        with torch.no_grad(), eval_mode(self.registry, self.ref) as engine:
            return pair_logprobs(engine, batch)

    def loss(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean DPO/IPO loss of a pair batch (policy forward with grad) and per-pair statistics."""
        s = self.settings
        ref_chosen, ref_rejected = self.reference_logprobs(batch)
        chosen, rejected = pair_logprobs(self.registry[self.policy], batch)
        losses, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, s.beta,
                                                s.label_smoothing, s.loss)
        stats = {"loss": losses.detach(), "accuracy": (r_chosen > r_rejected).float(),
                 "margin": r_chosen - r_rejected, "rewards/chosen": r_chosen, "rewards/rejected": r_rejected,
                 "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}
        if s.sft_coef > 0:
            B = chosen.shape[0]
            nll = chosen_nll(chosen, preference_response_mask(batch)[:B].sum(-1))
            stats["nll"] = nll.detach()
            losses = losses + s.sft_coef * nll
        return losses.mean(), stats

    def step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer step on a batch of ``B`` pairs per rank, split into the policy engine's ``G``
        gradient-accumulation micro-batches of ``B / G`` pairs. Returns global means over pairs."""
        engine = self.registry[self.policy]
        G = engine.gradient_accumulation_steps()
        batch = {k: v.to(self.registry.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        B = batch["input_ids"].shape[0] // 2
        if B % G:
            raise ValueError(f"{B} pairs per rank do not split into gradient_accumulation_steps={G} micro-batches.")
        sums: dict[str, float] = {}
        for chunk in torch.arange(B).split(B // G):
            rows = torch.cat([chunk, chunk + B]).to(self.registry.device)
            micro = {k: _take(v, rows, chunk, B) for k, v in batch.items()}
            loss, stats = self.loss(micro)
            engine.backward(loss)
            engine.step()
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + float(value.double().sum())
        self.steps += 1
        keys = sorted(sums)
        totals = all_reduce_sum(torch.tensor([sums[k] for k in keys] + [float(B)], dtype=torch.float64)).tolist()
        n = totals[-1]
        return {key: total / n for key, total in zip(keys, totals[:-1])}

    def evaluate(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Held-out preference accuracy, reward margin, implicit rewards and loss (collective)."""
        s = self.settings
        return preference_accuracy(self.registry, batches, self.policy, self.ref, s.beta, s.loss, s.label_smoothing)

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def precompute_reference(self, rows: Sequence[Mapping[str, Any]], collate: PreferenceCollator,
                             batch_size: int = 8) -> list[dict[str, Any]]:
        """Every row with its reference log-probs ``ref_chosen_logp`` / ``ref_rejected_logp`` added
        (collective: each rank scores an equal share, then all ranks get all rows).

        Feed the result to a batch stream with the same ``collate``: its batches then carry the ref
        log-probs and no ref forward runs during training.
        """
        if self.ref is None:
            raise ValueError("precompute_reference needs the ref role.")
        reg = self.registry
        n, world = len(rows), reg.world_size
        per_rank = math.ceil(n / world)
        mine = list(range(reg.rank * per_rank, min((reg.rank + 1) * per_rank, n)))
        # equal forwards on every rank (ZeRO-3): a short last shard repeats a row, dropped below
        padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
        values: list[tuple[float, float]] = []
        with eval_mode(reg, self.ref) as engine:
            for j in range(0, per_rank, batch_size):
                batch = collate([rows[i] for i in padded[j:j + batch_size]])
                batch = {k: v.to(reg.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                chosen, rejected = pair_logprobs(engine, batch)
                values.extend(zip(chosen.tolist(), rejected.tolist()))
        shards: list[Any] = [list(zip(mine, values[:len(mine)]))]
        if world > 1 and dist.is_initialized():
            shards = [None] * world
            dist.all_gather_object(shards, list(zip(mine, values[:len(mine)])))
        by_index = {i: v for shard in shards for i, v in shard}
        return [dict(rows[i], ref_chosen_logp=by_index[i][0], ref_rejected_logp=by_index[i][1]) for i in range(n)]

    # ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "loss": self.settings.loss, "beta": self.settings.beta}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("loss", self.settings.loss) != self.settings.loss:
            raise ValueError(f"checkpoint was written with loss={state['loss']!r}, this run uses "
                             f"{self.settings.loss!r}.")
        self.steps = int(state["steps"])


def _take(value: Any, rows: torch.Tensor, pairs: torch.Tensor, n_pairs: int) -> Any:
    """The micro-batch part of one batch entry: ``[2B, ...]`` tensors by row, ``[B]`` by pair."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape[0] == 2 * n_pairs:
        return value[rows]
    if value.shape[0] == n_pairs:
        return value[pairs.to(value.device)]
    raise ValueError(f"batch entry of shape {tuple(value.shape)} is neither per row ({2 * n_pairs}) nor per pair "
                     f"({n_pairs}).")

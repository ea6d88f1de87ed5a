"""Offline preference optimisation on the registry: DPO (sigmoid, optional label smoothing) and IPO, with a trainable
policy (``actor``) and a frozen reference (``ref``), each its own engine at its own stage. Batches are
:class:`preference.PreferenceCollator` batches (``2B`` rows, chosen then rejected); the reference log-probs come from
a no-grad ref forward per batch or, with :meth:`DPOTrainer.precompute_reference`, once for the whole dataset."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from multiengine.engines import EngineRegistry, all_reduce_sum, moe
from multiengine.engines.settings import Choice, Range, Settings, setting

from .losses import DPO_LOSSES, chosen_nll, dpo_loss
from .preference import REF_KEYS, PreferenceCollator, pair_logprobs, preference_response_mask
from .scoring import eval_mode

__all__ = ["DPOSettings", "DPOTrainer"]


@dataclass(frozen=True)
class DPOSettings(Settings):
    """The preference loss."""

    loss: str = setting("sigmoid", "sigmoid (DPO) | ipo", Choice(*DPO_LOSSES))
    beta: float = setting(0.1, "strength of the KL regularisation to the ref", Range(0, min_exclusive=True))
    label_smoothing: float = setting(0.0, "assumed probability of a flipped label (conservative DPO)",
                                     Range(0, 0.5, max_exclusive=True), when="loss=sigmoid")
    precompute_ref: bool = setting(False, "ref log-probs of every pair once before training, not a ref forward per "
                                          "batch")
    precompute_batch_size: int = setting(64, "pairs per ref forward while precomputing", Range(1),
                                         when="precompute_ref")
    sft_coef: float = setting(0.0, "> 0: + sft_coef x per-token NLL of the chosen answer (RPO, TRL's rpo_alpha)",
                              Range(0))


class DPOTrainer:
    """One optimizer step of DPO / IPO per :meth:`step` call (``G`` micro-batches of the batch), on a registry with
    the trainable ``policy`` role and, unless ``settings.precompute_ref`` with precomputed rows, the frozen ``ref``."""

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
    def reference_logprobs(self, batch: Mapping[str, Any], check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen [B], rejected [B])`` reference log-probs: from the batch when it carries them, else one ref
        forward (collective under ZeRO-3); ``check``: refuse that forward with ``precompute_ref``."""
        if all(k in batch for k in REF_KEYS.values()):
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if (check and self.settings.precompute_ref) or self.ref is None:
            raise ValueError("precompute_ref=True but the batch has no ref_chosen_logps / ref_rejected_logps: "
                             "build the rows with precompute_reference() and a PreferenceCollator.")
        with torch.no_grad(), eval_mode(self.registry, self.ref) as engine:
            return pair_logprobs(engine, batch)

    def loss(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean DPO/IPO loss of a pair batch (policy forward with grad) and per-pair statistics."""
        s = self.settings
        ref_chosen, ref_rejected = self.reference_logprobs(batch)
        engine, answers = self.registry[self.policy], preference_response_mask(batch)
        with moe.tapped(engine) as tap:
            chosen, rejected = pair_logprobs(engine, batch)
        aux, figures = moe.aux_term(engine, tap, answers)  # an MoE router's, on the answers
        losses, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, s.beta,
                                                s.label_smoothing, s.loss)
        stats = {"loss": losses.detach(), "accuracy": (r_chosen > r_rejected).float(),
                 "margin": r_chosen - r_rejected, "rewards/chosen": r_chosen, "rewards/rejected": r_rejected,
                 "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach(),
                 **{k: torch.full_like(chosen, v) for k, v in figures.items()}}  # per pair, as the others
        if s.sft_coef > 0:
            B = chosen.shape[0]
            nll = chosen_nll(chosen, answers[:B].sum(-1))
            stats["nll"] = nll.detach()
            losses = losses + s.sft_coef * nll
        return (losses + aux).mean(), stats

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

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Held-out metrics of the implicit reward ``beta * (logpi - logref)`` over every rank's pair batches
        (collective): ``accuracy`` (chosen reward > rejected), ``margin``, ``chosen_reward``, ``rejected_reward``,
        ``loss`` and ``pairs``."""
        s = self.settings
        totals = torch.zeros(6, dtype=torch.float64)  # correct, margin, chosen, rejected, loss, pairs
        for batch in batches:
            batch = {k: v.to(self.registry.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with eval_mode(self.registry, self.policy) as engine:
                chosen, rejected = pair_logprobs(engine, batch)
            ref_chosen, ref_rejected = self.reference_logprobs(batch, check=False)
            losses, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, s.beta,
                                                    s.label_smoothing, s.loss)
            diff = (r_chosen - r_rejected).double().cpu()
            totals += torch.stack([(diff > 0).double().sum(), diff.sum(), r_chosen.double().sum().cpu(),
                                   r_rejected.double().sum().cpu(), losses.double().sum().cpu(),
                                   torch.tensor(float(diff.numel()), dtype=torch.float64)])
        right, margin, chosen_sum, rejected_sum, loss_sum, n = all_reduce_sum(totals).tolist()
        n_ = max(n, 1.0)
        return {"accuracy": right / n_, "margin": margin / n_, "chosen_reward": chosen_sum / n_,
                "rejected_reward": rejected_sum / n_, "loss": loss_sum / n_, "pairs": n}

    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def precompute_reference(self, rows: Sequence[Mapping[str, Any]], collate: PreferenceCollator,
                             batch_size: int | None = None) -> list[dict[str, Any]]:
        """Every row with its reference log-probs ``ref_chosen_logp`` / ``ref_rejected_logp`` added, ``batch_size``
        pairs per forward (default ``settings.precompute_batch_size``; collective: each rank scores an equal share,
        then all ranks get all rows). Batches of the result (same ``collate``) carry them: no ref forward runs."""
        batch_size = batch_size or self.settings.precompute_batch_size
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

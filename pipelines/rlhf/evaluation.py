"""Evaluation shared by the RLHF recipes (collective: every rank takes part with its own batches):
answers of a policy judged / scored by the reward sources / compared with the ref
(:func:`evaluate_policy`; sampled and greedy answers to fixed prompts: :class:`PolicyAnswers`), held-out pair
accuracy of a reward model (:func:`pair_accuracy`) and of a policy's implicit DPO reward
(:func:`preference_accuracy`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum

from . import ppo
from .generation import GenerationSettings, generate
from .losses import dpo_loss
from .preference import REF_KEYS, pair_logprobs
from .rewards import RewardSource, compute_scores, reencoded
from .scoring import eval_mode, policy_logits, sequence_scores

__all__ = ["PolicyAnswers", "evaluate_policy", "pair_accuracy", "preference_accuracy"]

Judge = Callable[[str, str], float]


@torch.no_grad()
def evaluate_policy(
    registry: EngineRegistry,
    batches: Sequence[dict[str, Any]],
    generation: GenerationSettings,
    eos_token_id: int,
    pad_token_id: int,
    decode: Callable[[torch.Tensor], list[str]],
    role: str = "actor",
    judge: Judge | None = None,
    reward_role: str | None = None,
    ref_role: str | None = None,
    n_samples: int = 4,
    seed: int = 1234,
    reward_retokenizer: Any = None,
    rewards: Sequence[RewardSource] | None = None,
) -> dict[str, Any]:
    """Answers of ``role`` to every rank's prompt batches, judged and/or scored (collective).

    ``rewards``: the reward sources of training (reward-model roles and reward functions, with their
    weights and retokenizers; functions get the batches' ``columns`` as in training); every rank scores its
    own batches and every role runs the same number of forwards on every rank. Or ``reward_role``: one
    reward-model role's score alone, with ``reward_retokenizer`` when its tokenizer differs from the
    policy's (the answers are then scored re-encoded, as in training).

    Returns global means: ``judge`` (if a judge is given), ``reward`` (with ``rewards``: the weighted sum, before
    any no-EOS penalty, clipping or normalisation; with ``reward_role``: its score), ``reward/<name>`` (with
    ``rewards``: each source's unweighted score, over the rows it applies to), ``kl`` (exact per-token KL to
    ``ref_role`` summed over each answer), ``response_length``; and ``samples``: the first ``n_samples``
    (prompt, answer) pairs of this rank.

    Sampling (``generation.do_sample``) draws from a private RNG stream seeded by ``(seed, rank)``:
    every evaluation of a run sees the same noise, and the training RNG stream is left untouched (a
    resumed run continues identically whether or not it evaluated in between).
    """
    if rewards is not None and reward_role is not None:
        raise ValueError("give rewards= (every reward source) or reward_role= (one role's score), not both.")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed * 7 + registry.rank * 104_729)
        return _evaluate_policy(registry, batches, generation, eos_token_id, pad_token_id, decode, role, judge,
                                reward_role, ref_role, n_samples, reward_retokenizer, list(rewards or []))


@dataclass
class PolicyAnswers:
    """A policy's answers to fixed evaluation prompt batches (this rank's): sampled with ``sampled`` (seeded by
    ``seed``, see :func:`evaluate_policy`) and, with ``greedy`` settings, greedy as well; judged by ``judge``.
    ``decode`` turns answer ids into text with ``tokenizer`` (special tokens dropped)."""

    registry: EngineRegistry
    batches: Sequence[dict[str, Any]]
    tokenizer: Any
    sampled: GenerationSettings
    greedy: GenerationSettings | None = None
    judge: Judge | None = None
    seed: int = 1234
    role: str = "actor"

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids.cpu(), skip_special_tokens=True)

    def __call__(self, ref_role: str | None = None, rewards: Sequence[RewardSource] | None = None) -> dict[str, Any]:
        """:func:`evaluate_policy`'s figures of the sampled answers (KL to ``ref_role`` when given, scored by
        ``rewards``) and those of the greedy answers as ``greedy/<figure>`` (no KL, no samples); ``{}`` when
        there are no batches (collective)."""
        if not self.batches:
            return {}
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        result = evaluate_policy(self.registry, self.batches, self.sampled, eos, pad, self.decode, role=self.role,
                                 judge=self.judge, ref_role=ref_role, seed=self.seed, rewards=rewards)
        if self.greedy is not None:
            greedy = evaluate_policy(self.registry, self.batches, self.greedy, eos, pad, self.decode, role=self.role,
                                     judge=self.judge, rewards=rewards)
            result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        return result


def _evaluate_policy(
    registry: EngineRegistry,
    batches: Sequence[dict[str, Any]],
    generation: GenerationSettings,
    eos_token_id: int,
    pad_token_id: int,
    decode: Callable[[torch.Tensor], list[str]],
    role: str,
    judge: Judge | None,
    reward_role: str | None,
    ref_role: str | None,
    n_samples: int,
    reward_retokenizer: Any = None,
    rewards: Sequence[RewardSource] = (),
) -> dict[str, Any]:
    device = registry.device
    # judge, reward, kl, length, rows; then (sum, rows it applies to) of each reward source
    totals = torch.zeros(5 + 2 * len(rewards), dtype=torch.float64)
    samples: list[tuple[str, str]] = []
    for batch in batches:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        response = generate(registry, ids, mask, generation, eos_token_id, pad_token_id, role=role)
        action = ppo.action_mask(response, eos_token_id)
        answers = decode(response)
        seq = torch.cat([ids, response], dim=1)
        attention = torch.cat([mask, action.to(mask.dtype)], dim=1)
        row = torch.zeros_like(totals)
        if judge is not None:
            row[0] = sum(judge(p, a) for p, a in zip(batch["prompts"], answers))
        if rewards:
            score, parts = compute_scores(registry, rewards, seq, attention, batch["prompts"], answers,
                                          context_length=ids.shape[1], prompt_messages=batch.get("prompt_messages"),
                                          columns=batch.get("columns"))
            row[1] = score.double().sum().cpu()
            for i, src in enumerate(rewards):
                part = parts[src.name].double().cpu()
                kept = ~torch.isnan(part)
                row[5 + 2 * i], row[6 + 2 * i] = part[kept].sum(), kept.sum()
        elif reward_role is not None:
            r_ids, r_mask = seq, attention
            if reward_retokenizer is not None and reward_retokenizer.needed:
                enc = reencoded(reward_retokenizer, seq, attention, ids.shape[1], batch.get("prompts"),
                                batch.get("prompt_messages"))
                r_ids, r_mask = enc["input_ids"], enc["attention_mask"]
            row[1] = sequence_scores(registry[reward_role], r_ids, r_mask).double().sum().cpu()
        if ref_role is not None:
            # exact KL(policy || ref) of the next-token distributions along each answer, summed over its
            # tokens: unlike the k1 sample estimate it stays meaningful for greedy answers (and is >= 0)
            C = ids.shape[1]
            logp = torch.log_softmax(policy_logits(registry[role], seq, attention)[:, C - 1:-1].float()
                                     / generation.temperature, dim=-1)
            ref = torch.log_softmax(policy_logits(registry[ref_role], seq, attention)[:, C - 1:-1].float()
                                    / generation.temperature, dim=-1)
            kl = (logp.exp() * (logp - ref)).sum(-1)
            row[2] = (kl * action.float()).sum().double().cpu()
        row[3] = action.float().sum().double().cpu()
        row[4] = float(ids.shape[0])
        totals += row
        samples.extend(list(zip(batch["prompts"], answers))[: max(n_samples - len(samples), 0)])
    reduced = all_reduce_sum(totals).tolist()
    judge_sum, reward_sum, kl_sum, length_sum, n = reduced[:5]
    n = max(n, 1.0)
    out: dict[str, Any] = {"response_length": length_sum / n, "samples": samples}
    if judge is not None:
        out["judge"] = judge_sum / n
    if reward_role is not None or rewards:
        out["reward"] = reward_sum / n
    for i, src in enumerate(rewards):
        part_sum, part_n = reduced[5 + 2 * i], reduced[6 + 2 * i]
        out[f"reward/{src.name}"] = part_sum / part_n if part_n else float("nan")
    if ref_role is not None:
        out["kl"] = kl_sum / n
    return out


@torch.no_grad()
def pair_accuracy(registry: EngineRegistry, role: str, batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Held-out pair accuracy and mean score margin over every rank's batches (collective)."""
    correct = torch.zeros(3, dtype=torch.float64)
    with eval_mode(registry, role) as engine:
        for batch in batches:
            batch = {k: v.to(registry.device) for k, v in batch.items()}
            scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"]).float()
            half = scores.shape[0] // 2
            diff = (scores[:half] - scores[half:]).cpu().double()
            correct += torch.stack([(diff > 0).double().sum(), diff.sum(), torch.tensor(float(half))])
    right, margin, n = all_reduce_sum(correct).tolist()
    return {"accuracy": right / max(n, 1.0), "margin": margin / max(n, 1.0), "pairs": n}


@torch.no_grad()
def preference_accuracy(
    registry: EngineRegistry,
    batches: Sequence[Mapping[str, torch.Tensor]],
    policy: str = "actor",
    ref: str | None = "ref",
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> dict[str, float]:
    """Held-out preference metrics of a policy's implicit reward ``beta * (logpi - logref)`` over every
    rank's pair batches (collective): ``accuracy`` (chosen reward > rejected), ``margin`` (mean reward
    difference), ``chosen_reward``, ``rejected_reward``, ``loss`` and ``pairs``.

    The ref log-probs come from the batch (``ref_chosen_logps`` / ``ref_rejected_logps``, see
    :class:`PreferenceCollator`) when present, else from a forward of ``ref``.
    """
    totals = torch.zeros(6, dtype=torch.float64)  # correct, margin, chosen, rejected, loss, pairs
    for batch in batches:
        batch = {k: v.to(registry.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with eval_mode(registry, policy) as engine:
            chosen, rejected = pair_logprobs(engine, batch)
        if all(k in batch for k in REF_KEYS.values()):
            ref_chosen, ref_rejected = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        elif ref is not None:
            with eval_mode(registry, ref) as engine:
                ref_chosen, ref_rejected = pair_logprobs(engine, batch)
        else:
            raise ValueError("no ref log-probs: give a ref role or batches with precomputed ref_*_logps.")
        losses, r_chosen, r_rejected = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta, label_smoothing,
                                                loss_type)
        diff = (r_chosen - r_rejected).double().cpu()
        totals += torch.stack([(diff > 0).double().sum(), diff.sum(), r_chosen.double().sum().cpu(),
                               r_rejected.double().sum().cpu(), losses.double().sum().cpu(),
                               torch.tensor(float(diff.numel()), dtype=torch.float64)])
    right, margin, chosen_sum, rejected_sum, loss_sum, n = all_reduce_sum(totals).tolist()
    n_ = max(n, 1.0)
    return {"accuracy": right / n_, "margin": margin / n_, "chosen_reward": chosen_sum / n_,
            "rejected_reward": rejected_sum / n_, "loss": loss_sum / n_, "pairs": n}

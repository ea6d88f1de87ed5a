"""Evaluation shared by the RLHF recipes (collective: every rank takes part with its own batches): a policy's
sampled and greedy answers to fixed prompts, judged, scored by the reward sources and compared with the ref
(:class:`PolicyAnswers`), and a reward model's held-out pair accuracy (:func:`pair_accuracy`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum, shard_batches
from multiengine.engines.settings import Range, Settings, setting

from . import ppo
from .generation import GenerationSettings, generate
from .rewards import RewardSource, compute_scores
from .scoring import eval_mode, policy_logits, sequence_scores

__all__ = ["EvalSettings", "PolicyAnswers", "pair_accuracy", "policy_answers"]

Judge = Callable[[str, str], float]


@dataclass(frozen=True)
class EvalSettings(Settings):
    """A policy's answers to the prompts of the evaluation rows (never training rows)."""

    every: int = setting(50, "also evaluate every N steps (0 = only before and after)", Range(0))
    size: int = setting(256, "evaluation prompts (those of the evaluation rows, never training prompts), split "
                             "evenly over ranks; 0 = none", Range(0))
    batch_size: int = setting(32, "prompts per generation batch", Range(1), when="size")
    judge: bool = setting(True, "the built-in task's programmatic judge (only for its prompts)", when="size")
    greedy: bool = setting(True, "also score greedy answers (the main figures are those of sampled answers, seeded)")
    seed: int = setting(1234, "sampling seed of evaluation answers", Range(0), when="size")


@dataclass
class PolicyAnswers:
    """A policy's answers to this rank's fixed evaluation prompt batches: sampled with ``sampled`` from a private
    RNG stream seeded by ``(seed, rank)`` (every evaluation sees the same noise and the training stream is left
    untouched, so a resumed run continues identically), greedy too with ``greedy`` settings; judged by ``judge``."""

    registry: EngineRegistry
    batches: Sequence[dict[str, Any]]
    tokenizer: Any
    sampled: GenerationSettings
    greedy: GenerationSettings | None = None
    judge: Judge | None = None
    seed: int = 1234
    role: str = "actor"

    def __call__(self, ref_role: str | None = None, rewards: Sequence[RewardSource] = ()) -> dict[str, Any]:
        """The figures of the sampled answers (KL to ``ref_role`` when given, scored by ``rewards``) and those of the
        greedy ones as ``greedy/<figure>`` (no KL, no samples); ``{}`` without batches (collective)."""
        if not self.batches:
            return {}
        result = self.evaluate(self.sampled, ref_role, rewards)
        if self.greedy is not None:
            greedy = self.evaluate(self.greedy, None, rewards)
            result.update({f"greedy/{k}": v for k, v in greedy.items() if k != "samples"})
        return result

    @torch.no_grad()
    def evaluate(self, generation: GenerationSettings, ref_role: str | None = None,
                 rewards: Sequence[RewardSource] = (), n_samples: int = 4) -> dict[str, Any]:
        """Global means over every rank's answers: ``judge``, ``reward`` (the weighted sum of ``rewards``, before any
        no-EOS penalty, clipping or normalisation) and ``reward/<name>`` (each source's unweighted score over the rows
        it applies to), ``kl`` (exact per-token KL to ``ref_role`` summed over each answer), ``response_length``; and
        ``samples``: this rank's first ``n_samples`` (prompt, answer) pairs."""
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed * 7 + self.registry.rank * 104_729)
            return self._evaluate(generation, ref_role, list(rewards), n_samples)

    def _evaluate(self, generation: GenerationSettings, ref_role: str | None, rewards: list[RewardSource],
                  n_samples: int) -> dict[str, Any]:
        registry, role, tok = self.registry, self.role, self.tokenizer
        # judge, reward, kl, length, rows; then (sum, rows it applies to) of each reward source
        totals = torch.zeros(5 + 2 * len(rewards), dtype=torch.float64)
        samples: list[tuple[str, str]] = []
        for batch in self.batches:
            ids, mask = batch["input_ids"].to(registry.device), batch["attention_mask"].to(registry.device)
            response = generate(registry, ids, mask, generation, tok.eos_token_id, tok.pad_token_id, role=role)
            action = ppo.action_mask(response, tok.eos_token_id)
            answers = tok.batch_decode(response.cpu(), skip_special_tokens=True)
            seq = torch.cat([ids, response], dim=1)
            attention = torch.cat([mask, action.to(mask.dtype)], dim=1)
            row = torch.zeros_like(totals)
            if self.judge is not None:
                row[0] = sum(self.judge(p, a) for p, a in zip(batch["prompts"], answers))
            if rewards:
                score, parts = compute_scores(registry, rewards, seq, attention, batch["prompts"], answers,
                                              context_length=ids.shape[1], prompt_messages=batch.get("prompt_messages"),
                                              columns=batch.get("columns"))
                row[1] = score.double().sum().cpu()
                for i, src in enumerate(rewards):
                    part = parts[src.name].double().cpu()
                    kept = ~torch.isnan(part)
                    row[5 + 2 * i], row[6 + 2 * i] = part[kept].sum(), kept.sum()
            if ref_role is not None:
                # exact KL(policy || ref) of the next-token distributions along each answer, summed over its
                # tokens: unlike the k1 sample estimate it stays meaningful for greedy answers (and is >= 0)
                C = ids.shape[1]
                logp = torch.log_softmax(policy_logits(registry[role], seq, attention)[:, C - 1:-1].float()
                                         / generation.temperature, dim=-1)
                ref = torch.log_softmax(policy_logits(registry[ref_role], seq, attention)[:, C - 1:-1].float()
                                        / generation.temperature, dim=-1)
                row[2] = ((logp.exp() * (logp - ref)).sum(-1) * action.float()).sum().double().cpu()
            row[3] = action.float().sum().double().cpu()
            row[4] = float(ids.shape[0])
            totals += row
            samples.extend(list(zip(batch["prompts"], answers))[: max(n_samples - len(samples), 0)])
        reduced = all_reduce_sum(totals).tolist()
        judge_sum, reward_sum, kl_sum, length_sum, n = reduced[:5]
        n = max(n, 1.0)
        out: dict[str, Any] = {"response_length": length_sum / n, "samples": samples}
        if self.judge is not None:
            out["judge"] = judge_sum / n
        if rewards:
            out["reward"] = reward_sum / n
        for i, src in enumerate(rewards):
            part_sum, part_n = reduced[5 + 2 * i], reduced[6 + 2 * i]
            out[f"reward/{src.name}"] = part_sum / part_n if part_n else float("nan")
        if ref_role is not None:
            out["kl"] = kl_sum / n
        return out


def policy_answers(registry: EngineRegistry, rows: Any, tokenizer: Any, generation: GenerationSettings,
                   evaluation: EvalSettings, max_prompt_len: int, role: str = "actor") -> PolicyAnswers:
    """``role``'s answers to ``evaluation.size`` prompts of ``rows`` (evaluation rows; none when they have no prompts)
    in batches of ``evaluation.batch_size``, equal shares per rank: sampled with ``generation``, greedy too with
    ``evaluation.greedy``, judged with ``evaluation.judge`` when the prompts are the built-in task's."""
    from .data import PromptCollator
    from .runs import builtin_judge

    batches = []
    if evaluation.size and rows is not None and len(rows) and {"prompt", "messages"} & set(rows.column_names):
        # conversational prompts are rendered with add_generation_prompt=True
        batches = shard_batches(rows, PromptCollator(tokenizer, max_prompt_len), evaluation.batch_size,
                                registry.world_size, registry.rank, limit=evaluation.size)
    judge = builtin_judge([p for b in batches for p in b["prompts"]], evaluation.judge)
    return PolicyAnswers(registry, batches, tokenizer, generation, generation.greedy() if evaluation.greedy else None,
                         judge, evaluation.seed, role)


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

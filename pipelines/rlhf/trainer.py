"""The RLHF trainer's former single module, kept as an import path: the pieces now live in
rollout.py (experience making), advantages.py / ppo.py (estimators), update.py (policy/value update),
ppo_trainer.py (:class:`PPOTrainer`), grpo.py, dpo.py, evaluation.py, scoring.py and steps.py."""

from __future__ import annotations

from .collective import all_reduce_mean, all_reduce_sum
from .evaluation import evaluate_policy, pair_accuracy
from .ppo_trainer import PPOSettings, PPOTrainer
from .rollout import Experience
from .scoring import policy_logits, sequence_scores
from .steps import causal_lm_loss, reward_loss

__all__ = [
    "Experience",
    "PPOSettings",
    "PPOTrainer",
    "all_reduce_mean",
    "all_reduce_sum",
    "causal_lm_loss",
    "evaluate_policy",
    "pair_accuracy",
    "policy_logits",
    "reward_loss",
    "sequence_scores",
]

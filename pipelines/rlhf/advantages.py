"""Advantage estimators as pure tensor functions: GAE (with a critic, in ppo.py), the critic-free family GRPO,
Dr. GRPO, RLOO and REINFORCE++, and DAPO's overlong penalty of the sequence reward.

Groups. The critic-free estimators compare the ``n = n_samples_per_prompt`` completions of one
prompt. A rollout repeats each of a rank's prompts ``n`` times *consecutively* on that rank
(``repeat_interleave``), so a group is ``n`` adjacent rows and never spans ranks: group statistics
need no communication, and the global batch is still ``W * prompts_per_rank * n`` rows (the layout
OpenRLHF and verl use). Only REINFORCE++'s whitening is global (one all-reduce).

KL placement. ``kl_in_reward`` puts ``-beta * k1`` into every token's reward (PPO, RLOO, REINFORCE++);
otherwise the KL is a loss term (``losses.kl_loss``, k3, as GRPO does) and the rewards hold only the
sequence-level advantage on the last action token.

Shapes: ``B`` rows (a multiple of ``n``), ``T`` response tokens, masks ``[B, T]`` prefix masks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import ppo

if TYPE_CHECKING:
    from .grpo import GRPOSettings

__all__ = ["CRITIC_FREE", "critic_free_advantages", "gae", "grpo_advantages", "overlong_penalty", "returns_to_go",
           "rloo_advantages"]

CRITIC_FREE = ("grpo", "dr_grpo", "rloo", "reinforce_pp")

gae = ppo.gae


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    scores = scores.reshape(-1).float()
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} rows do not split into groups of n_samples_per_prompt={group_size}.")
    return scores.view(-1, group_size)


def _flat_zero(adv: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages ``adv`` (``[n_groups, n]``) with every group of equal rewards at exactly 0: the mean of
    rounded copies of one value is not that value (0.7 x 8 in float32), and the group's std would scale that noise up
    to a push of its own."""
    return adv.masked_fill(g.amax(-1, keepdim=True) == g.amin(-1, keepdim=True), 0.0).reshape(-1)


def grpo_advantages(scores: torch.Tensor, group_size: int, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """``[B]`` float32 GRPO sequence advantages ``(r - mean_group) / (std_group + eps)`` (Shao et al. 2024) of ``[B]``
    rewards in consecutive groups: ``std`` is the sample standard deviation (Bessel, as TRL and OpenRLHF); a group of
    one, or of equal rewards, gets exactly 0 (any value, any dtype). ``scale_by_std=False`` is Dr. GRPO (Liu et al.
    2025): only the mean removed, so groups with a small spread (too easy or too hard prompts) are not up-weighted."""
    g = _groups(scores, group_size)
    adv = g - g.mean(-1, keepdim=True)
    if scale_by_std and group_size > 1:
        adv = adv / (g.std(-1, keepdim=True) + eps)
    return _flat_zero(adv, g)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's leave-one-out advantage ``r_i - mean_{j != i} r_j`` (Ahmadian et al. 2024): each sample's
    baseline is the mean reward of the other ``n - 1`` completions of its prompt, so it is unbiased.
    Equals ``n / (n - 1) * (r_i - mean)``; exactly 0 for a group of equal rewards. Needs ``group_size >= 2``.
    ``[B] -> [B]``."""
    if group_size < 2:
        raise ValueError(f"rloo needs n_samples_per_prompt >= 2 (a leave-one-out baseline), got {group_size}.")
    g = _groups(scores, group_size)
    return _flat_zero(g - (g.sum(-1, keepdim=True) - g) / (group_size - 1), g)


def returns_to_go(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted returns ``G_t = r_t + gamma * G_{t+1}`` over the masked rewards (reverse loop; 0 after
    the last action). ``[B, T]`` float32, zero outside the mask."""
    mask = action_mask.to(torch.float32)
    rewards = rewards.float() * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def critic_free_advantages(score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                           action_mask: torch.Tensor, settings: GRPOSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages of the critic-free estimator ``settings.algorithm`` over groups of
    ``settings.n_samples_per_prompt`` rows:

    1. clip the scores (``clip_reward``; 0 = off);
    2. sequence advantage: ``grpo`` group z-score (``std_eps``), ``dr_grpo`` group mean removed, ``rloo``
       leave-one-out, ``reinforce_pp`` the score itself;
    3. per-token rewards: that value on the last action token (``ppo.compute_rewards``), plus ``-kl_coef * k1``
       (clamped to ``kl_clamp``) on every action token when the KL is in the reward;
    4. advantages = returns-to-go (``gamma``); for ``reinforce_pp`` whitened with the masked mean and variance of
       the *global* batch (all ranks: collective), REINFORCE++'s baseline.

    With the KL as a loss term and ``gamma = 1`` every token of a row gets the row's sequence advantage (GRPO).
    ``ref_logprobs`` may be None when the KL is not in the reward. Returns ``(advantages, rewards)``, ``[B, T]``
    float32, 0 outside the mask.
    """
    s, algorithm, group_size = settings, settings.algorithm, settings.n_samples_per_prompt
    if algorithm not in CRITIC_FREE:
        raise ValueError(f"algorithm={algorithm!r}; use one of {list(CRITIC_FREE)} (or gae with a critic).")
    kl_in_reward = s.resolved_kl_in_reward
    if kl_in_reward and s.kl_coef and ref_logprobs is None:
        raise ValueError("the KL in the reward with kl_coef > 0 needs ref log-probs (a ref role).")
    score = score.reshape(-1).float()
    if s.clip_reward:
        score = score.clamp(-s.clip_reward, s.clip_reward)
    if algorithm == "grpo":
        seq = grpo_advantages(score, group_size, True, s.std_eps)
    elif algorithm == "dr_grpo":
        seq = grpo_advantages(score, group_size, False)
    elif algorithm == "rloo":
        seq = rloo_advantages(score, group_size)
    else:
        seq = score
    rewards = ppo.compute_rewards(seq, logprobs, ref_logprobs if kl_in_reward else None, action_mask,
                                  s.kl_coef if kl_in_reward else 0.0, kl_clamp=s.kl_clamp)
    advantages = returns_to_go(rewards, action_mask, s.gamma)
    if algorithm == "reinforce_pp":
        advantages = ppo.masked_whiten(advantages, action_mask)
    return advantages, rewards


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), added to the sequence reward: ``[B]`` float32, 0 for
    ``L <= max_len - buffer``, ``-penalty * (L - (max_len - buffer)) / buffer`` inside the buffer (linear to
    ``-penalty`` at ``max_len``), ``-penalty`` beyond; ``lengths`` ``[B]`` in tokens, ``max_len`` the generation cap
    (``max_new_tokens``), ``1 <= buffer <= max_len``."""
    if max_len < 1:
        raise ValueError(f"overlong max_len must be >= 1 (max_new_tokens), got {max_len}.")
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong_buffer={buffer!r}: the penalty ramps over the last overlong_buffer tokens before "
                         f"max_new_tokens={max_len}, so use 1 <= overlong_buffer <= {max_len}.")
    if penalty < 0:
        raise ValueError(f"overlong_penalty={penalty!r}: a penalty size >= 0 (it is subtracted from the reward).")
    exceed = lengths.float() - float(max_len - buffer)
    return (-exceed / float(buffer) * penalty).clamp(min=-penalty, max=0.0)

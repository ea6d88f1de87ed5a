"""PPO math for RLHF step 3 as small pure tensor functions (the policy losses are losses.POLICY_LOSSES).

Follows the reference checklist (OpenRLHF, TRL, verl, DeepSpeed-Chat agree on these): log-prob alignment
``logits[:, ctx-1:-1]`` with temperature, an action mask up to and including the first EOS, the reward-model score
on the last valid action token, a per-token k1 KL penalty, GAE in a reverse loop, whitening across ranks, a clipped
value loss normalised by a global token count.

Shapes: ``B`` batch, ``L`` full sequence (prompt + response), ``C`` context (prompt) length, ``T = L - C`` response
length, ``V`` vocabulary. Masks are ``[B, T]`` bool or 0/1; functions cast them themselves. :func:`masked_whiten` and
:func:`global_token_count` reduce across ranks when ``torch.distributed`` is initialised: then every rank calls them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = ["AdaptiveKLController", "FixedKLController", "action_mask", "apply_no_eos_penalty", "compute_rewards",
           "entropy_from_logits", "gae", "global_token_count", "kl_k1", "kl_k3", "logprobs_from_logits",
           "masked_mean", "masked_var", "masked_whiten", "response_logprobs", "response_values", "truncate_after_eos",
           "value_loss"]

# exp() of a log-ratio above ~88 overflows float32; 20 keeps the ratio finite and is what OpenRLHF/verl clamp to,
# so a stale or diverged token cannot produce inf/NaN gradients.
LOG_RATIO_CLAMP = 20.0


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


# --- log-probs, masks ---------------------------------------------------------------------------------------------
def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` float32 log-probability of ``labels`` under ``softmax(logits / temperature)``. Actor, ref and old
    policy must use the temperature the rollout was sampled with, or the ratio and the KL compare different
    distributions."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # float32 log-softmax: bf16 log-probs are too coarse for ratios that must be ~1.0 at step 0.
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def response_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, context_length: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log-probs of the response tokens ``input_ids[:, C:]`` of ``[B, L]`` prompt + response rows: the
    logit at ``i`` predicts token ``i + 1``, so they are scored by ``logits[:, C-1:-1]``."""
    if not 1 <= context_length < input_ids.shape[1]:
        raise ValueError(f"context_length must be in [1, {input_ids.shape[1] - 1}] for sequences of length "
                         f"{input_ids.shape[1]}, got {context_length}")
    return logprobs_from_logits(logits[:, context_length - 1:-1], input_ids[:, context_length:], temperature)


def response_values(values: torch.Tensor, context_length: int) -> torch.Tensor:
    """``[B, T]`` critic values of the actions: ``values[:, i]`` is the state that has seen tokens ``<= i``, the one
    in which token ``i + 1`` is chosen (the shift of :func:`response_logprobs`)."""
    return values[:, context_length - 1:-1]


def _first_eos_onehot(response_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` bool one-hot of the first EOS per row, and ``[B, T]`` bool 'at or before it'."""
    is_eos = response_ids == eos_token_id
    seen = is_eos.long().cumsum(dim=-1)  # EOS seen so far: the first EOS is where it becomes 1 on an EOS
    return is_eos & (seen == 1), (seen - is_eos.long()) == 0


def action_mask(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """``[B, T]`` bool prefix mask of the actions: every generated token up to and including the first EOS (a row
    without EOS, a truncated answer, is all actions).

    Every token before the first EOS is an action whatever its id: ``generate`` only pads after a row emitted EOS,
    so a pad id before it was *sampled* (and attended to while the rest of the row was sampled). Masking it out
    would punch a hole into the prefix mask GAE assumes and shift the re-scored log-probs of every later token.
    Works when ``pad_token_id == eos_token_id``."""
    return _first_eos_onehot(response_ids, eos_token_id)[1]


def truncate_after_eos(response_ids: torch.Tensor, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """A copy with every token after the first EOS replaced by ``pad_token_id``: batched generation keeps sampling
    rows that stopped until all stop, and those tokens must not reach the reward model, the decoder or the losses."""
    upto = _first_eos_onehot(response_ids, eos_token_id)[1]
    return torch.where(upto, response_ids, torch.full_like(response_ids, pad_token_id))


def apply_no_eos_penalty(score: torch.Tensor, response_ids: torch.Tensor, eos_token_id: int,
                         penalty: float) -> torch.Tensor:
    """``[B]`` scores minus ``penalty`` for the responses that never emitted EOS (truncated answers)."""
    has_eos = (response_ids == eos_token_id).any(dim=-1)
    return torch.where(has_eos, score, score - penalty)


# --- rewards and KL -----------------------------------------------------------------------------------------------
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 KL estimator ``logp - logp_ref`` (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``e^(ref - logp) - (ref - logp) - 1`` (>= 0; the log-ratio clamped to +/-20)."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_ratio) - log_ratio - 1.0


def _last_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last true entry per row ``[B]`` (long) and whether the row has any ``[B]``."""
    mask = mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    return last.clamp_min(0), last >= 0


def compute_rewards(score: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
                    action_mask: torch.Tensor, kl_coef: float, clip_reward: float = 0.0,
                    kl_clamp: float = 0.0) -> torch.Tensor:
    """``[B, T]`` float32 per-token rewards: ``-kl_coef * (logp - ref_logp)`` on every action (none without
    ``ref_logprobs``), plus the ``[B]`` ``score`` clipped to ``+/- clip_reward`` on the last action; 0 outside the
    mask, nothing for a row without actions. ``kl_clamp`` clamps each token's k1 estimate first (0 = off, as is
    ``clip_reward`` 0).

    The score sits on the *last action token* (the first EOS, or the last token of an answer cut at
    ``max_new_tokens``), as OpenRLHF does (TRL and DeepSpeed-Chat add it one position later): on a token the policy
    chose, inside the prefix mask of the KL terms, so GAE, returns and every masked mean see one set of actions."""
    mask = action_mask.to(torch.float32)
    if ref_logprobs is None or kl_coef == 0:
        rewards = torch.zeros_like(mask)
    else:
        kl = kl_k1(logprobs.float(), ref_logprobs.float())
        if kl_clamp:
            kl = kl.clamp(-kl_clamp, kl_clamp)
        rewards = -kl_coef * kl * mask
    score = score.to(torch.float32).reshape(-1)
    if clip_reward:
        score = score.clamp(-clip_reward, clip_reward)
    last, has_action = _last_index(action_mask)
    score = torch.where(has_action, score, torch.zeros_like(score))
    return rewards.scatter_add(1, last.unsqueeze(1), score.unsqueeze(1))


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op so it is interchangeable with the adaptive one."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019): ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta *
    (1 + e * n_steps / horizon)``; the clip keeps one noisy KL estimate from swinging beta by more than a few %."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update beta from the mean per-sequence KL of the last rollout of ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # beta is training state: without it a resumed run restarts from init_kl_coef.
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


# --- GAE and masked statistics ------------------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a prefix action mask (reverse loop): ``delta_t = r_t + gamma V_{t+1} -
    V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, ``V = 0`` after the last action (rewards and values are masked
    first). Returns ``(advantages, returns = advantages + values)``, ``[B, T]`` float32, before any whitening."""
    mask = action_mask.to(torch.float32)
    rewards = rewards.float() * mask
    values = values.float().detach() * mask
    steps = rewards.shape[-1]
    last_gae = torch.zeros_like(rewards[:, 0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, advantages + values


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` is set (this rank), over ``dim`` or everything; an empty mask gives 0."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance of the masked entries (this rank); ``unbiased`` applies Bessel's ``n / (n - 1)`` (TRL; OpenRLHF
    does not)."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    if unbiased:
        count = mask.to(x.dtype).sum()
        if count <= 1:
            raise ValueError(f"unbiased variance needs at least 2 masked entries, got {count.item()}")
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + 1e-8)`` with the masked mean and population variance of the *global* batch (sum,
    sum of squares and count all-reduced over ``process_group`` when distributed: a per-rank whitening would depend
    on the data-parallel size), in float64 so ``E[x^2] - E[x]^2`` does not cancel; 0 outside the mask.
    ``shift_mean=False`` adds the mean back (only the scale is normalised)."""
    m = mask.to(torch.float64)
    xd = x.to(torch.float64) * m
    stats = torch.stack([xd.sum(), (xd * xd).sum(), m.sum()])
    if _dist_active():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=process_group)
    total, total_sq, count = stats.unbind()
    if count.item() == 0:
        logger.warning("masked_whiten called with an empty mask on every rank; returning zeros")
        return torch.zeros_like(x)
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)
    whitened = (x.to(torch.float64) - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * m).to(x.dtype)


def global_token_count(mask: torch.Tensor, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scalar float32 count of the set entries of ``mask`` summed over all ranks (this rank's when not
    distributed)."""
    count = mask.to(torch.float32).sum()
    if _dist_active():
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=process_group)
    return count


# --- the value loss -----------------------------------------------------------------------------------------------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip_eps: float = 0.2, global_token_count: torch.Tensor | float | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)`` (``clip_eps`` 0: the
    plain ``0.5 (V - R)^2``), the token mean of this batch or, with ``global_token_count``, ``sum / count`` (the
    count of the whole optimizer step over ``W * G``: see losses.aggregate_loss). Stats (detached): ``clip_frac``
    (share of valid tokens where the clipped branch is the larger) and ``values_mean``."""
    values = values.float()
    returns = returns.float().detach()
    unclipped = (values - returns) ** 2
    mask = action_mask.to(torch.float32)
    if not clip_eps:
        per_token = 0.5 * unclipped
        clip_frac = torch.zeros((), device=values.device)
    else:
        old_values = old_values.float().detach()
        clipped = (old_values + (values - old_values).clamp(-clip_eps, clip_eps) - returns) ** 2
        per_token = 0.5 * torch.max(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask).detach()
    if global_token_count is None:
        loss = masked_mean(per_token, mask)
    else:
        count = torch.as_tensor(global_token_count, dtype=per_token.dtype, device=per_token.device)
        loss = (per_token * mask).sum() / count.clamp_min(1.0)
    return loss, {"clip_frac": clip_frac, "values_mean": masked_mean(values.detach(), mask)}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float32 entropy of ``softmax(logits)`` in nats, ``logsumexp(z) - sum(softmax(z) z)`` (no
    ``log_softmax`` materialised); divide by the temperature first if the policy samples with one."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)

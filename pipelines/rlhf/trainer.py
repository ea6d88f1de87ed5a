"""RLHF steps on the registry: experience making and the PPO update (step 3), plus the SFT (step 1)
and reward-model (step 2) step helpers and the evaluation used by all three recipes.

Every function that touches a role is collective: all ranks call it with the same number of rows, so
every rank runs the same number of forwards of every role (checklist item 12; under ZeRO-3 each
forward gathers layers from all ranks, and a rank that skipped one would hang the others).

Shapes: ``B`` rows per rank, ``C`` padded prompt length, ``T`` response length, ``L = C + T``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from multiengine.engines import EngineRegistry, ema_update

from . import ppo
from .generation import GenerationSettings, generate, position_ids_from_mask
from .models import last_token_index, pairwise_loss

logger = logging.getLogger(__name__)

__all__ = [
    "Experience",
    "PPOSettings",
    "PPOTrainer",
    "all_reduce_mean",
    "causal_lm_loss",
    "evaluate_policy",
    "pair_accuracy",
    "reward_loss",
    "sequence_scores",
]

Judge = Callable[[str, str], float]


# --------------------------------------------------------------------------------------------------
# small collective helpers
# --------------------------------------------------------------------------------------------------


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a copy; float64 so means of many small numbers stay exact enough)."""
    out = values.detach().to(torch.float64).clone()
    if _dist():
        dist.all_reduce(out)
    return out


def all_reduce_mean(value: float | torch.Tensor) -> float:
    """Mean of a scalar over ranks."""
    t = torch.as_tensor(value, dtype=torch.float64).reshape(1)
    world = dist.get_world_size() if _dist() else 1
    return float(all_reduce_sum(t)[0]) / world


def _global_moments(x: torch.Tensor) -> tuple[float, float, float]:
    """Mean, std and count of the rows of ``x`` ``[B]`` across all ranks (one all-reduce)."""
    x = x.detach().to(torch.float64)
    stats = all_reduce_sum(torch.stack([x.sum(), (x * x).sum(), torch.tensor(float(x.numel()), dtype=x.dtype)]))
    total, total_sq, n = stats.tolist()
    mean = total / max(n, 1.0)
    return mean, math.sqrt(max(total_sq / max(n, 1.0) - mean * mean, 0.0)), n


# --------------------------------------------------------------------------------------------------
# forwards
# --------------------------------------------------------------------------------------------------


def policy_logits(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L, V]`` logits of a causal-LM engine, positions from the mask (left padding safe)."""
    out = engine(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    return out.logits


def sequence_scores(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` scalar-head scores at the last real token (through the engine, so ZeRO-3 hooks run)."""
    values = engine(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids_from_mask(attention_mask))
    return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)


def causal_lm_loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy on ``labels`` (-100 = ignored), ``[B, L]`` batch of :class:`SFTCollator`."""
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False)
    return out.loss


def reward_loss(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairwise loss and accuracy for a :class:`PairCollator` batch (``[2B, L]``: chosen then rejected)."""
    scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"])
    half = scores.shape[0] // 2
    return pairwise_loss(scores[:half], scores[half:])


@torch.no_grad()
def pair_accuracy(registry: EngineRegistry, role: str, batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Held-out pair accuracy and mean score margin over every rank's batches (collective)."""
    engine = registry[role]
    module = registry.role(role).module
    was_training = module.training
    module.eval()
    correct = torch.zeros(3, dtype=torch.float64)
    for batch in batches:
        batch = {k: v.to(registry.device) for k, v in batch.items()}
        scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"]).float()
        half = scores.shape[0] // 2
        diff = (scores[:half] - scores[half:]).cpu().double()
        correct += torch.stack([(diff > 0).double().sum(), diff.sum(), torch.tensor(float(half))])
    module.train(was_training)
    right, margin, n = all_reduce_sum(correct).tolist()
    return {"accuracy": right / max(n, 1.0), "margin": margin / max(n, 1.0), "pairs": n}


# --------------------------------------------------------------------------------------------------
# experience
# --------------------------------------------------------------------------------------------------


@dataclass
class PPOSettings:
    """Step-3 hyper-parameters; defaults as in the reference checklist."""

    rollout_batch_size: int = 8  # prompts per rank per PPO step
    mini_batch_size: int = 4  # rows per rank per forward/backward in the update
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    value_clip: float | None = 0.2
    dual_clip: float | None = None
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.1
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: int = 10000
    clip_reward: float | None = 5.0
    whiten_advantages: bool = True
    no_eos_penalty: float | None = None
    ptx_coef: float = 0.0
    critic_warmup_steps: int = 0
    ema_decay: float = 0.992
    shuffle_minibatches: bool = True

    def __post_init__(self) -> None:
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size} must be a multiple of "
                             f"mini_batch_size={self.mini_batch_size}.")

    def kl_controller(self) -> ppo.FixedKLController | ppo.AdaptiveKLController:
        if self.adaptive_kl:
            return ppo.AdaptiveKLController(self.kl_coef, self.kl_target, self.kl_horizon)
        return ppo.FixedKLController(self.kl_coef)


@dataclass
class Experience:
    """One frozen rollout on this rank. All ``[B, T]`` tensors are zero outside ``action_mask``."""

    sequences: torch.Tensor  # [B, L] prompt (left padded) + response (right padded)
    attention_mask: torch.Tensor  # [B, L]
    context_length: int  # C
    action_mask: torch.Tensor  # [B, T] bool
    logprobs: torch.Tensor  # [B, T] rollout (old) policy
    ref_logprobs: torch.Tensor  # [B, T]
    values: torch.Tensor  # [B, T] critic at rollout time
    score: torch.Tensor  # [B] reward-model score (after the no-EOS penalty, before clipping)
    rewards: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T] (whitened when enabled)
    returns: torch.Tensor  # [B, T] (advantages + values, before whitening)
    prompts: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def response_ids(self) -> torch.Tensor:
        return self.sequences[:, self.context_length:]

    def rows(self, index: torch.Tensor) -> Experience:
        """The rows ``index`` (a minibatch)."""
        take = {k: getattr(self, k)[index] for k in ("sequences", "attention_mask", "action_mask", "logprobs",
                                                     "ref_logprobs", "values", "score", "rewards", "advantages",
                                                     "returns")}
        return Experience(context_length=self.context_length, **take)


class PPOTrainer:
    """Experience making and the PPO update over actor, ref, critic, reward (and ema) roles.

    Args:
        registry: built with :func:`roles.build_rlhf_roles` (roles ``actor``, ``ref``, ``critic``,
            ``reward``, optionally ``ema``).
        generation: sampling settings (temperature also scales the PPO log-probs).
        settings: :class:`PPOSettings`.
        eos_token_id / pad_token_id: the tokenizer's.
        seed: sampling seeds derive from ``(seed, step, rank)``, so a resumed run samples the same tokens.
        judge: optional programmatic ``judge(prompt, answer)`` logged next to the reward (``decode`` needed).
        decode: ``response_ids [B, T] -> list[str]``.
    """

    def __init__(
        self,
        registry: EngineRegistry,
        generation: GenerationSettings,
        settings: PPOSettings,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        judge: Judge | None = None,
        decode: Callable[[torch.Tensor], list[str]] | None = None,
    ) -> None:
        self.registry = registry
        self.generation = generation
        self.settings = settings
        self.eos = int(eos_token_id)
        self.pad = int(pad_token_id)
        self.seed = seed
        self.judge = judge
        self.decode = decode
        self.kl_ctl = settings.kl_controller()
        self.has_ema = "ema" in registry

    # ---------------------------------------------------------------------------------------------
    def sampling_seed(self, step: int) -> int:
        return (self.seed * 1_000_003 + step * 7919 + self.registry.rank * 104_729) % (2**63 - 1)

    @torch.no_grad()
    def make_experience(self, batch: dict[str, Any], step: int) -> Experience:
        """Generate, then score with every role: actor and ref log-probs, critic values, reward score,
        per-token rewards (k1 KL penalty + clipped score on the last action), GAE and whitening.

        Args:
            batch: a :class:`PromptCollator` batch: ``input_ids`` / ``attention_mask`` ``[B, C]``,
                ``prompts`` (texts).
            step: PPO step, seeds the sampling.
        """
        reg, s, gen = self.registry, self.settings, self.generation
        device = reg.device
        prompt_ids = batch["input_ids"].to(device)
        prompt_mask = batch["attention_mask"].to(device)
        C = prompt_ids.shape[1]

        # 1. sample responses (seeded per step and rank: resume and stage changes sample the same tokens)
        t0 = time.perf_counter()
        torch.manual_seed(self.sampling_seed(step))
        response = generate(reg, prompt_ids, prompt_mask, gen, self.eos, self.pad)
        t_gen = time.perf_counter() - t0

        # 2. assemble the sequences; the action mask covers tokens up to and including the first EOS
        t1 = time.perf_counter()
        sequences = torch.cat([prompt_ids, response], dim=1)
        action = ppo.action_mask(response, self.eos, self.pad)
        attention = torch.cat([prompt_mask, action.to(prompt_mask.dtype)], dim=1)

        # 3. one forward per role, every rank (eval mode: no dropout, same numbers as training forwards)
        actor_module = reg.role("actor").module
        was_training = actor_module.training
        actor_module.eval()
        logprobs = ppo.response_logprobs(policy_logits(reg["actor"], sequences, attention), sequences, C,
                                         gen.temperature)
        actor_module.train(was_training)
        ref_logprobs = ppo.response_logprobs(policy_logits(reg["ref"], sequences, attention), sequences, C,
                                             gen.temperature)
        critic_module = reg.role("critic").module
        was_training = critic_module.training
        critic_module.eval()
        values = ppo.response_values(reg["critic"](input_ids=sequences, attention_mask=attention,
                                                   position_ids=position_ids_from_mask(attention)).float(), C)
        critic_module.train(was_training)
        score = sequence_scores(reg["reward"], sequences, attention).float()
        if s.no_eos_penalty:
            score = ppo.apply_no_eos_penalty(score, response, self.eos, s.no_eos_penalty)

        # 4. rewards, GAE (returns before whitening), whitening over the whole rollout (all ranks)
        rewards = ppo.compute_rewards(score, logprobs, ref_logprobs, action, self.kl_ctl.value, s.clip_reward)
        advantages, returns = ppo.gae(rewards, values, action, s.gamma, s.lam)
        if s.whiten_advantages:
            advantages = ppo.masked_whiten(advantages, action)
        t_exp = time.perf_counter() - t1
        action_f = action.float()
        return Experience(
            sequences=sequences, attention_mask=attention, context_length=C, action_mask=action,
            logprobs=logprobs * action_f, ref_logprobs=ref_logprobs * action_f, values=values * action_f,
            score=score, rewards=rewards, advantages=advantages, returns=returns,
            prompts=list(batch.get("prompts", [])),
            timings={"generation_s": t_gen, "experience_s": t_exp,
                     "generation_steps": float(response.shape[1])},
        )

    # ---------------------------------------------------------------------------------------------
    def _minibatches(self, n_rows: int, step: int, epoch: int) -> list[torch.Tensor]:
        s = self.settings
        if s.shuffle_minibatches:
            # same permutation on every rank (rank-independent seed): only local rows are shuffled
            g = torch.Generator().manual_seed(self.seed * 31 + step * 1009 + epoch)
            order = torch.randperm(n_rows, generator=g)
        else:
            order = torch.arange(n_rows)
        return list(order.split(s.mini_batch_size))

    def _global_count(self, exp: Experience, group: list[torch.Tensor], engine: Any) -> torch.Tensor:
        """Normaliser for one optimizer step: the valid tokens of all its micro-batches on all ranks,
        divided by ``W * G`` because DeepSpeed averages gradients over ranks and accumulation steps."""
        mask = torch.cat([exp.action_mask[idx] for idx in group]).float()
        count = ppo.global_token_count(mask)
        world = self.registry.world_size
        return count / (world * engine.gradient_accumulation_steps())

    def train_on(self, exp: Experience, step: int,
                 ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """``ppo_epochs`` passes of minibatches over one frozen rollout; actor and critic step separately.

        Returns global means (over ranks and micro-batches) of the losses and statistics.
        """
        reg, s, gen = self.registry, self.settings, self.generation
        actor, critic = reg["actor"], reg["critic"]
        train_actor = step >= s.critic_warmup_steps
        C = exp.context_length
        sums: dict[str, float] = {}
        n_micro = 0

        def add(key: str, value: torch.Tensor | float) -> None:
            sums[key] = sums.get(key, 0.0) + float(value)

        for epoch in range(s.ppo_epochs):
            micro = self._minibatches(exp.sequences.shape[0], step, epoch)
            g_actor = actor.gradient_accumulation_steps()
            g_critic = critic.gradient_accumulation_steps()
            if len(micro) % g_actor or len(micro) % g_critic:
                raise ValueError(f"{len(micro)} minibatches per epoch is not a multiple of the gradient accumulation"
                                 f" steps (actor {g_actor}, critic {g_critic}).")
            for i, idx in enumerate(micro):
                mb = exp.rows(idx)
                # 1. actor: clipped surrogate on the current policy's log-probs (+ optional pretraining loss)
                if train_actor:
                    group = micro[i - i % g_actor: i - i % g_actor + g_actor]
                    count = self._global_count(exp, group, actor)
                    logits = policy_logits(actor, mb.sequences, mb.attention_mask)
                    logp = ppo.response_logprobs(logits, mb.sequences, C, gen.temperature)
                    pg_loss, pg_stats = ppo.policy_loss(logp, mb.logprobs, mb.advantages, mb.action_mask,
                                                        s.clip_eps, s.dual_clip, count)
                    with torch.no_grad():
                        scaled = logits[:, C - 1:-1].float() / gen.temperature
                        entropy = ppo.masked_mean(ppo.entropy_from_logits(scaled), mb.action_mask)
                    loss = pg_loss
                    if s.ptx_coef > 0 and ptx_batches is not None:
                        ptx = {k: v.to(reg.device) for k, v in next(ptx_batches).items()}
                        ptx_loss = causal_lm_loss(actor, ptx)
                        loss = loss + s.ptx_coef * ptx_loss
                        add("ptx_loss", ptx_loss.detach())
                    actor.backward(loss)
                    actor.step()
                    # summed over ranks and an optimizer step's micro-batches, loss / (W*G) is that
                    # step's global token mean (see _global_count)
                    add("policy_loss_global", pg_loss.detach() / (reg.world_size * g_actor))
                    for key in ("clip_frac", "approx_kl", "ratio_mean"):
                        add(key, pg_stats[key])
                    add("entropy", entropy)
                # 2. critic: clipped value loss against the returns
                group = micro[i - i % g_critic: i - i % g_critic + g_critic]
                count = self._global_count(exp, group, critic)
                values = ppo.response_values(critic(input_ids=mb.sequences, attention_mask=mb.attention_mask,
                                                    position_ids=position_ids_from_mask(mb.attention_mask)), C)
                v_loss, v_stats = ppo.value_loss(values, mb.values, mb.returns, mb.action_mask, s.value_clip, count)
                critic.backward(v_loss)
                critic.step()
                add("value_loss_global", v_loss.detach() / (reg.world_size * g_critic))
                add("value_clip_frac", v_stats["clip_frac"])
                n_micro += 1

        # 3. one all-reduce for every statistic: global sums, then means per micro-batch
        keys = sorted(sums)
        totals = all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()
        world = reg.world_size
        out: dict[str, float] = {}
        optimizer_steps = {"policy_loss_global": max(n_micro / actor.gradient_accumulation_steps(), 1.0),
                           "value_loss_global": max(n_micro / critic.gradient_accumulation_steps(), 1.0)}
        for key, total in zip(keys, totals):
            if key in optimizer_steps:
                out[key.removesuffix("_global")] = total / optimizer_steps[key]
            else:
                out[key] = total / (world * n_micro)
        return out

    # ---------------------------------------------------------------------------------------------
    def step(self, batch: dict[str, Any], step: int,
             ptx_batches: Iterator[dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """One PPO step: experience, update, EMA, KL-controller update. Returns the step's metrics."""
        t0 = time.perf_counter()
        exp = self.make_experience(batch, step)
        rollout = self.rollout_metrics(exp)
        t1 = time.perf_counter()
        stats = self.train_on(exp, step, ptx_batches)
        t_train = time.perf_counter() - t1
        if self.has_ema:
            ema_update(self.registry["ema"].module, self.registry["actor"].module, self.settings.ema_decay)
        n_rows = exp.sequences.shape[0] * self.registry.world_size
        self.kl_ctl.update(rollout["kl"], n_rows)
        gen_tokens = all_reduce_sum(exp.action_mask.float().sum().reshape(1))[0].item()
        t_gen = exp.timings["generation_s"]
        metrics = {
            **rollout,
            **stats,
            "kl_coef": self.kl_ctl.value,
            "time/generation_s": t_gen,
            "time/experience_s": exp.timings["experience_s"],
            "time/train_s": t_train,
            "time/step_s": time.perf_counter() - t0,
            # tokens kept (up to EOS) on all ranks per second of generation; ms per decoding step
            "gen/tokens_per_s": gen_tokens / max(t_gen, 1e-9),
            "gen/ms_per_token": 1000.0 * t_gen / max(exp.timings["generation_steps"], 1.0),
        }
        return metrics

    def rollout_metrics(self, exp: Experience) -> dict[str, float]:
        """Reward, KL and length statistics of a rollout, over all ranks."""
        mask = exp.action_mask.float()
        kl_seq = (ppo.kl_k1(exp.logprobs, exp.ref_logprobs) * mask).sum(-1)
        length = mask.sum(-1)
        score_mean, score_std, _ = _global_moments(exp.score)
        kl_mean, _, _ = _global_moments(kl_seq)
        len_mean, _, _ = _global_moments(length)
        ret_mean, _, _ = _global_moments((exp.rewards * mask).sum(-1))
        out = {"reward/mean": score_mean, "reward/std": score_std, "kl": kl_mean,
               "response_length": len_mean, "reward/total_mean": ret_mean,
               "values/mean": all_reduce_mean(ppo.masked_mean(exp.values, mask))}
        if self.judge is not None and self.decode is not None and exp.prompts:
            answers = self.decode(exp.response_ids)
            judged = torch.tensor([self.judge(p, a) for p, a in zip(exp.prompts, answers)], dtype=torch.float64)
            out["judge/mean"], _, _ = _global_moments(judged)
        return out

    # ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------


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
) -> dict[str, Any]:
    """Answers of ``role`` to every rank's prompt batches, judged and/or scored (collective).

    Returns global means: ``judge`` (if a judge is given), ``reward`` (with ``reward_role``), ``kl``
    (exact per-token KL to ``ref_role`` summed over each answer), ``response_length``; and ``samples``: the first
    ``n_samples`` (prompt, answer) pairs of this rank.

    Sampling (``generation.do_sample``) draws from a private RNG stream seeded by ``(seed, rank)``:
    every evaluation of a run sees the same noise, and the training RNG stream is left untouched (a
    resumed run continues identically whether or not it evaluated in between).
    """
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed * 7 + registry.rank * 104_729)
        return _evaluate_policy(registry, batches, generation, eos_token_id, pad_token_id, decode, role, judge,
                                reward_role, ref_role, n_samples)


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
) -> dict[str, Any]:
    device = registry.device
    totals = torch.zeros(5, dtype=torch.float64)  # judge, reward, kl, length, rows
    samples: list[tuple[str, str]] = []
    for batch in batches:
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        response = generate(registry, ids, mask, generation, eos_token_id, pad_token_id, role=role)
        action = ppo.action_mask(response, eos_token_id, pad_token_id)
        answers = decode(response)
        seq = torch.cat([ids, response], dim=1)
        attention = torch.cat([mask, action.to(mask.dtype)], dim=1)
        row = torch.zeros(5, dtype=torch.float64)
        if judge is not None:
            row[0] = sum(judge(p, a) for p, a in zip(batch["prompts"], answers))
        if reward_role is not None:
            row[1] = sequence_scores(registry[reward_role], seq, attention).double().sum().cpu()
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
    judge_sum, reward_sum, kl_sum, length_sum, n = all_reduce_sum(totals).tolist()
    n = max(n, 1.0)
    out: dict[str, Any] = {"response_length": length_sum / n, "samples": samples}
    if judge is not None:
        out["judge"] = judge_sum / n
    if reward_role is not None:
        out["reward"] = reward_sum / n
    if ref_role is not None:
        out["kl"] = kl_sum / n
    return out

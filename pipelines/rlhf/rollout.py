"""Experience making: generate responses, then score them with every role.

One call of :func:`make_experience` samples ``n_samples_per_prompt`` responses per prompt (the copies of a prompt are
adjacent rows on the same rank: see advantages.py) and runs, on every rank, one forward of each role of its
:class:`RolloutSpec`: the actor and the ref for log-probs, the critic (optional) for values, each reward-model role for
a score; reward functions score the decoded texts (with the rows' other dataset columns, the collator's ``columns``,
repeated with their prompts). Advantages are left to the estimator (GAE in ppo_trainer.py, the critic-free family in
grpo.py).

A reward model or critic with its own tokenizer gets the rows decoded and encoded again with it
(``RewardSource.retokenizer``, ``RolloutSpec.critic_retokenizer``); the critic's values are then read at the positions
that end the same text as the actor's tokens (``Experience.critic_index``), and the update feeds the critic the same
re-encoded rows.

Every function here is collective: all ranks call it with the same number of rows, so every rank runs the same number
of forwards of every role (under ZeRO-3 each forward gathers layers from all ranks, and a rank that skipped one would
hang the others). Shapes: ``B`` rows per rank (prompts x samples), ``C`` padded prompt length, ``T`` response length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from multiengine.engines import EngineRegistry, all_reduce_sum
from multiengine.engines.packing import lm_forward

from . import ppo
from .generation import GenerationSettings, generate_routed, rollout_done, vllm_generate
from .rewards import RewardSource, compute_scores, reencoded
from .scoring import role_logprobs, role_values, scoring_mode

__all__ = ["Experience", "RolloutSpec", "StepStats", "concat_experiences", "expand_prompts", "make_experience",
           "rollout_metrics", "rollout_spec", "sampling_seed", "step_timings"]

Judge = Callable[[str, str], float]
Decode = Callable[[torch.Tensor], list[str]]

_ROW_TENSORS = ("sequences", "attention_mask", "action_mask", "logprobs", "score", "ref_logprobs", "values",
                "rewards", "advantages", "returns", "critic_sequences", "critic_attention_mask", "critic_index",
                "rollout_logprobs", "routing", "versions")


@dataclass
class Experience:
    """One frozen rollout on this rank. All ``[B, T]`` tensors are zero outside ``action_mask``."""

    sequences: torch.Tensor  # [B, L] prompt (left padded) + response (padded after the first EOS)
    attention_mask: torch.Tensor  # [B, L]: prompt tokens and actions
    context_length: int  # C
    action_mask: torch.Tensor  # [B, T] bool prefix mask: up to and including the first EOS
    logprobs: torch.Tensor | None  # [B, T] rollout (old) policy; None: the update's own, detached (one pass)
    score: torch.Tensor  # [B] weighted sum of the reward sources (after the no-EOS penalty)
    ref_logprobs: torch.Tensor | None = None  # [B, T]; None without a ref role
    values: torch.Tensor | None = None  # [B, T] critic at rollout time; None without a critic
    rewards: torch.Tensor | None = None  # [B, T] per-token rewards (set by the estimator)
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] value targets (GAE only)
    # a critic with its own tokenizer: the rows re-encoded for it [B, L'], and for each action the position
    # [B, T] whose value is V(s_t); None when the critic reads the actor's sequences
    critic_sequences: torch.Tensor | None = None
    critic_attention_mask: torch.Tensor | None = None
    critic_index: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None  # [B, T] the sampler's (vLLM, or an MoE's generate) of its tokens
    routing: torch.Tensor | None = None  # [B, L, layers, k] the experts each token went to while sampling (replay)
    versions: torch.Tensor | None = None  # [B] the policy version (updates behind it) that generated each row
    scored_version: int | None = None  # the version whose log-probs ``logprobs`` holds (None: the generating one)
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)  # source name -> [B] unweighted
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)  # the rows' other dataset columns, one value a row
    group_size: int = 1  # consecutive rows that answer the same prompt
    timings: dict[str, float] = field(default_factory=dict)
    # per-row figures reported as step means (e.g. a multi-turn episode's success and turns), key -> [B]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def response_ids(self) -> torch.Tensor:
        return self.sequences[:, self.context_length:]

    def rows(self, index: torch.Tensor) -> Experience:
        """The rows ``index`` (a minibatch; no longer grouped)."""
        take: dict[str, Any] = {}
        for key in _ROW_TENSORS:
            value = getattr(self, key)
            take[key] = None if value is None else value[index]
        picked = index.tolist()
        return Experience(
            context_length=self.context_length, **take,
            reward_parts={k: v[index] for k, v in self.reward_parts.items()},
            prompts=[self.prompts[i] for i in picked] if self.prompts else [],
            responses=[self.responses[i] for i in picked] if self.responses else [],
            columns={k: [v[i] for i in picked] for k, v in self.columns.items()},
            extras={k: v[index] for k, v in self.extras.items()},
        )


def _pad(x: torch.Tensor, left: int, right: int, value: float = 0) -> torch.Tensor:
    return torch.nn.functional.pad(x, (left, right), value=value) if left or right else x


def concat_experiences(parts: list[Experience], pad_token_id: int, group_size: int) -> Experience:
    """Rows of several rollouts in one :class:`Experience` (dynamic sampling's rounds): each part's prompts
    left padded to the longest ``C``, its responses right padded to the longest ``T`` (padding is masked out
    of attention and actions, and positions count real tokens only). Timings are summed."""
    if len(parts) == 1:
        parts[0].group_size = group_size
        return parts[0]
    C = max(p.context_length for p in parts)
    T = max(p.sequences.shape[1] - p.context_length for p in parts)
    cols: dict[str, list[torch.Tensor]] = {}
    for p in parts:
        left, right = C - p.context_length, T - (p.sequences.shape[1] - p.context_length)
        for key in _ROW_TENSORS:
            value = getattr(p, key)
            if value is None or key.startswith("critic_"):
                if value is not None:
                    raise ValueError("concat_experiences: rows re-encoded for a critic cannot be joined.")
                continue
            if key == "sequences":
                value = _pad(value, left, right, pad_token_id)
            elif key == "routing":  # [B, L, layers, k]: -1 = no record
                value = _pad(value.permute(0, 2, 3, 1), left, right, -1).permute(0, 3, 1, 2)
            elif key == "attention_mask":
                value = _pad(value, left, right)
            elif value.dim() == 2:  # [B, T]
                value = _pad(value, 0, right)
            cols.setdefault(key, []).append(value)
    take = {**dict.fromkeys(_ROW_TENSORS), **{k: torch.cat(v) for k, v in cols.items()}}
    first = parts[0]
    timings: dict[str, float] = {}
    for p in parts:
        for k, v in p.timings.items():
            timings[k] = timings.get(k, 0.0) + v
    return Experience(
        context_length=C, **take,
        reward_parts={k: torch.cat([p.reward_parts[k] for p in parts]) for k in first.reward_parts},
        prompts=[x for p in parts for x in p.prompts], responses=[x for p in parts for x in p.responses],
        columns={k: [x for p in parts for x in p.columns[k]] for k in first.columns},
        group_size=group_size, timings=timings,
        extras={k: torch.cat([p.extras[k] for p in parts]) for k in first.extras})


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of one rollout: from ``(seed, step, rank)``, so a resumed run, or the same run at
    another ZeRO stage, samples the same tokens."""
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**63 - 1)


def expand_prompts(batch: dict[str, Any], n: int) -> dict[str, Any]:
    """Each prompt ``n`` times in consecutive rows (``[B, C] -> [B*n, C]``; texts, conversations and each of
    the ``columns`` likewise)."""
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
    if n == 1:
        return batch
    rows = batch["input_ids"].shape[0] if "input_ids" in batch else None

    def repeat(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.repeat_interleave(n, dim=0)
        if isinstance(v, (list, tuple)) and (rows is None or len(v) == rows):  # prompts, prompt_messages
            return [x for x in v for _ in range(n)]
        return v

    return {k: {c: repeat(x) for c, x in v.items()} if k == "columns" else repeat(v) for k, v in batch.items()}


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout samples and scores with: the sampling settings (``temperature`` also scales every log-prob),
    the tokenizer's EOS and pad ids, the reward sources (summed with their weights), ``decode`` (``response_ids
    [B, T] -> texts``, needed by reward functions and the judge), an optional ``judge(prompt, answer)`` logged as
    ``judge/mean``, the roles (``ref`` and ``critic`` may be None), the run's seed (sampling seeds derive from
    ``(seed, step, rank)``), a ``Retokenizer`` to the critic's tokenizer when it differs from the actor's, and
    ``old_logprobs`` False: no actor forward for the rollout's log-probs (one pass over the rollout: the update takes
    its own, detached, so the ratio is 1 by construction; GRPOTrainer decides)."""

    generation: GenerationSettings
    eos_token_id: int
    pad_token_id: int
    rewards: Sequence[RewardSource] = ()
    decode: Decode | None = None
    judge: Judge | None = None
    actor: str = "actor"
    ref: str | None = "ref"
    critic: str | None = None
    seed: int = 0
    critic_retokenizer: Any = None
    old_logprobs: bool = True


def rollout_spec(answers: Any, tokenizer: Any, rewards: Sequence[RewardSource], seed: int, **roles: Any
                 ) -> RolloutSpec:
    """The rollouts' spec: sampled as the evaluation ``answers`` (a ``PolicyAnswers``), judged alike, decoded with
    the actor's ``tokenizer``; ``roles``: its role names (and the critic's retokenizer)."""
    return RolloutSpec(answers.sampled, tokenizer.eos_token_id, tokenizer.pad_token_id, rewards,
                       lambda ids: tokenizer.batch_decode(ids.cpu(), skip_special_tokens=True), answers.judge,
                       seed=seed, **roles)


@torch.no_grad()
def make_experience(registry: EngineRegistry, batch: dict[str, Any], step: int, spec: RolloutSpec, *,
                    n_samples_per_prompt: int = 1, no_eos_penalty: float = 0.0,
                    sample_seed: int | None = None, sampled: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> Experience:
    """Sample and score one rollout (collective): ``n_samples_per_prompt`` completions of each prompt of ``batch``
    (a :class:`PromptCollator` batch: left-padded ``input_ids`` / ``attention_mask`` ``[P, C]``, ``prompts`` texts,
    optionally ``columns``, the rows' other dataset columns passed to reward functions by name) in consecutive rows,
    one forward of each role of ``spec``, the score minus ``no_eos_penalty`` (0 = off) for answers without EOS.
    ``sample_seed`` None = :func:`sampling_seed` of ``(spec.seed, step, rank)``; ``sampled``: the responses ``[B, T]``
    and their sampler's log-probs, generated elsewhere (rollout ranks), scored here. Returns an :class:`Experience` of
    ``P * n_samples_per_prompt`` rows without rewards/advantages."""
    device = registry.device
    batch = expand_prompts(batch, n_samples_per_prompt)
    prompt_ids = batch["input_ids"].to(device)
    prompt_mask = batch["attention_mask"].to(device)
    C = prompt_ids.shape[1]

    # 1. sample (seeded per step and rank: resume and stage changes sample the same tokens)
    t0 = time.perf_counter()
    torch.manual_seed(sampling_seed(spec.seed, step, registry.rank) if sample_seed is None else sample_seed)
    eos, generation, critic = spec.eos_token_id, spec.generation, spec.critic
    rollout_logprobs, routing, sync = None, None, {}
    if sampled is not None:
        response, rollout_logprobs = (t.to(device) for t in sampled)
    elif generation.engine == "vllm":
        response, rollout_logprobs = vllm_generate(registry, prompt_ids, prompt_mask, generation, eos,
                                                   spec.pad_token_id, spec.actor)
        sync = rollout_done(registry, spec.actor)
    else:  # an MoE actor's: the routing of every token and the sampled tokens' log-probs too (None when dense)
        response, routing, rollout_logprobs = generate_routed(registry, prompt_ids, prompt_mask, generation, eos,
                                                              spec.pad_token_id, role=spec.actor)
    replay = routing if getattr(generation, "router_replay", "off") == "rollout" else None  # RolloutGenerationSettings
    t_gen = time.perf_counter() - t0

    # 2. sequences; actions = the prefix up to and including the first EOS (a pad id sampled before it is
    #    an ordinary token, attended to here as it was while sampling)
    t1 = time.perf_counter()
    sequences = torch.cat([prompt_ids, response], dim=1)
    action = ppo.action_mask(response, eos)
    attention = torch.cat([prompt_mask, action.to(prompt_mask.dtype)], dim=1)
    action_f = action.float()

    # 3. one forward per role, every rank
    logprobs = None
    if spec.old_logprobs:
        logprobs = role_logprobs(registry, spec.actor, sequences, attention, C, generation.temperature,
                                 replay) * action_f
    ref_logprobs = None
    if spec.ref is not None:
        ref_logprobs = role_logprobs(registry, spec.ref, sequences, attention, C, generation.temperature,
                                     replay if getattr(generation, "replay_ref", False) else None) * action_f
    prompts = list(batch.get("prompts", []))
    messages = batch.get("prompt_messages")
    values, critic_rows = None, {}
    if critic is not None and spec.critic_retokenizer is not None and spec.critic_retokenizer.needed:
        # the critic reads the same text in its own tokens; V(s_t) sits where the text before action t ends
        enc = reencoded(spec.critic_retokenizer, sequences, attention, C, prompts or None, messages, align=True)
        with scoring_mode(registry, critic) as engine:
            full = lm_forward(engine, enc["input_ids"], enc["attention_mask"]).float()
        values = full.gather(1, enc["state_index"]) * action_f
        critic_rows = {"critic_sequences": enc["input_ids"], "critic_attention_mask": enc["attention_mask"],
                       "critic_index": enc["state_index"]}
    elif critic is not None:
        values = role_values(registry, critic, sequences, attention, C) * action_f

    # 4. the reward: weighted sum of reward-model scores and reward-function values
    texts = spec.decode(response) if spec.decode is not None else []
    columns = {k: list(v) for k, v in (batch.get("columns") or {}).items()}
    score, parts = compute_scores(registry, spec.rewards, sequences, attention, prompts or None, texts or None,
                                  context_length=C, prompt_messages=messages, columns=columns)
    if no_eos_penalty:
        score = ppo.apply_no_eos_penalty(score, response, eos, no_eos_penalty)
    t_exp = time.perf_counter() - t1
    return Experience(
        sequences=sequences, attention_mask=attention, context_length=C, action_mask=action,
        logprobs=logprobs, score=score, ref_logprobs=ref_logprobs, values=values,
        reward_parts=parts, prompts=prompts, responses=texts, columns=columns, group_size=n_samples_per_prompt,
        **critic_rows, rollout_logprobs=None if rollout_logprobs is None else rollout_logprobs * action_f,
        routing=replay,
        timings={"generation_s": t_gen, "experience_s": t_exp, "generation_steps": float(response.shape[1]), **sync},
    )


class StepStats:
    """The scalar statistics of one step from every rank, reduced by ONE all-reduce: each entry puts local sums into
    one float64 vector, with a function of their global sums that gives its value; :meth:`reduce` sums the vector
    over ranks at once (collective) and returns ``{key: value}``. Every rank adds the same entries in the same order.
    The trainers reduce a rollout's metrics, the update's statistics and the throughput together (each collective on
    gloo costs about a millisecond, whatever its size)."""

    def __init__(self) -> None:
        self._sums: list[float] = []
        self._entries: list[tuple[str, int, int, Callable[..., float]]] = []

    def add(self, key: str, sums: Sequence[float | torch.Tensor], finish: Callable[..., float]) -> None:
        """``key = finish(*global sums)``."""
        start = len(self._sums)
        self._sums.extend(float(v) for v in sums)
        self._entries.append((key, start, len(self._sums), finish))

    def mean(self, key: str, x: torch.Tensor) -> None:
        """Mean of all entries of ``x`` on all ranks."""
        x = x.detach().double().reshape(-1)
        self.add(key, [x.sum(), x.numel()], lambda total, n: total / max(n, 1.0))

    def nanmean(self, key: str, x: torch.Tensor) -> None:
        """Mean of the entries of ``x`` that are not ``nan``, on all ranks (``nan`` when there are none)."""
        x = x.detach().double().reshape(-1)
        kept = ~torch.isnan(x)
        self.add(key, [x[kept].sum(), kept.sum()], lambda total, n: total / n if n else math.nan)

    def moments(self, mean_key: str, std_key: str, x: torch.Tensor) -> None:
        """Mean and population std of all entries of ``x`` on all ranks."""
        x = x.detach().double().reshape(-1)
        self.add(mean_key, [x.sum(), x.numel()], lambda total, n: total / max(n, 1.0))
        self.add(std_key, [x.sum(), (x * x).sum(), x.numel()], _std)

    def reduce(self) -> dict[str, float]:
        """Every entry's value over all ranks (collective: one all-reduce)."""
        totals = all_reduce_sum(torch.tensor(self._sums, dtype=torch.float64)).tolist() if self._sums else []
        return {key: float(finish(*totals[start:end])) for key, start, end, finish in self._entries}


def _std(total: float, total_sq: float, n: float) -> float:
    mean = total / max(n, 1.0)
    return math.sqrt(max(total_sq / max(n, 1.0) - mean * mean, 0.0))


def rollout_metrics(exp: Experience, judge: Judge | None = None, stats: StepStats | None = None) -> dict[str, float]:
    """Reward, per-source reward, KL, length (and judge) statistics of a rollout, over all ranks
    (collective, one all-reduce: every rank computes the same keys). With ``stats``, the entries are
    added to it instead (reduced by the caller with the step's other statistics) and ``{}`` is returned."""
    own = stats is None
    stats = StepStats() if stats is None else stats
    mask = exp.action_mask.float()
    stats.moments("reward/mean", "reward/std", exp.score)
    stats.mean("response_length", mask.sum(-1))
    for name, value in exp.reward_parts.items():  # unweighted; rows a function returned None for are left out
        stats.nanmean(f"reward/{name}", value)
    if exp.ref_logprobs is not None and exp.logprobs is not None:
        stats.mean("kl", (ppo.kl_k1(exp.logprobs, exp.ref_logprobs) * mask).sum(-1))
    if exp.rewards is not None:
        stats.mean("reward/total_mean", (exp.rewards * mask).sum(-1))
    if exp.values is not None:
        # the mean over ranks of each rank's masked mean
        stats.add("values/mean", [ppo.masked_mean(exp.values, mask), 1.0], lambda total, n: total / n)
    if exp.group_size > 1:
        # groups whose completions all scored the same carry no signal for the group estimators
        g = exp.score.reshape(-1, exp.group_size)
        stats.mean("reward/group_std", g.std(-1))
        stats.mean("reward/flat_groups", (g.max(-1).values == g.min(-1).values).double())
    for name, value in exp.extras.items():
        stats.mean(name, value)
    if judge is not None and exp.prompts and exp.responses:
        judged = torch.tensor([judge(p, a) for p, a in zip(exp.prompts, exp.responses)], dtype=torch.float64)
        stats.mean("judge/mean", judged)
    return stats.reduce() if own else {}


def step_timings(exp: Experience, t_train: float, t_step: float, stats: StepStats | None = None) -> dict[str, float]:
    """Time per phase and generation throughput of one step (tokens kept on all ranks per second of
    generation; ms per decoding step). Collective (one all-reduce for the token count), or, with
    ``stats``, the token count joins the caller's reduction (``gen/tokens_per_s`` is then in its result)."""
    t_gen = exp.timings["generation_s"]
    out = {
        "time/generation_s": t_gen,
        "time/experience_s": exp.timings["experience_s"],
        "time/train_s": t_train,
        "time/step_s": t_step,
        "gen/ms_per_token": 1000.0 * t_gen / max(exp.timings["generation_steps"], 1.0),
        **{f"rollout/{k}": exp.timings[k] for k in ("sync_s", "sync_bytes") if k in exp.timings},
    }
    own = stats is None
    target = StepStats() if own else stats
    target.add("gen/tokens_per_s", [exp.action_mask.float().sum()], lambda tokens: tokens / max(t_gen, 1e-9))
    if own:
        out.update(target.reduce())
    return out

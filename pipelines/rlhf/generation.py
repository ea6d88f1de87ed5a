"""Generation from a (possibly ZeRO-3 partitioned) actor, two ways.

``mode="gather"`` (default): ``registry.generation(role)`` gathers the actor once per batch and detaches DeepSpeed's
per-module hooks, so every token runs on full local weights without communication (TRL's
``unwrap_model_for_generation``); it costs one full copy of the actor per rank while it runs.
``mode="per_token"``: ZeRO-3's ``generate(synced_gpus=True)``: every layer is gathered and released per token (slow
on big models, DeepSpeedExamples#764), but no rank ever holds the whole actor. Below stage 3 both are plain
``generate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from multiengine.engines import EngineRegistry, moe
from multiengine.engines.settings import Choice, Range, Settings, setting

from .ppo import truncate_after_eos

logger = logging.getLogger(__name__)

SCHEDULES = ("sync", "one_step_off", "async")

__all__ = ["SCHEDULES", "GenerationSettings", "RolloutGenerationSettings", "generate", "generate_routed",
           "position_ids_from_mask", "engine_generate", "module_generate", "rollout_done", "vllm_generate"]


@dataclass(frozen=True)
class GenerationSettings(Settings):
    """How answers are sampled (rollouts and evaluation); ``temperature`` also divides the logits of the PPO/GRPO
    log-probs."""

    max_new_tokens: int = setting(8, "tokens generated per answer", Range(1))
    temperature: float = setting(1.0, "sampling temperature", Range(0, min_exclusive=True))
    top_k: int = setting(0, "0 = off", Range(0))
    top_p: float = setting(1.0, "nucleus sampling (1 = off)", Range(0, 1, min_exclusive=True))
    mode: str = setting("gather", "gather (the actor gathered once per batch) | per_token (ZeRO-3 synced_gpus)",
                        Choice("gather", "per_token"), when="engine=hf")
    engine: str = setting("hf", "hf (transformers generate on the actor) | vllm (the rollout role's vLLM engine, its "
                                "weights synced from the actor after each step: roles.rollout.*, docs/vllm.md)",
                          Choice("hf", "vllm"))
    # greedy answers are the same settings with do_sample off (not a config key: a run samples, eval.greedy adds these)
    do_sample: bool = dataclasses.field(default=True, metadata={"hidden": True})

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if k != "do_sample"}  # the section's keys only

    def greedy(self) -> GenerationSettings:
        # dataclasses.replace: Settings.replace passes a changed field twice (engines/settings.py)
        return dataclasses.replace(self, do_sample=False)


@dataclass(frozen=True)
class RolloutGenerationSettings(GenerationSettings):
    """:class:`GenerationSettings` of a recipe that trains on its rollouts (rlhf_grpo, rlhf_ppo, distill's on-policy
    steps): also router replay for MoE policies."""

    router_replay: str = setting("off", "MoE policies: off | rollout (the experts each token was routed to while "
                                        "sampling are imposed in the trainer's passes over that rollout, docs/moe.md)",
                                 Choice("off", "rollout"), when="engine=hf")
    replay_ref: bool = setting(False, "the ref's log-probs on the rollout's routing too", when="router_replay=rollout")
    schedule: str = setting("sync", "sync (generate, then train on it) | one_step_off (step t+1's rollout is "
                                    "generated with step t's weights while step t trains) | async (rollouts run up "
                                    "to max_staleness steps ahead of the trainer); docs/async.md",
                            Choice(*SCHEDULES))
    max_staleness: int = setting(2, "async: how many steps older than the policy a trained sample may be (the "
                                    "rollouts run this many steps ahead; 0 = sync)", Range(0), when="schedule=async")

    @property
    def depth(self) -> int:
        """How many steps ahead of the trainer the rollouts run: 0 (sync), 1 (one_step_off), max_staleness."""
        return {"sync": 0, "one_step_off": 1}.get(self.schedule, self.max_staleness)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` positions counting real tokens only (left padding safe), as ``generate`` computes them."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


@torch.no_grad()
def generate(
    registry: EngineRegistry,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationSettings,
    eos_token_id: int,
    pad_token_id: int,
    role: str = "actor",
) -> torch.Tensor:
    """Responses to left-padded prompts; every rank must call it (same number of times).

    Args:
        input_ids: ``[B, C]`` left-padded prompts.
        attention_mask: ``[B, C]``.

    Returns:
        ``[B, T]`` response tokens (``T <= max_new_tokens``), padded with ``pad_token_id`` after the
        first EOS (rows that stopped early are not continued into the padding).
    """
    if settings.engine == "vllm" and registry.rollout(role) is not None:  # roles without one: transformers
        return vllm_generate(registry, input_ids, attention_mask, settings, eos_token_id, pad_token_id, role)[0]
    return _hf_generate(registry, input_ids, attention_mask, settings, (eos_token_id, pad_token_id), role)[0]


def _hf_generate(registry: EngineRegistry, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 settings: GenerationSettings, ids: tuple[int, int], role: str, record: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """transformers ``generate`` on ``role`` (``ids``: EOS and pad); with ``record`` (an MoE model) also the experts
    every token was routed to, ``[B, C + T, layers, k]``, and the ``[B, T]`` log-probs of the sampled tokens under
    the logits that sampled them (over the temperature, as the trainer's)."""
    eos_token_id, pad_token_id = ids
    r = registry.role(role)
    record = record and bool(moe.routers(r.module))
    synced = settings.mode == "per_token" and r.backend == "deepspeed" and r.stage == 3 and registry.world_size > 1
    kwargs = {**_generate_kwargs(settings, eos_token_id, pad_token_id), "synced_gpus": synced}
    if record:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    with registry.generation(role, gather=settings.mode == "gather") as module, \
            moe.tapped(module, record=True) if record else contextlib.nullcontext() as tap:
        out = module.generate(input_ids=input_ids, attention_mask=attention_mask, **moe.router_logits_off(module),
                              **kwargs)
    sequences = out.sequences if record else out
    response = truncate_after_eos(sequences[:, input_ids.shape[1]:], eos_token_id, pad_token_id)
    if not record or tap is None:
        return response, None, None
    routing = moe.generated_routing(tap.passes, input_ids.shape[0], sequences.shape[1])
    return response, routing, _sampled_logprobs(out.logits, response, settings.temperature)


def _generate_kwargs(settings: GenerationSettings, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """transformers ``generate``'s sampling arguments for ``settings``."""
    kwargs: dict[str, Any] = dict(max_new_tokens=settings.max_new_tokens, do_sample=settings.do_sample,
                                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, use_cache=True)
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    return kwargs


def _sampled_logprobs(logits: tuple[torch.Tensor, ...], response: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of the sampled tokens under the logits that sampled them (``generate``'s
    ``output_logits``, one ``[B, V]`` per step), over the temperature as the trainer's."""
    logprobs = torch.log_softmax(torch.stack(logits, dim=1).float() / temperature, -1)
    return logprobs.gather(-1, response.unsqueeze(-1).clamp(min=0)).squeeze(-1)


@torch.no_grad()
def generate_routed(registry: EngineRegistry, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    settings: GenerationSettings, eos_token_id: int, pad_token_id: int, role: str = "actor"
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`generate` with transformers, and for an MoE model the experts each token was routed to (``[B, C + T,
    layers, k]``, router replay's record) and the sampled tokens' log-probs (``[B, T]``, for the rollout-vs-trainer
    mismatch); ``None, None`` for a dense one."""
    return _hf_generate(registry, input_ids, attention_mask, settings, (eos_token_id, pad_token_id), role, True)


def rollout_done(registry: EngineRegistry, role: str = "actor") -> dict[str, float]:
    """After a rollout on role ``role``'s vLLM engine: the engine asleep (GPU sleep mode: its memory back to the
    update) and the syncs since the last rollout, as timings (``sync_s``, ``sync_bytes``)."""
    engine = registry.rollout(role)
    engine.sleep()
    stats = engine.take_sync_stats()
    return {"sync_s": stats.seconds, "sync_bytes": float(stats.bytes)}


def vllm_sampling(settings: GenerationSettings) -> dict[str, float]:
    """The sampling of ``settings`` as vLLM takes it (temperature 0 = greedy; top_k 0 = off in both)."""
    if not settings.do_sample:
        return {"temperature": 0.0}
    return {"temperature": settings.temperature, "top_k": settings.top_k, "top_p": settings.top_p}


@torch.no_grad()
def vllm_generate(registry: EngineRegistry, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  settings: GenerationSettings, eos_token_id: int, pad_token_id: int,
                  role: str = "actor") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`generate` on role ``role``'s rollout engine (synced from the role first when it stepped; collective),
    and the log-prob ``[B, T]`` of each sampled token under the sampling distribution (0 after EOS). Request ``i``
    is seeded from the torch RNG, so a seeded rollout samples the same tokens again."""
    engine = registry.rollout(role)
    if engine is None:
        raise ValueError(f"generation.engine=vllm but role {role!r} has no rollout engine (registry.add_rollout).")
    return engine_generate(engine, input_ids, attention_mask, settings, eos_token_id, pad_token_id)


@torch.no_grad()
def engine_generate(engine: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: GenerationSettings,
                    eos_token_id: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vllm_generate` on a vLLM ``engine`` (VLLMRollout) itself."""
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
    tokens, logps = engine.generate(prompts, settings.max_new_tokens, vllm_sampling(settings), seeds, [eos_token_id])
    T = max([1, *map(len, tokens)])
    response = torch.full((len(tokens), T), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(tokens), T)
    for i, (ids, lps) in enumerate(zip(tokens, logps)):
        response[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        logprobs[i, :len(lps)] = torch.tensor(lps)
    return response.to(input_ids.device), logprobs.to(input_ids.device)


@torch.no_grad()
def module_generate(module: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    settings: GenerationSettings, eos_token_id: int, pad_token_id: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers ``generate`` on a plain ``module`` (a rollout rank's copy of the actor): the ``[B, T]`` responses
    and the log-probs of the sampled tokens under the logits that sampled them (over the temperature)."""
    out = module.generate(input_ids=input_ids, attention_mask=attention_mask, output_logits=True,
                          return_dict_in_generate=True, **_generate_kwargs(settings, eos_token_id, pad_token_id))
    response = truncate_after_eos(out.sequences[:, input_ids.shape[1]:], eos_token_id, pad_token_id)
    return response, _sampled_logprobs(out.logits, response, settings.temperature)

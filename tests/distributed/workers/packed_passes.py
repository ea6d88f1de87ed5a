"""Packed passes against padded ones through real registries on 2 ranks, each rank holding its own rows of other
lengths (left-padded prompts, right-padded answers, as a rollout has them):

  families  per family (argv's folders) and ZeRO stage (2, 3): actor, ref, critic and reward built padded, then
            packed, with the same seed: the actor's and ref's log-probs, the critic's values and the reward's scores
            of the rows, then one PPO update (train_on_experience: 2 epochs of 2 optimizer steps, actor and critic):
            its losses and each trainable role's weights after it and their change (SGD, so the change is -lr x
            the gradients). At ZeRO-2, packed once more with positions running on across a packed row instead of
            restarting per sequence (engines.packing.pack patched): scores, and the update's losses and changes.
  budget    per ZeRO stage, packed actor and critic: the same update with micro_batch_size rows per micro-batch
            (grad_accum of them a step) and with a token budget (two: more micro-batches than grad_accum, and
            fewer), with a pretraining (ptx) term; rank 0's rows are short, rank 1's long, so alone they would
            split a step into different numbers of micro-batches. Each rank's micro-batches per
            optimizer step are recorded (the test compares the ranks'), with the weights after the update.

argv: out_dir, a JSON file {family: folder} (each a tiny causal LM saved with its tokenizer).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import sys

import torch
from common import dump, finish
from multiengine.engines import EngineRegistry, OptimSpec, Placement, barrier, frozen_role, packing, trainable_role
from multiengine.engines.packing import budget_split
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.ppo_trainer import PPOSettings
from multiengine.pipelines.rlhf.roles import causal_lm, scalar_model
from multiengine.pipelines.rlhf.rollout import Experience, RolloutSpec
from multiengine.pipelines.rlhf.scoring import eval_mode, role_logprobs, role_values, sequence_scores
from multiengine.pipelines.rlhf.update import train_on_experience

FOLDERS: dict[str, str] = json.load(open(sys.argv[2]))
C, T, ROWS = 8, 10, 8  # prompt width, answer width, rows per rank
SETTINGS = PPOSettings(rollout_batch_size=ROWS, epochs=2, kl_coef=0.0)
PTX_SETTINGS = dataclasses.replace(SETTINGS, ptx_coef=0.5)
# the update's continuous figures (the clip fractions count tokens: one at a clip edge may flip on 1e-7); a token
# budget changes the micro-batches that entropy and approx_kl are means over, not the per-step losses
LOSSES = ("policy_loss", "value_loss", "entropy", "approx_kl")
STEP_LOSSES = ("policy_loss", "value_loss")
TRAINED = ("actor", "critic")
LR = 0.05  # SGD: the weights move by -LR x the step's gradient


def rows(rank: int, short: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``[ROWS, C + T]`` rows: prompts of 2..C tokens left padded, answers of 1..T right padded (all short
    with ``short`` True, all long with False), and the answers' ``[ROWS, T]`` action mask."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(4, 60, (ROWS, C + T), generator=g)
    mask = torch.zeros(ROWS, C + T, dtype=torch.long)
    for b in range(ROWS):
        lo, hi = {None: (1, T), True: (1, 2), False: (T - 1, T)}[short]
        p, a = int(torch.randint(2, C + 1, (1,), generator=g)), int(torch.randint(lo, hi + 1, (1,), generator=g))
        if short is not None:
            p = 2 if short else C
        mask[b, C - p:C + a] = 1
    return ids * mask, mask, mask[:, C:].bool()


def experience(registry: EngineRegistry, ids: torch.Tensor, mask: torch.Tensor, action: torch.Tensor,
               scored: dict | None = None) -> Experience:
    """The rows scored by the registry's roles (actor and ref log-probs, critic values, reward scores, kept in
    ``scored``), with seeded advantages and returns."""
    logp = role_logprobs(registry, "actor", ids, mask, C) * action
    values = role_values(registry, "critic", ids, mask, C) * action
    ref = role_logprobs(registry, "ref", ids, mask, C) * action if "ref" in registry.names() else None
    if scored is not None:
        with eval_mode(registry, "reward") as engine, torch.no_grad():
            scored["scores"] = sequence_scores(engine, ids, mask)
        scored.update(logprobs=logp, ref_logprobs=ref, values=values)
    g = torch.Generator().manual_seed(7 + registry.rank)
    advantages = torch.randn(action.shape, generator=g) * action
    return Experience(ids, mask, C, action, logp, torch.zeros(ROWS), ref_logprobs=ref, values=values,
                      advantages=advantages, returns=(values + torch.randn(action.shape, generator=g)) * action)


def build(folder: str, stage: int, packed: bool, frozen: bool = True, budget: int = 0, micro: int = 2,
          accum: int = 2) -> EngineRegistry:
    """Actor and critic (SGD, no clipping), and with ``frozen`` ref and reward, all at ``stage`` in fp32."""
    registry = EngineRegistry()
    place, optim = Placement(stage, "fp32"), OptimSpec("sgd", lr=LR, total_steps=10, max_grad_norm=0.0)
    specs = [trainable_role("actor", causal_lm(folder), place, optim, micro_batch_size=micro, grad_accum=accum),
             trainable_role("critic", scalar_model(folder, "fp32", stage == 3, seed=3), place, optim,
                            micro_batch_size=micro, grad_accum=accum)]
    if frozen:
        specs += [frozen_role("ref", causal_lm(folder), place),
                  frozen_role("reward", scalar_model(folder, "fp32", stage == 3, seed=5), place)]
    for spec in specs:
        spec.packed = packed
        spec.token_budget = budget if spec.trainable else 0
        registry.add(spec)
    return registry.build()


def weights(registry: EngineRegistry) -> dict[str, torch.Tensor]:
    """Each trainable role's full weights, flattened (gathered under ZeRO-3)."""
    out = {}
    with registry.gathered(*TRAINED):
        for role in TRAINED:
            out[role] = torch.cat([p.detach().float().flatten().clone() for p in registry[role].module.parameters()])
    return out


def count_micro(registry: EngineRegistry) -> dict[str, list[int]]:
    """Record, per trainable role, the micro-batches of each optimizer step (backward calls up to a boundary)."""
    counts: dict[str, list[int]] = {}
    for role in TRAINED:
        engine, counts[role] = registry[role], [0]

        def step(engine=engine, steps=counts[role], orig=registry[role].step) -> None:
            steps[-1] += 1
            if engine.is_gradient_accumulation_boundary():
                steps.append(0)
            orig()

        engine.step = step
    return counts


def update(registry: EngineRegistry, exp: Experience, counts: dict | None = None, ptx: dict | None = None) -> dict:
    """One update (with ``ptx``: PPO-ptx, that pretraining batch in every actor micro-batch): its losses, the trained
    roles' weights after it and their change."""
    before = weights(registry)
    spec = RolloutSpec(GenerationSettings(max_new_tokens=T), eos_token_id=2, pad_token_id=0, critic="critic",
                       ref=None, seed=1)
    stats = train_on_experience(registry, exp, 0, PTX_SETTINGS if ptx else SETTINGS, spec, 2,
                                ptx_batches=itertools.repeat(ptx) if ptx else None)
    after = weights(registry)
    out = {"losses": {k: stats[k] for k in LOSSES},
           "after": after, "change": {role: after[role] - before[role] for role in TRAINED}}
    if counts is not None:
        out["micro_per_step"] = {role: c[:-1] for role, c in counts.items()}
        out["optimizer_steps"] = {role: int(registry[role].global_steps) for role in TRAINED}
    return out


def rel(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    """max |a - b| / max |a| (over ``where``)."""
    if where is not None:
        a, b = a[where], b[where]
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def compare(padded: dict, other: dict, action: torch.Tensor) -> dict[str, float]:
    gaps = {k: rel(padded[k], other[k], action) for k in ("logprobs", "ref_logprobs", "values")}
    gaps["scores"] = rel(padded["scores"], other["scores"])
    if "losses" in other:
        gaps.update({f"loss/{k}": abs(padded["losses"][k] - other["losses"][k]) / max(abs(padded["losses"][k]), 1e-30)
                     for k in LOSSES})
        for role in TRAINED:
            gaps[f"weights/{role}"] = rel(padded["after"][role], other["after"][role])
            gaps[f"gradient/{role}"] = rel(padded["change"][role], other["change"][role])
    return gaps


def running_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int = 0) -> packing.Packed:
    """``pack`` with positions counting on across a packed row: sequences are not told apart."""
    p = PACK(input_ids, attention_mask, capacity)
    return dataclasses.replace(p, position_ids=torch.arange(p.input_ids.shape[1]).expand_as(p.input_ids).clone())


def free(registry: EngineRegistry) -> None:
    del registry
    gc.collect()
    barrier()


PACK = packing.pack
result: dict = {"families": {}, "budget": {}}
for family, folder in FOLDERS.items():
    for stage in (2, 3):
        ids, mask, action = rows(int(os.environ["RANK"]))
        runs = {}
        for mode in ("padded", "packed", "running") if stage == 2 else ("padded", "packed"):
            registry = build(folder, stage, mode != "padded")
            packing.pack = running_positions if mode == "running" else PACK
            try:
                scored: dict = {}
                exp = experience(registry, ids, mask, action, scored)
                runs[mode] = {**scored, **update(registry, exp)}
            finally:
                packing.pack = PACK
            free(registry)
        result["families"][f"{family}/zero{stage}"] = {
            "packed": compare(runs["padded"], runs["packed"], action),
            **({"running": compare(runs["padded"], runs["running"], action)} if "running" in runs else {}),
            "packed_rows": list(PACK(ids, mask).input_ids.shape), "tokens": int(mask.sum())}

# rank 1's rows (17-18 tokens): with 24 each alone, 8 micro-batches a step against grad_accum 4; with 64 three
BUDGETS = (24, 64)
for stage in (2, 3):
    folder = FOLDERS[list(FOLDERS)[stage - 2]]
    rank = int(os.environ["RANK"])
    ids, mask, action = rows(rank, short=rank == 0)
    lengths = mask.sum(-1).tolist()
    # a pretraining batch (PPO-ptx): the same one in every actor micro-batch, so each optimizer step's ptx term
    # is that batch's loss whatever the number of micro-batches
    ptx_ids, ptx_mask, _ = rows(10 + rank)
    ptx = {"input_ids": ptx_ids, "attention_mask": ptx_mask, "labels": ptx_ids.masked_fill(ptx_mask == 0, -100)}
    runs = {}
    for budget in (0, *BUDGETS):
        # 8 rows a step: micro_batch_size 2 x grad_accum 4, or as many micro-batches of <= budget tokens as the
        # rank with the longest rows needs
        registry = build(folder, stage, True, frozen=False, budget=budget, micro=2, accum=4)
        counts = count_micro(registry)
        runs[budget] = update(registry, experience(registry, ids, mask, action), counts, ptx)
        free(registry)
    fixed = runs[0]
    for budget in BUDGETS:
        run = runs[budget]
        result["budget"][f"zero{stage}/{budget}"] = {
            "gaps": {**{f"loss/{k}": abs(fixed["losses"][k] - run["losses"][k]) / max(abs(fixed["losses"][k]), 1e-30)
                        for k in STEP_LOSSES},
                     **{f"weights/{r}": rel(fixed["after"][r], run["after"][r]) for r in TRAINED},
                     **{f"gradient/{r}": rel(fixed["change"][r], run["change"][r]) for r in TRAINED}},
            "micro_per_step": {"fixed": fixed["micro_per_step"], "budget": run["micro_per_step"]},
            "optimizer_steps": {"fixed": fixed["optimizer_steps"], "budget": run["optimizer_steps"]},
            "alone": len(budget_split(lengths, budget)), "tokens": sum(lengths)}
dump(result)
finish()

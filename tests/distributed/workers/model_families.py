"""Each tiny model family through the registry at ZeRO-3: a trainable actor, then a frozen ref of the same
folder and a frozen sequence-classification reward built after it (the pattern in which a family whose
modeling module is first imported inside the actor's zero.Init used to lose its kernel-decorated __init__).

argv: out_dir, a JSON file {family: {"causal": folder, "seqcls": folder, "lora": bool}}; "seqcls" null: the reward
is a ScalarHeadModel on the causal folder's body (a family without a sequence-classification class). A LoRA actor pauses
zero.Init inside its own scope (peft builds its adapters on full tensors) right after the family's import.
Nothing of transformers' model classes is imported before the first build: each family's module is first
imported inside its actor's scope.
"""

import json
import sys

import torch
from common import dump, finish, full_params, max_diff
from multiengine.engines import EngineRegistry, LoraSpec, OptimSpec, Placement, frozen_role, trainable_role
from multiengine.pipelines.rlhf.models import ScalarHeadModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

folders = json.load(open(sys.argv[2]))
results = {}
for family, paths in folders.items():
    causal, seqcls = paths["causal"], paths["seqcls"]
    registry = EngineRegistry(seed=0)
    registry.add(trainable_role("actor", lambda p=causal: AutoModelForCausalLM.from_pretrained(p),
                                Placement(stage=3, dtype="fp32"), OptimSpec(name="sgd", lr=0.5, max_grad_norm=0),
                                micro_batch_size=2, lora=LoraSpec(rank=4) if paths.get("lora") else None))
    registry.add(frozen_role("ref", lambda p=causal: AutoModelForCausalLM.from_pretrained(p),
                             Placement(stage=3, dtype="fp32")))
    reward = (lambda p=seqcls: AutoModelForSequenceClassification.from_pretrained(p)) if seqcls else \
        (lambda p=causal: ScalarHeadModel.from_pretrained(p, zero3=True, head_seed=1))
    registry.add(frozen_role("reward", reward, Placement(stage=3, dtype="fp32")))
    registry.build()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 40, (2, 8), generator=g)
    # the same two rows on both ranks: every rank's output can be compared with one plain model
    before = full_params(registry, "actor")
    with torch.no_grad():
        ref_logits = registry["ref"](input_ids=ids).logits
        actor_logits = registry["actor"](input_ids=ids).logits
        scores = registry["reward"](input_ids=ids)
    loss = registry["actor"](input_ids=ids, labels=ids).loss
    registry["actor"].backward(loss)
    registry["actor"].step()
    after = full_params(registry, "actor")
    with registry.generation("actor") as actor:  # after a step: the gather-once path
        out = actor.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    local = {n: sum(p.ds_tensor.numel() for p in registry[n].module.parameters()) for n in ("actor", "ref", "reward")}
    total = {n: sum(p.ds_numel for p in registry[n].module.parameters()) for n in ("actor", "ref", "reward")}
    # Plain copies built after every scope closed: classes must be whole again (and not partition)
    plain = AutoModelForCausalLM.from_pretrained(causal).eval()
    plain_rm = (AutoModelForSequenceClassification.from_pretrained(seqcls) if seqcls else
                ScalarHeadModel.from_pretrained(causal, head_seed=1)).eval()
    with torch.no_grad():
        expected_logits = plain(input_ids=ids).logits
        expected_scores = plain_rm(input_ids=ids)
    results[family] = {
        "classes": {n: type(registry[n].module).__name__ for n in ("actor", "ref", "reward")},
        "trainable": sum(p.ds_numel for p in registry["actor"].module.parameters() if p.requires_grad),
        "ref_error": (ref_logits - expected_logits).abs().max().item(),
        "actor_error": (actor_logits - expected_logits).abs().max().item(),
        "reward_error": (getattr(scores, "logits", scores) - getattr(expected_scores, "logits", expected_scores))
        .abs().max().item(),
        "loss": loss.item(),
        "actor_changed": max_diff(before, after),
        "generated": out.shape[1] - 4,
        "local": local,
        "total": total,
        "plain_partitioned": any(hasattr(p, "ds_id") for p in plain.parameters()),
    }
    del registry, plain, plain_rm
dump(results)
finish()

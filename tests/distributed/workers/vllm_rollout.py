"""vLLM rollouts on 2 ranks, one engine start per launch. ``equality``: one in-process engine per rank serving three
actors of one registry (ZeRO-2, ZeRO-3, ZeRO-3 + LoRA), each trained k steps: the engine's greedy answers before the
sync (its weights are another actor's) and after it (registry.rollout syncs a role that stepped), against
transformers' generate on the trained actor. ``grpo NAME OVERRIDES...``: an rlhf_grpo run of tiny_vllm under
out_dir/NAME.

argv: out_dir mode [name overrides...].
"""

import json
import os
import sys

import torch
from common import dump, finish
from multiengine.engines import EngineRegistry, LoraSpec, OptimSpec, Placement, barrier, trainable_role
from multiengine.engines.vllm_rollout import VLLMRollout, VLLMSettings
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.generation import GenerationSettings, generate, vllm_generate
from multiengine.recipes.language.config import checked_config, load_recipe

out, mode, K, NEW = sys.argv[1], sys.argv[2], 3, 12


def equality() -> dict:
    registry = EngineRegistry(seed=0)
    folder = os.path.join(out, "model")
    if registry.is_main:  # a tiny OPT of head size 32, weights drawn wide: greedy picks far from ties
        from transformers import AutoModelForCausalLM

        tiny.train_tokenizer(tiny.task_vocabulary(), os.path.join(out, "tokenizer"))
        tiny.build_tiny_causal_lm(folder, os.path.join(out, "tokenizer"), hidden=64, layers=2, heads=2)
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.3)
        model.save_pretrained(folder)
    barrier()

    def load():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder)

    ROLES = {"z2": (2, None), "z3": (3, None), "z3_lora": (3, LoraSpec(rank=4, target_modules=("q_proj", "v_proj")))}
    for name, (stage, lora) in ROLES.items():
        registry.add(trainable_role(name, load, Placement(stage=stage, dtype="fp32"), OptimSpec(lr=3e-2),
                                    micro_batch_size=4, lora=lora))
    registry.build()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    EOS, PAD = tok.eos_token_id, tok.pad_token_id
    engine = VLLMRollout(folder, VLLMSettings(max_model_len=64, kv_cache_gb=1 / 16), "cpu")
    g = torch.Generator().manual_seed(100 + registry.rank)  # each rank its own data and prompts
    prompts = torch.randint(4, 100, (8, 5), generator=g)
    mask = torch.ones_like(prompts)
    greedy = GenerationSettings(max_new_tokens=NEW).greedy()
    result = {}

    def padded(rows: list[list[int]]) -> list[list[int]]:
        return [row + [PAD] * (NEW - len(row)) for row in rows]

    for name in ROLES:
        actor = registry[name]
        for _ in range(K):
            batch = torch.randint(4, 100, (4, 16), generator=g)
            actor.backward(actor(input_ids=batch, labels=batch).loss)
            actor.step()
        hf = padded(generate(registry, prompts, mask, greedy, EOS, PAD, role=name).tolist())
        registry.add_rollout(name, engine)
        stale = padded(engine.generate(prompts.tolist(), NEW, {"temperature": 0.0}, [0] * 8, [EOS])[0])
        synced = padded(vllm_generate(registry, prompts, mask, greedy, EOS, PAD, role=name)[0].tolist())
        stats = engine.take_sync_stats()
        result[name] = {"equal_synced": sum(a == b for a, b in zip(synced, hf)),
                        "equal_stale": sum(a == b for a, b in zip(stale, hf)),
                        "sync_tensors": stats.tensors, "sync_bytes": stats.bytes, "version": engine.version}
    result["memory_roles"] = [r["role"] for r in registry.memory_report()]
    return result


def run(name: str, *overrides: str) -> dict:
    path = os.path.join(out, name)
    cfg = checked_config("rlhf_grpo", "tiny_vllm", [f"output_dir={path}", "plot=false", "tensorboard=false",
                                                    *overrides])
    load_recipe("rlhf_grpo").main(cfg)
    torch.distributed.barrier()
    with open(os.path.join(path, "summary.json")) as f:
        metrics = json.load(f)["metrics"]
    with open(os.path.join(path, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    return {"metrics": metrics, "train": [x for x in lines if any(k.startswith("train/") for k in x)]}


dump(equality() if mode == "equality" else {"run": run(sys.argv[3], *sys.argv[4:])})
finish()

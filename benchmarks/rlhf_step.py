"""RLHF step 3 (PPO) time per phase under different placements of the four roles.

Tiny OPT-shaped actor/critic/ref/reward (hidden 64, 2 layers, vocab 512, ~0.2M parameters each),
fixed-length random prompts, greedy generation. Configurations:

  zero2              actor/critic ZeRO-2 (ref follows the actor, reward the critic: stage 0 frozen)
  zero3_gather       everything ZeRO-3, the actor gathered once per batch for generate()
  zero3_per_token    everything ZeRO-3, generate(synced_gpus=True): every token re-gathers every layer
  zero3_offload      ZeRO-3, gather-once, ref and reward parameters offloaded to CPU
  zero3_frozen_gather  ZeRO-3, gather-once generation, ref and reward gathered whole per forward

    python -m benchmarks.rlhf_step            # 2 CPU ranks; both shapes (4 x 32+32 and 8 x 128+128)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

CONFIGS = {
    "zero2": {"stage": 2, "gen": "gather", "offload": False},
    "zero3_gather": {"stage": 3, "gen": "gather", "offload": False},
    "zero3_per_token": {"stage": 3, "gen": "per_token", "offload": False},
    "zero3_offload": {"stage": 3, "gen": "gather", "offload": True},
    "zero3_frozen_gather": {"stage": 3, "gen": "gather", "offload": False, "frozen_gather": True},
}
SHAPES = {"small": (4, 32, 32), "large": (8, 128, 128)}  # prompts per rank, prompt tokens, answer tokens


def _tiny_lm(path: str, vocab: int = 512) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                             num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
                             dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0)).save_pretrained(path)


def worker(config: str, shape: str, steps: int, warmup: int, model_dir: str) -> None:
    import torch
    from multiengine.engines import EngineRegistry
    from multiengine.pipelines.rlhf.generation import GenerationSettings
    from multiengine.pipelines.rlhf.roles import OptimSettings, Placement, build_rlhf_roles
    from multiengine.pipelines.rlhf.trainer import PPOSettings, PPOTrainer

    from benchmarks.common import emit, median

    c = CONFIGS[config]
    batch, prompt_len, answer_len = SHAPES[shape]
    registry = EngineRegistry()
    train = Placement(stage=c["stage"], dtype="fp32")
    frozen = (Placement(stage=3, dtype="fp32", offload_params=c["offload"],
                        gather_forward=c.get("frozen_gather", False)) if c["stage"] == 3 else None)
    build_rlhf_roles(registry, model_dir, model_dir, actor=train, critic=train, ref=frozen, reward=frozen,
                     actor_optim=OptimSettings(lr=1e-5), critic_optim=OptimSettings(lr=1e-5),
                     micro_batch_size=batch)
    # EOS outside the vocabulary: every answer runs to its full length, so all configs time the same work.
    trainer = PPOTrainer(registry, GenerationSettings(max_new_tokens=answer_len, do_sample=False, mode=c["gen"]),
                         PPOSettings(rollout_batch_size=batch, mini_batch_size=batch), eos_token_id=10**6,
                         pad_token_id=0, seed=0)
    g = torch.Generator().manual_seed(registry.rank)
    records = []
    for step in range(warmup + steps):
        ids = torch.randint(3, 512, (batch, prompt_len), generator=g)
        metrics = trainer.step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, step)
        if step >= warmup:
            records.append(metrics)
    report = {row["role"]: row for row in registry.memory_report()}
    if registry.is_main:
        keys = ("time/generation_s", "time/experience_s", "time/train_s", "time/step_s", "gen/tokens_per_s")
        emit({"config": config, "shape": shape, **{k: median([r[k] for r in records]) for k in keys},
              "params_local": {k: v["params_local"] for k, v in report.items()},
              "params_total": {k: v["params_total"] for k, v in report.items()}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--shapes", default="small,large")
    parser.add_argument("--worker", nargs=3, metavar=("CONFIG", "SHAPE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.steps, args.warmup, args.worker[2])
        return
    from benchmarks.common import run_ranks, table, write_results

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "tiny_opt")
        _tiny_lm(model_dir)
        for shape in args.shapes.split(","):
            for config in CONFIGS:
                results.append(run_ranks("benchmarks.rlhf_step", 2, ["--steps", str(args.steps), "--warmup",
                                                                    str(args.warmup), "--worker", config, shape,
                                                                    model_dir]))
    rows = [[r["shape"], r["config"], 1000 * r["time/generation_s"], 1000 * r["time/experience_s"],
             1000 * r["time/train_s"], 1000 * r["time/step_s"], r["gen/tokens_per_s"],
             f"{r['params_local']['actor']:,}/{r['params_total']['actor']:,}",
             f"{r['params_local']['ref']:,}"] for r in results]
    print(table(["shape", "config", "generation ms", "experience ms", "train ms", "step ms", "gen tokens/s",
                 "actor params here/total", "ref params here"], rows))
    ratios = {}
    for shape in args.shapes.split(","):
        by = {r["config"]: r for r in results if r["shape"] == shape}
        ratios[shape] = {
            "step_zero3_gather_over_zero2": by["zero3_gather"]["time/step_s"] / by["zero2"]["time/step_s"],
            "generation_per_token_over_gather": by["zero3_per_token"]["time/generation_s"]
            / by["zero3_gather"]["time/generation_s"],
        }
        r = ratios[shape]
        print(f"{shape}: step zero3_gather/zero2 = {r['step_zero3_gather_over_zero2']:.2f} (target <= 1.5: "
              f"{'met' if r['step_zero3_gather_over_zero2'] <= 1.5 else 'MISSED'}); generation per_token/gather"
              f" = {r['generation_per_token_over_gather']:.2f} (target >= 3: "
              f"{'met' if r['generation_per_token_over_gather'] >= 3 else 'MISSED'})")
    path = write_results("rlhf_step", {"world_size": 2, "runs": results, "ratios": ratios, "shapes": SHAPES},
                         command="python -m benchmarks.rlhf_step " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

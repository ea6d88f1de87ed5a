"""Per-rank model-state memory, on paper, for real model sizes; checked against measured tiny runs.

Formula (ZeRO paper, mixed-precision Adam: 2-byte weights and grads, 12 bytes of fp32 master
weights and moments per parameter; frozen roles hold only their b-byte weights):

    trainable, stage 0: 16·Ψ        stage 1: 4·Ψ + 12·Ψ/N     stage 2: 2·Ψ + 14·Ψ/N     stage 3: 16·Ψ/N
    frozen,    stage 0:  b·Ψ        stage 3: b·Ψ/N   (+ parameters under the persistence threshold)

    python -m benchmarks.memory_projection          # tables + a 2-rank check of the formula
"""

from __future__ import annotations

import argparse
import sys

GIB = 1024**3

SCENARIOS = {
    "sd15_full_finetune": {
        "seed_baseline": [("unet", 860e6, True, 3), ("vae", 84e6, False, 0), ("text_encoder", 123e6, False, 0)],
        "all_sharded": [("unet", 860e6, True, 3), ("vae", 84e6, False, 3), ("text_encoder", 123e6, False, 3)],
    },
    "rlhf_opt1.3b_opt350m": {
        "seed_baseline": [("actor", 1.3e9, True, 3), ("critic", 350e6, True, 3), ("ref", 1.3e9, False, 0),
                          ("reward", 350e6, False, 0)],
        "all_sharded": [("actor", 1.3e9, True, 3), ("critic", 350e6, True, 3), ("ref", 1.3e9, False, 3),
                        ("reward", 350e6, False, 3)],
    },
}


def role_bytes(params: float, trainable: bool, stage: int, world: int, weight_bytes: int = 2) -> float:
    """Bytes of model state one rank holds for one role (see the module docstring)."""
    if not trainable:
        return weight_bytes * params / (world if stage == 3 else 1)
    return {0: 16 * params, 1: 4 * params + 12 * params / world, 2: 2 * params + 14 * params / world,
            3: 16 * params / world}[stage]


def projection(worlds: tuple[int, ...] = (1, 8, 64)) -> list[list]:
    rows = []
    for scenario, modes in SCENARIOS.items():
        for mode, roles in modes.items():
            for world in worlds:
                per_role = {name: role_bytes(p, t, s, world) for name, p, t, s in roles}
                rows.append([scenario, mode, world, *(f"{name} {b / GIB:.2f}" for name, b in per_role.items()),
                             round(sum(per_role.values()) / GIB, 2)])
    return rows


def check_worker() -> None:
    """2 ranks: tiny OPT roles in bf16; measured bytes per role vs the formula."""
    import torch
    from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
    from transformers import OPTConfig, OPTForCausalLM

    from benchmarks.common import emit

    config = OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                       max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0)

    def model():
        torch.manual_seed(0)
        return OPTForCausalLM._from_config(config)  # the zero.Init-aware constructor

    registry = EngineRegistry()
    registry.add(RoleSpec("actor", model, train_ds_config(stage=3, dtype="bf16", micro_batch_size=2),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)))
    registry.add(RoleSpec("ref", model, eval_ds_config(stage=3, dtype="bf16")))
    registry.add(RoleSpec("reward", model, eval_ds_config(stage=0, dtype="bf16")))
    registry.build()
    ids = torch.randint(0, 512, (2, 16))
    loss = registry["actor"](input_ids=ids, labels=ids).loss
    registry["actor"].backward(loss)
    registry["actor"].step()  # optimizer state exists only after the first step
    rows = []
    for row in registry.memory_report():
        measured = row["param_bytes"] + row["grad_bytes"] + row["optimizer_bytes"]
        persistent_bytes = 2 * row["params_persistent"]
        formula = role_bytes(row["params_total"], row["trainable"], row["stage"], registry.world_size)
        rows.append({"role": row["role"], "stage": row["stage"], "params": row["params_total"],
                     "measured_bytes": measured, "formula_bytes": formula,
                     "persistent_bytes": persistent_bytes})
    if registry.is_main:
        emit(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-check", action="store_true", help="skip the 2-rank measurement")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        check_worker()
        return
    from benchmarks.common import run_ranks, table, write_results

    rows = projection()
    print("Per-rank model-state memory (GiB), bf16 weights, Adam; computed, not run\n")
    width = max(len(r) for r in rows)
    rows = [r[:3] + [" / ".join(r[3:-1])] + [r[-1]] for r in rows] if width else rows
    print(table(["scenario", "mode", "GPUs", "per role (GiB)", "total GiB"], rows))
    check = []
    if not args.no_check:
        check = run_ranks("benchmarks.memory_projection", 2, ["--worker"])
        print("\nFormula vs measured (2 CPU ranks, tiny OPT roles, bf16, after one AdamW step)\n")
        print(table(["role", "stage", "params", "measured B", "formula B", "persistent B", "measured/formula"],
                    [[c["role"], c["stage"], c["params"], c["measured_bytes"], int(c["formula_bytes"]),
                      c["persistent_bytes"], round(c["measured_bytes"] / c["formula_bytes"], 3)] for c in check]))
    path = write_results("memory_projection", {"projection": rows, "check": check, "world_size_check": 2},
                         command="python -m benchmarks.memory_projection " + " ".join(sys.argv[1:]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

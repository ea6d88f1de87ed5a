"""Registry overhead: the same two-model training step built by hand with deepspeed.initialize
and built through the registry; the ratio of median step times (target: within 1.03x).

    python -m benchmarks.registry_overhead            # launches 2 CPU ranks itself
"""

from __future__ import annotations

import argparse
import os
import sys
import time

WIDTH, DEPTH = 512, 4


def _mlp():
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def _configs():
    from multiengine.engines import eval_ds_config, train_ds_config
    from multiengine.engines.config import resolve_batch_keys, resolve_bucket_sizes

    train, frozen = train_ds_config(stage=3, dtype="fp32", micro_batch_size=8), eval_ds_config(stage=3, dtype="fp32")
    n = DEPTH * (WIDTH * WIDTH + WIDTH) + WIDTH + 1
    for name, cfg in (("actor", train), ("ref", frozen)):
        resolve_batch_keys(name, cfg, int(os.environ["WORLD_SIZE"]))
        resolve_bucket_sizes(cfg, WIDTH, num_params=n, trainable_params=n)
    return train, frozen


def hand_written():
    """What a user writes today without the registry."""
    import deepspeed
    import torch

    train, frozen = _configs()
    with deepspeed.zero.Init(config_dict_or_path=train):
        actor = _mlp()
    actor_engine, *_ = deepspeed.initialize(model=actor, model_parameters=actor.parameters(),
                                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), config=train)
    with deepspeed.zero.Init(config_dict_or_path=frozen):
        ref = _mlp()
    ref.requires_grad_(False).eval()
    ref_engine, *_ = deepspeed.initialize(model=ref, config=frozen)

    def ref_forward(x):
        with torch.no_grad():
            return ref_engine(x)

    return actor_engine, ref_forward


def through_registry():
    import torch
    from multiengine.engines import EngineRegistry, RoleSpec

    train, frozen = _configs()
    registry = EngineRegistry()
    registry.add(RoleSpec("actor", _mlp, train, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)))
    registry.add(RoleSpec("ref", _mlp, frozen))
    registry.build()
    return registry["actor"], registry["ref"]


def worker(steps: int, warmup: int, rounds: int) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    variants = {"hand_written": hand_written(), "registry": through_registry()}
    x = torch.randn(8, WIDTH)
    times = {name: [] for name in variants}

    def step(actor, ref):
        loss = (actor(x) - ref(x)).pow(2).mean()
        actor.backward(loss)
        actor.step()

    for actor, ref in variants.values():
        for _ in range(warmup):
            step(actor, ref)
    # Interleave rounds so that drift on a noisy machine hits both variants alike.
    for _ in range(rounds):
        for name, (actor, ref) in variants.items():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(actor, ref)
                times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        from benchmarks.common import emit

        emit(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    from benchmarks.common import in_distributed_run

    if in_distributed_run():
        worker(args.steps, args.warmup, args.rounds)
        return
    from benchmarks.common import median, run_ranks, table, write_results

    times = run_ranks("benchmarks.registry_overhead", args.nproc,
                      ["--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds)])
    med = {k: median(v) for k, v in times.items()}
    ratio = med["registry"] / med["hand_written"]
    rows = [[k, len(times[k]), 1000 * med[k]] for k in ("hand_written", "registry")]
    print(table(["variant", "steps", "median step ms"], rows))
    verdict = "met" if ratio <= 1.03 else "MISSED"
    print(f"\nratio registry / hand-written: {ratio:.3f} (target <= 1.03: {verdict})")
    path = write_results("registry_overhead", {
        "world_size": args.nproc, "model": f"actor+ref MLP width {WIDTH} depth {DEPTH}, ZeRO-3, fp32",
        "median_step_s": med, "ratio": ratio, "target": 1.03, "target_met": ratio <= 1.03, "step_times_s": times,
    }, command="python -m benchmarks.registry_overhead " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

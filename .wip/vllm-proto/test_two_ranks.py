"""Two CPU ranks: a DeepSpeed actor (ZeRO-2, ZeRO-3, ZeRO-3 + LoRA) trained k steps, synced into each rank's
in-process vLLM engine; greedy outputs then equal transformers' generate on the trained actor token for token,
and differ without the sync.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 test_two_ranks.py [models/llama]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from rollout_engine import RolloutEngine, RolloutEngineError, RolloutSettings, stream_blocks

FOLDER = sys.argv[1] if len(sys.argv) > 1 else "models/llama"
K_STEPS, N_NEW = 3, 24
RANK = int(os.environ["RANK"])


def say(msg: str) -> None:
    print(f"[rank {RANK}] {msg}", flush=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, 100, (4,), generator=g).tolist() for _ in range(n)]


def hf_greedy(model: torch.nn.Module, ps: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in ps:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=N_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            out.append(y[0, len(p):].tolist())
    return out


def reference(actor: torch.nn.Module) -> torch.nn.Module:
    """A plain HF model holding the actor's whole (merged, for LoRA) weights, gathered a block at a time."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()
    params = dict(ref.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in stream_blocks(actor):
            params[name].copy_(tensor)
    return ref


def build_actor(stage: int, lora: bool):
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
        # a fresh LoRA is a no-op (B = 0): start B away from 0 so the k steps visibly move the merged weights
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "zero_allow_untested_optimizer": True}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train(engine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.module.config.vocab_size
    for _ in range(steps):
        x = torch.randint(4, vocab, (4, 12), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def main() -> int:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # before the engine: see rollout_engine
    rollout = RolloutEngine(FOLDER, RolloutSettings(dtype="float32", max_model_len=256, kv_cache_gib=0.0625, seed=RANK))
    import psutil

    say(f"rollout engine started in {rollout.start_seconds:.1f}s; RSS {psutil.Process().memory_info().rss / 2**30:.2f} "
        f"GiB")
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32)
    failures = 0
    eval_ps = prompts(8, seed=10 + RANK)  # each rank its own prompts
    for i, (stage, lora) in enumerate(((2, False), (3, False), (3, True))):
        case = f"ZeRO-{stage}{' + LoRA' if lora else ''}"
        rollout.sync(stream_blocks(start))  # the engine starts each case from the actor's initial weights
        actor = build_actor(stage, lora)
        train(actor, K_STEPS, seed=100 * i + RANK)
        expected = hf_greedy(reference(actor.module), eval_ps)
        before = rollout.generate(eval_ps, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True).token_ids
        stats = rollout.sync(stream_blocks(actor.module))
        after = rollout.generate(eval_ps, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True).token_ids
        eq_before = sum(a == b for a, b in zip(before, expected))
        eq_after = sum(a == b for a, b in zip(after, expected))
        ok = eq_after == len(eval_ps) and eq_before < len(eval_ps)
        failures += not ok
        say(f"{'PASS' if ok else 'FAIL'} {case}: after {K_STEPS} steps greedy equal to generate: without sync "
            f"{eq_before}/{len(eval_ps)}, with sync {eq_after}/{len(eval_ps)}; sync {stats.tensors} tensors, "
            f"{stats.bytes} bytes, {stats.seconds * 1000:.0f} ms")
        del actor

    # sampled rollouts: log-probs against the trainer's, GRPO groups differ, same seed reproduces
    ref = reference(reference_source := build_actor(3, False).module)
    del reference_source
    rollout.sync(stream_blocks(ref))
    group = [eval_ps[0]] * 4
    a = rollout.generate(group, max_new_tokens=16, temperature=0.7, seed=RANK)
    b = rollout.generate(group, max_new_tokens=16, temperature=0.7, seed=RANK)
    deltas = []
    with torch.no_grad():
        for p, toks, lps in zip(group, a.token_ids, a.logprobs):
            logits = ref(torch.tensor([p + toks])).logits[0, len(p) - 1:-1]
            mine = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(toks)[:, None])[:, 0]
            deltas.append((mine - torch.tensor(lps)).abs())
    mismatch = torch.cat(deltas).mean().item()
    distinct = len({tuple(t) for t in a.token_ids})
    ok = a.token_ids == b.token_ids and distinct > 1 and mismatch < 1e-4
    failures += not ok
    say(f"{'PASS' if ok else 'FAIL'} sampling: a GRPO group of 4 has {distinct} distinct completions, same seed "
        f"reproduces: {a.token_ids == b.token_ids}, mean |dlogp| vs trainer {mismatch:.2e}")

    # partial syncs: whole layers pass, part of a fused layer is refused before anything is loaded
    names = [n for n, _ in stream_blocks(ref, only={"model.layers.1"})]
    stats = rollout.sync(stream_blocks(ref, only={"model.layers.1"}), names=names)
    try:
        rollout.sync(iter([]), names=["model.layers.0.self_attn.q_proj.weight"])
        say("FAIL partial sync of q_proj alone was accepted")
        failures += 1
    except RolloutEngineError as e:
        say(f"PASS partial sync: layer 1 alone ({stats.tensors} tensors) loaded; q_proj alone refused: {e}")
    after = rollout.generate(eval_ps, max_new_tokens=N_NEW, temperature=0.0, ignore_eos=True).token_ids
    failures += after != hf_greedy(ref, eval_ps)

    t = torch.tensor([float(failures)])
    dist.all_reduce(t)
    total = t.item()
    rollout.close()  # keeps the process group (vLLM's own teardown would destroy it)
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    say(f"gloo group after rollout.close(): all_reduce -> {t.item()}")
    total += t.item() != 2.0
    dist.barrier()
    dist.destroy_process_group()
    say("ALL PASSED" if total == 0 else f"{int(total)} FAILED")
    return int(total > 0)


if __name__ == "__main__":
    start = time.perf_counter()
    rc = main()
    say(f"total {time.perf_counter() - start:.1f}s")
    sys.exit(rc)

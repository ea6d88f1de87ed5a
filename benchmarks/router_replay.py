"""Router replay: what it does to the rollout-vs-trainer log-prob mismatch, and what it costs. One process, CPU.

Models: a tiny Qwen3-MoE (hidden 256, 4 layers, 8 experts, top 2, expert width 256) and, for the floor every model
has, a dense Llama of the same width and depth; bf16 (fp32 decodes and re-scores the same numbers here).
Rollout: 16 left-padded prompts of 48 tokens, 48 sampled tokens each, transformers ``generate`` with a KV cache
(the sampler's log-probs from its logits); with recording, engines.moe.RouterTap keeps every pass's top-k experts.
Trainer: one full pass over the 16 x 96 rows (positions from the mask), forward + backward of the response
log-probs, with the model's own routing or the recorded one imposed.
Mismatch: |trainer - sampler| log-prob of each sampled token (mean and max); flips: sampled tokens whose experts
differ in some layer between the sampler and the trainer. Timings: the median of ``--rounds`` runs, interleaved.

    python -m benchmarks.router_replay            # ~1 min here
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from multiengine.engines import moe

B, C, T, VOCAB = 16, 48, 48, 512


def model(family: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"llama": {"head_dim": 32},
             "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 256, "head_dim": 32, "num_experts_per_tok": 2}}
    config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, **extra[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()


def rollout(m: torch.nn.Module, record: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    ids = torch.randint(5, VOCAB, (B, C), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, C, dtype=torch.long)
    mask[:6, :10] = 0
    torch.manual_seed(2)
    t0 = time.perf_counter()
    with torch.no_grad(), moe.tapped(m, record=record) as tap:
        out = m.generate(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=T,
                         min_new_tokens=T, do_sample=True, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, eos_token_id=2, **moe.router_logits_off(m))
    routing = moe.generated_routing(tap.passes, B, out.sequences.shape[1]) if record and tap else None
    seconds = time.perf_counter() - t0
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, out.sequences[:, C:, None])
    return out.sequences, logp.squeeze(-1), routing, seconds


def train_pass(m: torch.nn.Module, seq: torch.Tensor, routing: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    full = torch.ones_like(seq)
    full[:6, :10] = 0
    t0 = time.perf_counter()
    with moe.tapped(m, routing) as tap:
        logits = m(input_ids=seq, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, C - 1:-1].float(), -1).gather(-1, seq[:, C:, None]).squeeze(-1)
    logp.sum().backward()
    seconds = time.perf_counter() - t0
    m.zero_grad(set_to_none=True)
    used = tap.chosen(tuple(seq.shape)) if tap is not None else None
    return logp.detach(), used, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for family, variants in (("llama", ("dense",)), ("qwen3_moe", ("own routing", "replayed"))):
        m = model(family)
        for variant in variants:
            record = variant == "replayed"
            gen_s, train_s = [], []
            for _ in range(args.rounds):
                seq, sampler, routing, g = rollout(m, record)
                trainer, used, t = train_pass(m, seq, routing)
                gen_s.append(g)
                train_s.append(t)
            diff = (trainer - sampler).abs()
            flips = "-"
            if used is not None:
                _, _, recorded, _ = rollout(m, True)
                kept = recorded >= 0
                flips = str(int(((used.sort(-1).values != recorded.long().sort(-1).values) & kept).any(-1)[:, C:]
                                .sum()))
            rows.append((family, variant, float(diff.mean()), float(diff.max()), flips, statistics.median(gen_s),
                         statistics.median(train_s)))
    print(f"{'model':<10} {'routing':<12} {'mismatch mean':>13} {'max':>9} {'flips':>6} {'generate s':>10} "
          f"{'train pass s':>12}")
    for family, variant, mean, most, flips, g, t in rows:
        print(f"{family:<10} {variant:<12} {mean:>13.2e} {most:>9.2e} {flips:>6} {g:>10.3f} {t:>12.3f}")


if __name__ == "__main__":
    main()

"""Tiny causal LMs whose head size vLLM's CPU attention accepts (32), on the project's built-in word task."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# Set before vllm is imported anywhere in the process (read at engine construction / import).
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the calling process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin OpenMP threads to cores (shared 2-core box, 2 ranks)
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
}


def set_vllm_env() -> None:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)


def build_tiny(out_dir: str | Path, family: str = "llama", hidden: int = 64, heads: int = 2, kv_heads: int = 1,
               layers: int = 2, seed: int = 0, tie: bool = False) -> Path:
    """Random tiny ``family`` model (head size ``hidden // heads``) + the project's word-level tokenizer."""
    from multiengine.pipelines.rlhf.tiny import task_vocabulary, train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    tok = train_tokenizer([" ".join(task_vocabulary())], out, vocab_size=512)
    keys: dict[str, Any] = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                                vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                eos_token_id=tok.eos_token_id, tie_word_embeddings=tie, attention_dropout=0.0)
    if family == "qwen2":
        keys["use_sliding_window"] = False
    config = AutoConfig.for_model(family, **keys)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        # the default init (std 0.02) gives near-uniform logits: scale up so greedy picks are well separated
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.3)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                               eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(out))
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` task prompts as token ids (``<s> list 3 fruits :``), varied by ``seed``."""
    import random

    from multiengine.pipelines.rlhf.tiny import COUNTS, TOPICS, make_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).parent / "models" / "llama"))
    rng = random.Random(seed)
    verbs = ("list", "name", "give", "write", "say", "tell")
    texts = [make_prompt(rng.choice(verbs), rng.choice(COUNTS), rng.choice(sorted(TOPICS))) for _ in range(n)]
    return [tok(t)["input_ids"] for t in texts]


@torch.no_grad()
def hf_greedy(model: Any, prompt_ids: list[list[int]], max_new: int, eos: int | None = None) -> list[list[int]]:
    """Greedy continuations with transformers' ``generate``, one prompt at a time (no padding effects)."""
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=eos, pad_token_id=0)
        outs.append(y[0, len(ids):].tolist())
    return outs

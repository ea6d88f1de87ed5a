"""One process: RolloutEngine's refusals and failure paths (python test_single.py; no torchrun).

Also runs under an interpreter without vllm (then only the missing-package message is checked)."""

from __future__ import annotations

import os
import sys

import torch

from rollout_engine import RolloutEngine, RolloutEngineError, RolloutSettings, check_supported, stream_blocks

failures = 0


def expect_error(what: str, fn, *needles: str) -> None:
    global failures
    try:
        fn()
    except RolloutEngineError as e:
        ok = all(n in str(e) for n in needles)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {what}: error: {e}")
        return
    failures += 1
    print(f"FAIL {what}: no error")


try:
    import vllm  # noqa: F401
except ModuleNotFoundError:
    expect_error("vllm missing", lambda: check_supported("models/llama", RolloutSettings()), "pip install")
    sys.exit(failures)

expect_error("head size 16 on CPU", lambda: check_supported("models/llama_hd16", RolloutSettings()), "head size 16")
expect_error("sleep mode on CPU", lambda: check_supported("models/llama", RolloutSettings(enable_sleep_mode=True)),
             "sleep mode")
os.environ["WORLD_SIZE"] = "2"
expect_error("engine before the process group", lambda: RolloutEngine("models/llama"), "process group")
del os.environ["WORLD_SIZE"]

engine = RolloutEngine("models/llama", RolloutSettings(kv_cache_gib=0.0625))
print(f"engine started in {engine.start_seconds:.1f}s; sleep on CPU frees nothing: {engine.sleep() is False}")
from transformers import AutoModelForCausalLM  # noqa: E402

hf = AutoModelForCausalLM.from_pretrained("models/llama", dtype=torch.float32)
stats = engine.sync(stream_blocks(hf))
print(f"full sync: {stats}")
expect_error("unknown name, refused before loading",
             lambda: engine.sync(iter([]), names=["model.layers.0.self_attn.nope.weight"]), "not a weight")
out = engine.generate([[1, 5, 6]], max_new_tokens=4, temperature=0.0)
print(f"PASS engine still usable after a refused plan: {out.token_ids}")
bad = [("model.embed_tokens.weight", torch.zeros(3, 3))]
expect_error("wrong shape mid-stream", lambda: engine.sync(iter(bad)), "shape", "partly loaded")
expect_error("after a failed sync every call fails", lambda: engine.generate([[1, 5, 6]], max_new_tokens=4),
             "unusable")
engine.close()
print("ALL PASSED" if failures == 0 else f"{failures} FAILED")
sys.exit(failures)

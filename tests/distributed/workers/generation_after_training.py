"""A ZeRO-3 actor (default config: prefetch on) alternating training steps and generation, three rounds,
through registry.generation and through registry.gathered; every rollout compared with a per-token
synced_gpus generation of the same weights.

argv: out_dir models_json
"""

import json
import sys

import torch
from common import dump
from multiengine.engines import EngineRegistry, OptimSpec, Placement, set_gradient_checkpointing, trainable_role
from multiengine.engines.partition import zero3_offload

paths = json.loads(sys.argv[2])
registry = EngineRegistry(seed=0)


def load():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(paths["opt"])


registry.add(trainable_role("actor", load, Placement(stage=3, dtype="fp32"), OptimSpec(lr=1e-2),
                            micro_batch_size=4, gradient_checkpointing=True))
registry.build()
engine = registry["actor"]
offload = zero3_offload(engine)
n_hooks = len(offload.forward_hooks) + len(offload.backward_hooks)
g = torch.Generator().manual_seed(registry.rank)
prompts = torch.randint(3, 120, (4, 6), generator=g)
kwargs = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=8, do_sample=False, pad_token_id=0,
              eos_token_id=None)


def train_step(seq: torch.Tensor) -> float:
    loss = engine(input_ids=seq, labels=seq).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def per_token() -> torch.Tensor:
    module = engine.module
    module.eval()
    was = set_gradient_checkpointing(module, False)
    with torch.no_grad():
        out = module.generate(prompts, synced_gpus=True, **kwargs)
    set_gradient_checkpointing(module, was)
    module.train()
    return out


result = {"rounds": []}
seq = torch.randint(3, 120, (4, 14), generator=g)
for _ in range(3):
    losses = [train_step(seq)]
    with registry.generation("actor") as module:
        state_inside = {"training": module.training,
                        "checkpointing": any(getattr(m, "gradient_checkpointing", False) is True
                                             for m in module.modules()),
                        "hooks": len(offload.forward_hooks) + len(offload.backward_hooks),
                        "whole": all(p.numel() == p.ds_numel for p in module.parameters())}
        via_generation = module.generate(prompts, **kwargs)
    reference = per_token()
    losses.append(train_step(via_generation))
    module = engine.module
    module.eval()
    with registry.gathered("actor"):
        via_gathered = module.generate(prompts, **kwargs)
    # back to 1/N on exit (a later hooked pass may leave whole what DeepSpeed's trace reuses soon; a step releases it)
    partitioned = all(p.numel() == 0 for p in module.parameters() if not p.ds_persist)
    module.train()
    reference_2 = per_token()
    result["rounds"].append({
        "losses": losses,
        "generation_equal": torch.equal(via_generation, reference),
        "gathered_equal": torch.equal(via_gathered, reference_2),
        "new_tokens": int(via_generation.shape[1] - prompts.shape[1]),
        "inside": state_inside,
        "after": {"training": module.training,
                  "checkpointing": any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules()),
                  "hooks": len(offload.forward_hooks) + len(offload.backward_hooks),
                  "partitioned": partitioned},
    })
    seq = via_gathered
result["hooks_at_build"] = n_hooks
dump(result)
registry.close()
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

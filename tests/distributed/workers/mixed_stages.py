"""Stage-3 actor + stage-2 reward + stage-0 encoder (+ a stage-3 diffusers UNet), all from_pretrained."""

import json
import os
import sys

import torch
from common import dump
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config

paths = json.loads(sys.argv[2])
from diffusers import UNet2DConditionModel  # noqa: E402
from transformers import AutoModelForCausalLM, CLIPTextModel  # noqa: E402
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled  # noqa: E402

flags_during_build = {}


def tracked(name, fn):
    def build():
        flags_during_build[name] = is_deepspeed_zero3_enabled()
        return fn()
    return build


registry = EngineRegistry()
registry.add(RoleSpec("actor", tracked("actor", lambda: AutoModelForCausalLM.from_pretrained(paths["opt"])),
                      train_ds_config(stage=3, dtype="fp32", micro_batch_size=2),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)))
registry.add(RoleSpec("reward", tracked("reward", lambda: AutoModelForCausalLM.from_pretrained(paths["opt"])),
                      eval_ds_config(stage=2, dtype="fp32")))
registry.add(RoleSpec("encoder", tracked("encoder", lambda: CLIPTextModel.from_pretrained(paths["clip"])),
                      eval_ds_config(stage=0, dtype="fp32")))
registry.add(RoleSpec("unet", tracked("unet", lambda: UNet2DConditionModel.from_pretrained(paths["unet"])),
                      eval_ds_config(stage=3, dtype="fp32")))
registry.build()

partitioned = {r.name: all(hasattr(p, "ds_tensor") for p in r.module.parameters()) for r in registry.roles()}
report = {row["role"]: row for row in registry.memory_report()}

ref_lm = AutoModelForCausalLM.from_pretrained(paths["opt"]).eval()
ref_clip = CLIPTextModel.from_pretrained(paths["clip"]).eval()
ref_unet = UNet2DConditionModel.from_pretrained(paths["unet"]).eval()
torch.manual_seed(0)
ids = torch.randint(3, 100, (2, 8))
sample, t, ctx = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 5, 32)
with torch.no_grad():
    errors = {
        "actor": (registry["actor"](input_ids=ids).logits - ref_lm(input_ids=ids).logits).abs().max().item(),
        "reward": (registry["reward"](input_ids=ids).logits - ref_lm(input_ids=ids).logits).abs().max().item(),
        "encoder": (registry["encoder"](input_ids=ids).last_hidden_state
                    - ref_clip(input_ids=ids).last_hidden_state).abs().max().item(),
        "unet": (registry["unet"](sample, t, encoder_hidden_states=ctx).sample
                 - ref_unet(sample, t, encoder_hidden_states=ctx).sample).abs().max().item(),
    }
exported = registry.export(os.path.join(sys.argv[1], "export"), roles=["actor", "unet"])
dump({
    "exported": exported,
    "partitioned": partitioned,
    "zero3_flag_during_build": flags_during_build,
    "zero3_flag_after_build": is_deepspeed_zero3_enabled(),
    "stages": {r.name: r.stage for r in registry.roles()},
    "notes": {r.name: r.note for r in registry.roles()},
    "local_fraction": {k: v["local_fraction"] for k, v in report.items()},
    "errors": errors,
})

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""registry_demo's actor takes LoRA and gradient checkpointing from roles.actor (nothing it accepts is dropped): built
in one process by the recipe's own build, only the adapters train and the base model recomputes its activations.
The same at ZeRO-3 on 2 ranks, with the merged export, is tests/distributed/test_cli_demo.py."""

from __future__ import annotations

import torch
from multiengine.recipes.language.config import load_config
from multiengine.recipes.registry_demo import RegistryDemo


def test_lora_and_gradient_checkpointing_reach_the_actor(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = load_config("registry_demo", "tiny", [f"output_dir={tmp_path}", "backend=torch", "roles.actor.lora.r=4",
                                                "roles.actor.gradient_checkpointing=true", "tensorboard=false"])
    run = RegistryDemo(cfg)
    run.setup()
    module = run.registry.role("actor").module
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "out_proj"}  # DECODER_LORA_TARGETS on OPT (it has no o_proj)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    run.train_step()
    changed = [n for n, p in module.named_parameters() if not torch.equal(before[n], p)]
    assert changed and all("lora_" in n for n in changed)
    run.close()

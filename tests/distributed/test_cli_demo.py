"""The CLI end to end: the registry demo on 2 ranks with an override (every key it has is read by the run), its actor
with LoRA adapters and gradient checkpointing at ZeRO-3, and a rejected key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_keys_read

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]


def _run(out, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2",
                           f"output_dir={out}", *overrides], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads((out / "summary.json").read_text())


def test_registry_demo_runs_on_two_ranks_with_an_override(tmp_path):
    out = tmp_path / "demo"
    summary = _run(out, "max_steps=3", "roles.actor.stage=2")
    assert summary["world_size"] == 2
    assert summary["config"]["max_steps"] == 3
    assert summary["roles"]["actor"]["stage"] == 2  # the override reached the role
    assert summary["roles"]["reward"]["stage"] == 0 and summary["roles"]["reward"]["requested_stage"] == 2
    rows = {r["role"]: r for r in summary["memory"]["per_rank"][0]["roles"]}
    assert rows["actor"]["params_local"] == rows["actor"]["params_total"]  # stage 2 keeps full params
    assert rows["actor"]["optimizer_bytes"] > 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3] and all("train/loss" in r for r in records)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard beside the JSONL
    assert (out / "curves.png").is_file()
    assert_keys_read(out, "registry_demo")  # lora.* apply only with lora.r, which is 0 here

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "export" / "actor")
    assert sum(p.numel() for p in exported.parameters()) == rows["actor"]["params_total"]


def test_registry_demo_trains_lora_adapters_only_at_zero3(tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "lora"
    summary = _run(out, "max_steps=2", "roles.actor.lora.r=4", "roles.actor.lora.alpha=8",
                   "roles.actor.lora.target_modules=[q_proj, v_proj]", "roles.actor.gradient_checkpointing=true")
    assert summary["roles"]["actor"]["lora"] and summary["roles"]["actor"]["stage"] == 3
    assert_keys_read(out, "registry_demo")
    rows = {r["role"]: r for r in summary["memory"]["per_rank"][0]["roles"]}
    assert rows["actor"]["optimizer_bytes"] < rows["reward"]["param_bytes"] / 10  # Adam moments of adapters only
    base, merged = load_file(out / "tiny_lm" / "model.safetensors"), load_file(out / "export" / "actor" /
                                                                            "model.safetensors")
    assert (out / "export" / "actor" / "adapter" / "adapter_config.json").is_file()
    assert set(merged) - set(base) <= {"lm_head.weight"}  # the plain model's keys (the tied head written out)
    adapted = sorted(k for k in base if not torch.equal(base[k], merged[k]))
    assert adapted and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in adapted), adapted


def test_unknown_key_is_rejected_before_any_rank_starts(tmp_path):
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2",
                           f"output_dir={tmp_path}", "max_step=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'max_step'" in proc.stderr and "Did you mean 'max_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.json").exists()

"""The CLI end to end: the registry demo on 2 ranks with an override, and a rejected key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.cli"]


def test_registry_demo_runs_on_two_ranks_with_an_override(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2",
                           f"output_dir={out}", "max_steps=3", "roles.actor.stage=2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
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

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "export" / "actor")
    assert sum(p.numel() for p in exported.parameters()) == rows["actor"]["params_total"]


def test_unknown_key_is_rejected_before_any_rank_starts(tmp_path):
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2",
                           f"output_dir={tmp_path}", "max_step=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'max_step'" in proc.stderr and "Did you mean 'max_steps'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "summary.json").exists()

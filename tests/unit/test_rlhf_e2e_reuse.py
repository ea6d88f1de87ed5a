"""rlhf_e2e reuses a finished step only when its resolved config and its inputs are unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from multiengine.pipelines.rlhf import tiny
from multiengine.recipes.language.steps import FINGERPRINT_FILE, reuse_reason, step_fingerprint


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_fingerprint_sees_config_and_input_changes(tmp_path):
    model = tmp_path / "model"
    _write(model / "config.json", '{"a": 1}')
    _write(model / ".cache" / "x", "ignored")
    out = tmp_path / "step"
    cfg = {"output_dir": str(out), "model": {"pretrained": str(model)}, "max_steps": 3,
           "data": {"source": "", "mode": "cosine"}, "tiny": str(out / "tiny")}
    fp = step_fingerprint("rlhf_sft", cfg, str(out))
    assert list(fp["inputs"]) == [str(model)] and list(fp["inputs"][str(model)]) == ["config.json"]
    assert reuse_reason(str(out), fp, rerun=False) == (False, "no finished run to reuse")
    _write(out / "summary.json", "{}")
    assert "no fingerprint.json beside it" in reuse_reason(str(out), fp, rerun=False)[1]
    _write(out / FINGERPRINT_FILE, json.dumps(fp))
    assert reuse_reason(str(out), step_fingerprint("rlhf_sft", cfg, str(out)), False) == (
        True, "config and inputs unchanged since it ran")
    assert reuse_reason(str(out), fp, rerun=True) == (False, "rerun=true")
    changed = step_fingerprint("rlhf_sft", {**cfg, "max_steps": 4}, str(out))
    assert reuse_reason(str(out), changed, False) == (False, "config changed: max_steps (3 -> 4)")
    _write(model / "config.json", '{"a": 2}')
    reuse, why = reuse_reason(str(out), step_fingerprint("rlhf_sft", cfg, str(out)), False)
    assert not reuse and why == f"input {model} changed (config.json)"


def _run(out, base, rbase, *extra):
    cmd = [sys.executable, "-m", "multiengine.recipes.language.cli", "run", "rlhf_e2e", "--config", "tiny",
           f"output_dir={out}", "backend=torch", "max_steps=1", f"model.pretrained={base}",
           f"model.reward_pretrained={rbase}", "reward.init_from_sft=false",
           "sft.overrides=[max_steps=1,eval.size=0,eval.every=0,data.heldout_size=8]",
           "reward.overrides=[max_steps=1,eval.every=0,data.heldout_size=8]",
           "ppo.overrides=[eval.size=4,eval.batch_size=4,eval.every=0,eval.greedy=false,checkpoint.every=0,"
           "ppo.rollout_batch_size=4,roles.actor.micro_batch_size=4,roles.critic.micro_batch_size=4,ppo.epochs=1,"
           "plot=false]", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    return {k.removeprefix("rlhf_"): v for k, v in summary["step_runs"].items()}, proc.stderr + proc.stdout


def test_a_step_reruns_after_its_base_model_changed(tmp_path):
    tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "tok")
    base = tiny.build_tiny_causal_lm(tmp_path / "base", tmp_path / "tok", hidden=16, layers=1, seed=0)
    rbase = tiny.build_tiny_causal_lm(tmp_path / "rbase", tmp_path / "tok", hidden=16, layers=1, seed=1)
    out = tmp_path / "e2e"
    runs, _ = _run(out, base, rbase)
    assert not any(r["reused"] for r in runs.values())
    assert all(r["why"] == "no finished run to reuse" for r in runs.values())
    # the SFT base model changed: SFT reruns, so does PPO (its actor is SFT's new export); the reward model,
    # trained from its own base on unchanged data, is reused (the log says which and why)
    tiny.build_tiny_causal_lm(tmp_path / "base", tmp_path / "tok", hidden=16, layers=1, seed=5)
    runs, log = _run(out, base, rbase)
    assert not runs["sft"]["reused"] and f"input {base} changed (model.safetensors)" in runs["sft"]["why"]
    assert runs["reward"] == {"reused": True, "why": "config and inputs unchanged since it ran"}
    assert not runs["ppo"]["reused"] and "export/actor changed" in runs["ppo"]["why"]
    assert "rlhf_reward: reusing" in log and "rlhf_sft (config tiny)" in log and "running (input" in log

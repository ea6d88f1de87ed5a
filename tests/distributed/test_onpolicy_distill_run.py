"""On-policy distillation (GKD) from the CLI on 2 ranks: a ZeRO-3 teacher (64 wide, 2 layers) scores every token
the ZeRO-2 student (32 wide, 1 layer, same tokenizer) samples itself on the steps the seeded lambda picks, and
distils from the demonstrations on the others; then a second launch resumes the run from its step-3 checkpoint
and ends bit-equal to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_keys_read
from multiengine.pipelines.distill import on_policy_batch

pytestmark = pytest.mark.distributed
# no LoRA adapters (lora.r=0; LoraSettings' other keys have no `when` yet, recipes/language/roles.py)
NO_LORA = tuple(f"roles.student.lora.{k}" for k in ("alpha", "dropout", "target_modules"))

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]


def test_on_policy_distill_with_a_zero3_teacher_and_a_zero2_student(tmp_path):
    out = tmp_path / "gkd"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*CLI, "run", "distill", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "max_steps=6",
         "distill.on_policy_fraction=0.4", "distill.loss=reverse_kl", "eval.size=16", "eval.every=0",
         "data.heldout_size=32", "teacher_sft.overrides=[max_steps=8,eval.size=16,eval.greedy=false]",
         "checkpoint.every=3", "checkpoint.keep_last=2", "export.enabled=false"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert_keys_read(out, "distill", NO_LORA)
    summary = json.loads((out / "summary.json").read_text())
    roles = summary["roles"]
    assert roles["teacher"]["stage"] == 3 and not roles["teacher"]["trainable"]
    assert roles["student"]["stage"] == 2 and roles["student"]["trainable"]
    sizes = {r["role"]: r["params_total"] for r in summary["memory"]["per_rank"][0]["roles"]}
    assert sizes["teacher"] > 4 * sizes["student"]  # two sizes, one vocabulary

    # every rank took the decision of (seed, step) alone (the metrics are means over ranks: a rank that disagreed
    # would log 0.5); offline steps have the hard-label CE, on-policy steps the length of the student's samples
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "train/on_policy" in r]
    decided = [on_policy_batch(0, k, 0.4) for k in range(6)]
    assert [r["train/on_policy"] for r in steps] == [float(x) for x in decided]
    assert True in decided and False in decided
    for r, on in zip(steps, decided):
        assert ("train/sampled_length" in r) == on and ("train/ce" in r) != on, r
        if on:
            assert 1.0 <= r["train/sampled_length"] <= 8.0 and r["train/loss"] == r["train/divergence"] > 0.0
    m = summary["metrics"]
    assert m["train/on_policy_share"] == pytest.approx(0.5)
    # the student learns: its held-out cross-entropy falls toward the teacher's (measured 4.68 -> 4.63, teacher 4.43)
    before, after, teacher = m["eval/before/loss"], m["eval/after/loss"], m["teacher/loss"]
    assert teacher < after < before - 0.02, (before, after, teacher)

    # resume: steps 4-6 again from the step-3 checkpoint (the teacher trained above), bit-equal to the first run
    again = tmp_path / "gkd_resumed"
    proc = subprocess.run(
        [*CLI, "run", "distill", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={again}", "max_steps=6",
         "distill.on_policy_fraction=0.4", "distill.loss=reverse_kl", "eval.size=16", "eval.every=0",
         "data.heldout_size=32", f"roles.teacher.model={out / 'teacher' / 'export' / 'actor'}",
         f"resume_from={out / 'checkpoints' / 'step_00000003'}", "checkpoint.every=0", "checkpoint.keep_last=2",
         "export.enabled=false"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # the teacher is given: no tiny teacher is trained (teacher_sft) and only the student is a tiny model
    assert_keys_read(again, "distill", (*NO_LORA, "teacher_sft.config", "teacher_sft.overrides", "tiny.hidden",
                                        "tiny.layers", "tiny.heads"))
    resumed = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in resumed if "train/on_policy" in r]

    def steady(r):  # everything but wall-clock timings
        return {k: v for k, v in r.items() if "time" not in k}

    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [steady(r) for r in resumed] == [steady(r) for r in steps[3:]]

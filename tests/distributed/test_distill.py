"""The distill recipe from the CLI on 2 ranks (teacher ZeRO-3, student ZeRO-2), shortened, and its student
export loaded with transformers alone in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.cli"]


def test_distill_from_the_cli_and_the_student_export(tmp_path):
    out = tmp_path / "distill"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*CLI, "run", "distill", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "max_steps=6",
         "distill.loss=jsd", "distill.temperature=2.0", "eval.size=16", "eval.every=3", "data.heldout_size=32",
         "teacher_sft.overrides=[max_steps=8,eval.size=16,eval.greedy=false]", "checkpoint.every=3"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    for key in ("eval/before/loss", "eval/after/loss", "teacher/loss", "eval/before/judge", "eval/after/judge"):
        assert key in m, key
    assert m["eval/after/loss"] < m["eval/before/loss"]  # the student moved toward the teacher
    assert summary["roles"]["teacher"]["stage"] == 3 and not summary["roles"]["teacher"]["trainable"]
    assert summary["roles"]["student"]["stage"] == 2 and summary["config"]["distill"]["loss"] == "jsd"
    assert [e["tag"] for e in summary["evaluations"]] == ["before", "step_3", "after"]
    assert (out / "teacher" / "export" / "actor" / "config.json").is_file()  # the teacher was trained first
    assert (out / "checkpoints" / "latest").read_text() == "step_00000006"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("train/divergence" in r for r in records) == 6
    assert (out / "curves.png").is_file() and list((out / "tensorboard").glob("events.out.tfevents.*"))

    code = ("import json, sys, torch\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "ids = t('list 3 fruits :', return_tensors='pt').input_ids\n"
            "g = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=t.pad_token_id)\n"
            "print(json.dumps({'hidden': m.config.hidden_size, 'new': int(g.shape[1] - ids.shape[1]),"
            " 'params': sum(p.numel() for p in m.parameters())}))\n")
    fresh = subprocess.run([sys.executable, "-c", code, str(out / "export" / "student")], capture_output=True,
                           text=True, timeout=300, env=env)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    loaded = json.loads(fresh.stdout.strip().splitlines()[-1])
    assert loaded["hidden"] == 32 and loaded["new"] >= 1
    rows = {r["role"]: r for r in summary["memory"]["per_rank"][0]["roles"]}
    assert loaded["params"] == rows["student"]["params_total"]

"""Multi-node launches, tested on one machine: two "nodes" of one rank each, rendezvous on loopback.

The CLI is started once per "node" (`--nnodes 2 --nproc-per-node 1 --master-addr 127.0.0.1`), as on a
real cluster, and the registry demo must give the same losses as a 2-rank single-node run:

* static rendezvous (`--node-rank 0|1`): 2 steps on two nodes with a checkpoint, then resumed on one
  node with 2 ranks (same world size) to step 4: losses and exported weights equal the 1-node 4-step run;
  the planner's model-state bytes for the config equal the measured memory report;
* c10d rendezvous (`--rdzv-backend c10d`, both nodes run the same command): the same first 2 losses;
* the distill recipe (shortened: a random tiny teacher, 3 steps), static rendezvous: the same losses as on
  one node with 2 ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _free_port, assert_keys_read, subprocess_env

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]
DEMO = ["run", "registry_demo", "--config", "tiny"]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]


def _run_nodes(commands: list[list[str]], timeout: int = 600) -> None:
    """Start one command per "node" at once (each waits in the rendezvous until all have joined)."""
    procs = [subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, (code, err) in enumerate(results):
        assert code == 0, f"node {i} exited {code}:\n{err[-6000:]}"


def _two_nodes(out: Path, *extra: str, rdzv: str = "static", run: list[str] = DEMO) -> None:
    port = str(_free_port())
    def node(rank: int) -> list[str]:
        where = ["--node-rank", str(rank)] if rdzv == "static" else ["--rdzv-backend", "c10d", "--rdzv-id", "t"]
        return [*CLI, *run, "--nproc-per-node", "1", "--nnodes", "2", *where, "--master-addr", "127.0.0.1",
                "--master-port", port, f"output_dir={out}", *extra]
    _run_nodes([node(0), node(1)])


def _losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r]


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "export" / "actor" / "model.safetensors"))


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one_node")
    _run([*CLI, *DEMO, "--nproc-per-node", "2", "max_steps=4", f"output_dir={out}"])
    assert len(_losses(out)) == 4
    assert_keys_read(out, "registry_demo")
    return out


def test_static_two_nodes_then_resume_on_one_node(one_node, tmp_path):
    two = tmp_path / "two_nodes"
    _two_nodes(two, "max_steps=2", "checkpoint.every=2")
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert_keys_read(two, "registry_demo")
    assert _losses(two) == _losses(one_node)[:2]

    # the planner's per-rank model states at the config's placements equal the measured ones, on every rank
    from multiengine.recipes.language import plans
    from multiengine.recipes.language.config import load_config, load_recipe

    cfg = load_config("registry_demo", "tiny", [f"output_dir={two}"])
    planned = plans.configured_states(load_recipe("registry_demo"), cfg, 2)
    for rank in summary["memory"]["per_rank"]:
        for row in rank["roles"]:
            p = planned[row["role"]]
            assert (p["stage"], p["params_total"], p["params_persistent"]) == (
                row["stage"], row["params_total"], row["params_persistent"]), row["role"]
            assert (p["param_bytes"], p["grad_bytes"]) == (row["param_bytes"], row["grad_bytes"]), row["role"]
            assert 0 <= row["optimizer_bytes"] - p["optimizer_bytes"] <= 4 * 64  # AdamW's step counters

    # the 2-node checkpoint resumes on one node with 2 ranks and continues exactly
    _run([*CLI, *DEMO, "--nproc-per-node", "2", "max_steps=4", "resume_from=latest", f"output_dir={two}"])
    assert _losses(two) == _losses(one_node)  # steps 1-2 from the 2-node run, 3-4 after the resume
    a, b = _weights(two), _weights(one_node)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name


def test_c10d_two_nodes_equal_one_node(one_node, tmp_path):
    two = tmp_path / "c10d"
    _two_nodes(two, "max_steps=2", rdzv="c10d")
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    assert _losses(two) == _losses(one_node)[:2]
    assert_keys_read(two, "registry_demo")


def test_distill_on_two_nodes_equals_one_node(tmp_path):
    """Teacher at ZeRO-3 (gathered layer by layer), student at ZeRO-2: 3 steps on two "nodes" give the
    losses of 3 steps on one node with 2 ranks. The recipe's own first step, training the tiny SFT teacher,
    is replaced by a random tiny teacher to keep this short."""
    from multiengine.pipelines.rlhf import tiny

    assets = tmp_path / "assets"
    tiny.prepare_builtin(assets, seed=0, n_sft=400, n_reward=10, n_ppo=10, n_eval=16)
    student = tiny.build_tiny_causal_lm(tmp_path / "student", assets / "tokenizer", hidden=32, layers=1, seed=1)
    run = ["run", "distill", "--config", "tiny"]
    args = [f"roles.teacher.model={assets / 'model'}", f"roles.student.model={student}",
            f"data.source={assets / 'data'}", "max_steps=3", "roles.student.micro_batch_size=8", "data.heldout_size=16",
            "eval.size=0", "export.enabled=false", "tensorboard=false", "plot=false", "checkpoint.every=0",
            "checkpoint.keep_last=2"]
    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    _run([*CLI, *run, "--nproc-per-node", "2", f"output_dir={one}", *args])
    _two_nodes(two, *args, run=run)
    assert len(_losses(one)) == 3
    # both models are given (no tiny model is built or trained first); no LoRA; offline with eval.size=0: nothing
    # generates (generation.*)
    unread = ("generation.max_new_tokens", "generation.temperature", "generation.top_k", "generation.top_p",
              "generation.mode", "tiny.hidden", "tiny.layers", "tiny.heads", "tiny.student_hidden",
              "tiny.student_layers", "tiny.student_heads", "teacher_sft.config", "teacher_sft.overrides")
    for out in (one, two):
        assert_keys_read(out, "distill", unread)
    assert _losses(two) == _losses(one)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert a["world_size"] == b["world_size"] == 2
    assert a["metrics"]["eval/after/loss"] == b["metrics"]["eval/after/loss"]
    assert {r["role"]: r["stage"] for r in b["memory"]["per_rank"][1]["roles"]} == {"teacher": 3, "student": 2}

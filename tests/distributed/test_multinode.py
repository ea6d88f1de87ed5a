"""Multi-node launches, tested on one machine: two "nodes" of one rank each, rendezvous on loopback.

* the CLI's static rendezvous (`--nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P`, the
  command started once per node) runs the registry demo to the same losses and weights as a 2-rank
  single-node run;
* a checkpoint written by a 2-node run (torchrun's c10d rendezvous) resumes on a 1-node 2-rank run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import WORKERS, _free_port, launch

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")


def _run_nodes(commands: list[list[str]], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Start one command per "node" at once (each blocks in the rendezvous until all have joined)."""
    procs = [subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    done = []
    try:
        for proc, cmd in zip(procs, commands):
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, result in enumerate(done):
        assert result.returncode == 0, f"node {i} exited {result.returncode}:\n{result.stderr[-6000:]}"
    return done


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["actor/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_equal_one_node(tmp_path):
    from safetensors.torch import load_file

    common = ["run", "registry_demo", "--config", "tiny", "--nproc-per-node", "1", "max_steps=3"]
    port = str(_free_port())
    two = tmp_path / "two_nodes"
    _run_nodes([[*CLI, *common, "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                 "--master-port", port, f"output_dir={two}"] for r in (0, 1)])
    one = tmp_path / "one_node"
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2", "max_steps=3",
                           f"output_dir={one}"], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]

    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert len(_losses(two)) == 3 and _losses(two) == _losses(one)
    a, b = (load_file(str(p / "export" / "actor" / "model.safetensors")) for p in (two, one))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name  # bit-identical weights after 3 steps

    # the planner's per-rank model states at the config's placements equal the measured ones
    from multiengine.recipes import plans
    from multiengine.recipes.config import load_config

    planned = plans.configured_states("registry_demo", load_config("registry_demo", "tiny", [f"output_dir={two}"]), 2)
    for out in (two, one):
        for row in json.loads((out / "summary.json").read_text())["memory"]["rank0_roles"]:
            p = planned[row["role"]]
            assert (p["stage"], p["params_total"], p["params_persistent"]) == (
                row["stage"], row["params_total"], row["params_persistent"]), row["role"]
            assert (p["param_bytes"], p["grad_bytes"]) == (row["param_bytes"], row["grad_bytes"]), row["role"]
            assert 0 <= row["optimizer_bytes"] - p["optimizer_bytes"] <= 4 * 64  # AdamW's step counters


def test_checkpoint_from_two_nodes_resumes_on_one_node(tmp_path):
    """tests/distributed/workers/ckpt.py: 3 steps + save on 2 nodes (c10d), load + 3 steps on 1 node,
    against 6 uninterrupted steps on 1 node."""
    full = launch("ckpt", tmp_path / "full", "full", str(tmp_path / "unused"), "deepspeed")
    ckpt = tmp_path / "ckpt"
    part1 = tmp_path / "p1"
    part1.mkdir()
    endpoint = f"127.0.0.1:{_free_port()}"
    _run_nodes([[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--nnodes", "2",
                 "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", "multinode-test",
                 str(WORKERS / "ckpt.py"), str(part1), "part1", str(ckpt), "deepspeed"] for _ in range(2)])
    written = [json.loads((part1 / f"rank{r}.json").read_text()) for r in range(2)]
    manifest = json.loads((ckpt / "step_00000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    resumed = launch("ckpt", tmp_path / "p2", "part2", str(ckpt), "deepspeed")
    for r_full, r_first, r_res in zip(full, written, resumed):
        assert r_first["losses"] == pytest.approx(r_full["losses"][:6], rel=1e-6)  # 2 nodes == 1 node
        assert r_res["client_state"] == {"step": 3, "data_position": 3}
        assert r_res["losses"] == pytest.approx(r_full["losses"][6:], rel=1e-5)
        for name in ("actor", "critic", "ema"):
            assert r_res["params"][name] == pytest.approx(r_full["params"][name], rel=1e-5, abs=1e-6)

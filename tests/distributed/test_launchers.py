"""The registry reads rank and world size from each launcher users actually run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import WORKERS, _free_port

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_registry_under_launcher(tmp_path, launcher):
    script = str(WORKERS / "launcher_check.py")
    port = str(_free_port())
    if launcher == "deepspeed":
        if shutil.which("deepspeed") is None:
            pytest.skip("deepspeed launcher script not on PATH")
        cmd = ["deepspeed", "--num_gpus", "2", "--master_port", port, script, str(tmp_path)]
    else:
        # On CPU, accelerate starts N processes only in its multi-process mode (`--cpu` runs one).
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", port, script, str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world"] == 2
        assert r["local"] == {"actor": 64 * 64 // 2 + 32, "ref": 64 * 64 // 2 + 32}
        # DeepSpeed's CPU all-reduce buffer (~70 MB a rank) is unlinked once mapped, not left in /dev/shm
        assert r["shm_op"] and r["shm_left"] == []

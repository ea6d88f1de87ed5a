"""The GAN recipe on 2 ranks: generator ZeRO-2, discriminator ZeRO-3, the generator's loss through the
discriminator; its samples move onto the ring, and the export loads in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import assert_keys_read

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]


def test_gan_learns_the_ring_and_exports(tmp_path):
    out = tmp_path / "gan"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([*CLI, "run", "gan", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}",
                           "max_steps=300", "eval.every=0", "eval.size=1024"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert_keys_read(out, "gan")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["roles"]["gen"]["stage"] == 2 and summary["roles"]["disc"]["stage"] == 3
    rows = {r["role"]: r for r in summary["memory"]["per_rank"][0]["roles"]}
    assert rows["disc"]["params_local"] * 2 >= rows["disc"]["params_total"] > rows["disc"]["params_local"]
    before, after = summary["evaluations"][0], summary["evaluations"][-1]
    # a random generator puts no point near the ring's modes; a trained one puts many there, on several modes
    assert before["high_quality"] < 0.05 and after["high_quality"] > 0.2, (before, after)
    assert after["mode_coverage"] >= 0.5 and after["mode_distance"] < before["mode_distance"]

    load = ("import sys, torch; from multiengine.recipes.gan import load_mlp; g = load_mlp(sys.argv[1]); "
            "print(tuple(g(torch.zeros(3, 8)).shape))")
    fresh = subprocess.run([sys.executable, "-c", load, str(out / "export" / "gen")], capture_output=True, text=True,
                           timeout=120)
    assert fresh.returncode == 0 and fresh.stdout.strip() == "(3, 2)", fresh.stderr[-2000:]

"""The README's Python example runs as written on 2 ranks, given the inputs it names (tiny models)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = """
import os, torch
sft_path = rm_path = {opt!r}
prompt_ids = torch.randint(3, 120, (4, 6), generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
"""


def test_readme_example_runs_as_written(tmp_path, tiny_models):
    text = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)\n```", text, flags=re.DOTALL).group(1)
    script = tmp_path / "example.py"
    script.write_text(PRELUDE.format(opt=tiny_models["opt"]) + example + "\nregistry.close()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_free_port()), str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "actor" in proc.stdout and "params here / total" in proc.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    from transformers import AutoModelForCausalLM

    for role in ("actor", "ref", "reward"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / role)
        assert all(p.numel() > 0 for p in model.parameters()), role

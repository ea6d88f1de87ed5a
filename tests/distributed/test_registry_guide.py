"""docs/registry-guide.md's Python blocks, one after the other, run as written on 2 ranks (real DeepSpeed on
CPU ranks, one launch): the stand-ins, the roles at ZeRO-3 (LoRA student, offloaded teacher), the training
loop with its padding collate, generation, a joint loss over a ZeRO-3 and a ZeRO-2 role, checkpoint and
resume, exports. A few lines appended after the page's code report what it computed."""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import _free_port

pytestmark = pytest.mark.distributed

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "registry-guide.md"
MARK = "<!-- guide-script -->"
BLOCK = re.compile(r"(<!-- guide-script -->\n)?```python\n(.*?)```", re.S)

# after the page's code: what each rank computed, for the assertions below (not part of the guide)
REPORT = """
import json, os
json.dump({"loss": metrics["loss"], "heldout": probe["heldout"], "joint_loss": loss.item(),
           "generated": list(out.shape), "prompt": list(prompts.shape), "start": start,
           "train": train.state_dict()}, open(f"rank{os.environ['RANK']}.json", "w"))
"""


def guide_script() -> str:
    blocks = BLOCK.findall(GUIDE.read_text(encoding="utf-8"))
    unmarked = [code.splitlines()[0] for mark, code in blocks if not mark]
    assert not unmarked, f"Python blocks of {GUIDE.name} not marked {MARK} (so not run): {unmarked}"
    assert len(blocks) >= 6, f"{GUIDE.name} lost its Python blocks: {len(blocks)} found"
    return "\n".join(code for _, code in blocks)


def test_every_python_block_of_the_guide_is_part_of_the_script():
    script = guide_script()
    tree = ast.parse(script, "loop.py")  # a syntax error fails here, before any rank starts
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
            defined.update(a.arg for a in node.args.args) if isinstance(node, ast.FunctionDef) else None
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert not used - defined, f"{GUIDE.name} uses names it never defines: {sorted(used - defined)}"


def test_guide_runs_as_written_on_two_ranks(tmp_path):
    (tmp_path / "loop.py").write_text(guide_script() + REPORT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "loop.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-8000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        # mean_over_ranks: the same figure on both ranks; a KL and a cross-entropy are positive and finite
        assert r["loss"] == ranks[0]["loss"] and r["heldout"] == ranks[0]["heldout"]
        assert 0 < r["loss"] < 10 and 0 < r["heldout"] < 2 * math.log(64)
        assert 0 < r["joint_loss"] < 10
        assert r["prompt"] == [4, 4] and r["generated"][0] == 4 and 4 < r["generated"][1] <= 12
        assert r["start"] == 4  # the client state saved with the checkpoint, read back by load_checkpoint
    # 80 rows, 40 per rank: 4 steps x 2 micro batches of 8 and the joint loss's batch = 72 rows, epoch 1 at 32
    assert ranks[0]["train"]["epoch"] == 1 and ranks[0]["train"]["position"] == 32
    assert (tmp_path / "ckpt" / "latest").is_file()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "student")  # LoRA merged into the weights
    assert not any("lora" in name for name, _ in student.named_parameters())
    assert (tmp_path / "out" / "student" / "adapter").is_dir()
    query = load_file(str(tmp_path / "out" / "export" / "query" / "model.safetensors"))
    assert query["embed.weight"].shape == (64, 32)

"""resume_from for rlhf_sft and rlhf_reward from the CLI on 2 ranks: a run resumed from its step-2 checkpoint
ends bit-equal to the uninterrupted 4-step run (every logged training figure per step, the final evaluation and
every exported weight). The step-2 checkpoint is what a run stopped after step 2 leaves: the lifecycle writes
it before step 3 starts, and nothing after it changes it (`latest` moves on to a new folder).

Kept short: one shared set of tiny assets (small data), 4 steps, no evaluation during training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.cli", "run"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
TIMING = ("train/time/", "train/step_time_s")  # timings differ between runs; every other figure must not
STEPS, STOP = 4, 2

# per recipe: its exported role and the overrides that keep it to a few seconds of training
RECIPES = {
    "rlhf_sft": ("actor", ["roles.actor.micro_batch_size=4", "data.heldout_size=8", "eval.every=0", "eval.size=4",
                           "eval.batch_size=4", "eval.greedy=false", "generation.max_new_tokens=4"]),
    "rlhf_reward": ("reward", ["roles.reward.micro_batch_size=4", "data.heldout_size=8", "eval.every=0"]),
}


def cli(*args: str) -> None:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-6000:]


def train_lines(path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith(TIMING)}
            for x in lines if any(k.startswith("train/") for k in x)]


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("rlhf_resume")
    paths = tiny.prepare_builtin(root / "tiny", seed=0, hidden=32, layers=1, n_sft=64, n_reward=64, n_ppo=8,
                                 n_eval=32)
    return root, paths


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_resume_from_a_checkpoint_ends_bit_equal_to_an_uninterrupted_run(assets, recipe):
    root, paths = assets
    role, overrides = RECIPES[recipe]
    common = [recipe, "--config", "tiny", "--nproc-per-node", "2", f"roles.{role}.model={paths['model']}",
              f"data.source={paths['data']}", f"max_steps={STEPS}", f"roles.{role}.warmup_steps=1", *overrides]
    full, resumed = root / f"{recipe}_full", root / f"{recipe}_resumed"
    cli(*common, f"output_dir={full}", f"checkpoint.every={STOP}")
    ckpt = full / "checkpoints" / f"step_{STOP:08d}"
    assert (ckpt / "manifest.json").is_file()
    cli(*common, f"output_dir={resumed}", "checkpoint.every=0", f"resume_from={ckpt}")

    a, b = train_lines(full / "metrics.jsonl"), train_lines(resumed / "metrics.jsonl")
    assert [x["step"] for x in a] == list(range(1, STEPS + 1))
    assert [x["step"] for x in b] == list(range(STOP + 1, STEPS + 1))  # it did start at step 3
    assert a[STOP:] == b  # losses, grad norms, learning rates: equal, not close
    assert len({x["train/loss"] for x in a}) == STEPS  # the steps did train (a frozen run would pass too)

    s_full = json.loads((full / "summary.json").read_text())["metrics"]
    s_res = json.loads((resumed / "summary.json").read_text())["metrics"]
    figures = {k: v for k, v in s_full.items() if "time" not in k}  # losses, held-out and judge figures
    assert "final_loss" in figures and figures == {k: v for k, v in s_res.items() if "time" not in k}

    w_full, w_res = weights(full / "export" / role), weights(resumed / "export" / role)
    assert w_full.keys() == w_res.keys()
    assert all(torch.equal(w_full[k], w_res[k]) for k in w_full)
    w_start = weights(paths["model"])  # and training moved them away from the starting model
    assert any(not torch.equal(w_full[k], w_start[k]) for k in w_full if k in w_start)

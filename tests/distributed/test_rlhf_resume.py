"""resume_from for rlhf_sft and rlhf_reward on 2 ranks: a run resumed from its step-2 checkpoint
ends bit-equal to the uninterrupted 4-step run (every logged training figure per step, the final evaluation and
every exported weight). The step-2 checkpoint is what a run stopped after step 2 leaves: the lifecycle writes
it before step 3 starts, and nothing after it changes it (`latest` moves on to a new folder).

Kept short: one shared set of tiny assets (small data), 4 steps, no evaluation during training, and all four runs
in one launch (workers/recipe_runs.py runs each as the CLI does: checked_config, then main). Resuming through the
CLI itself is tested by test_onpolicy_distill_run.py and test_multinode.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_keys_read

pytestmark = pytest.mark.distributed

TIMING = ("train/time/", "train/step_time_s")  # timings differ between runs; every other figure must not
STEPS, STOP = 4, 2

# keys these runs leave unused: the model and the data are given (no tiny model is built), and no LoRA adapters
# (lora.r=0; LoraSettings' other keys have no `when` yet, recipes/language/roles.py)
UNREAD = ("tiny.hidden", "tiny.layers", "tiny.heads", "lora.alpha", "lora.dropout", "lora.target_modules")
# per recipe: its exported role and the overrides that keep it to a few seconds of training
RECIPES = {
    "rlhf_sft": ("actor", ["roles.actor.micro_batch_size=4", "data.heldout_size=8", "eval.every=0", "eval.size=4",
                           "eval.batch_size=4", "eval.greedy=false", "generation.max_new_tokens=4"]),
    "rlhf_reward": ("reward", ["roles.reward.micro_batch_size=4", "data.heldout_size=8", "eval.every=0"]),
}


def train_lines(path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [{k: v for k, v in x.items() if not k.startswith(TIMING)}
            for x in lines if any(k.startswith("train/") for k in x)]


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no weights in {folder}"
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


def _overrides(recipe: str, paths: dict) -> list[str]:
    role, overrides = RECIPES[recipe]
    return [f"roles.{role}.model={paths['model']}", f"data.source={paths['data']}", f"max_steps={STEPS}",
            f"roles.{role}.warmup_steps=1", *overrides]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny assets, then every recipe's uninterrupted run and its run resumed from the step-2 checkpoint."""
    from conftest import launch
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("rlhf_resume")
    paths = tiny.prepare_builtin(root / "tiny", seed=0, hidden=32, layers=1, n_sft=64, n_reward=64, n_ppo=8,
                                 n_eval=32)
    runs = [[r, [*_overrides(r, paths), f"output_dir={root / f'{r}_full'}", f"checkpoint.every={STOP}"]]
            for r in RECIPES]
    runs += [[r, [*_overrides(r, paths), f"output_dir={root / f'{r}_resumed'}", "checkpoint.every=0",
                  f"resume_from={root / f'{r}_full' / 'checkpoints' / f'step_{STOP:08d}'}"]] for r in RECIPES]
    launch("recipe_runs", root / "runs", json.dumps(runs))
    return root, paths


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_resume_from_a_checkpoint_ends_bit_equal_to_an_uninterrupted_run(assets, recipe):
    root, paths = assets
    role = RECIPES[recipe][0]
    full, resumed = root / f"{recipe}_full", root / f"{recipe}_resumed"
    unread = tuple(k if k.startswith("tiny.") else f"roles.{role}.{k}" for k in UNREAD)
    assert_keys_read(full, recipe, unread)
    assert_keys_read(resumed, recipe, unread)
    assert (full / "checkpoints" / f"step_{STOP:08d}" / "manifest.json").is_file()

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

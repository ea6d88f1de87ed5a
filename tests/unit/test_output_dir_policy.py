"""One run per output_dir: a folder that holds another recipe's run, or a finished run of the same recipe, is refused
before any rank starts (exit 2, nothing in it changed) unless `overwrite=true`, which clears the earlier run's files
(and only those) first; `resume_from=latest` continues a run. A finished run ends with a short summary for the
person who started it. Through the real CLI in this process; registry_demo on the plain-PyTorch backend is the run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from multiengine.recipes.language import cli
from multiengine.recipes.language.lifecycle import folder_run


@pytest.fixture(autouse=True)
def _no_rank_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MULTIENGINE_VALIDATED"):
        monkeypatch.delenv(name, raising=False)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (a refused run must leave all of them as they were)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _old_run(folder: Path, recipe: str, finished: bool = True) -> None:
    """A run's files as the lifecycle leaves them, and inputs beside them that are not the run's."""
    (folder / "checkpoints" / "step_00000007").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000007" / "manifest.json").write_text("{}")
    (folder / "checkpoints" / "latest").write_text("step_00000007")
    (folder / "export" / "critic").mkdir(parents=True)
    (folder / "export" / "critic" / "config.json").write_text("{}")
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    (folder / "logs").mkdir()
    (folder / "logs" / "rank0-error.log").write_text("old")
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 7, "train/loss": 9.0}) + "\n")
    (folder / "curves.png").write_bytes(b"png")
    (folder / "run.json").write_text(json.dumps({"recipe": recipe}))
    if finished:
        (folder / "summary.json").write_text(json.dumps({"recipe": recipe, "metrics": {}}))
    (folder / "tiny").mkdir()  # an input the run built and would reuse
    (folder / "tiny" / "model.bin").write_bytes(b"weights")
    (folder / "sft").mkdir()  # an SFT model a recipe trained first, under its own folder
    (folder / "sft" / "summary.json").write_text(json.dumps({"recipe": "rlhf_sft"}))
    (folder / "notes.txt").write_text("mine")


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


DEMO = ["registry_demo", "--config", "tiny", "backend=torch", "checkpoint.every=1"]


def _steps(folder: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("command", [["validate"], ["run", "--nproc-per-node", "2"], ["run"]])
def test_a_folder_holding_another_recipes_run_is_refused_and_left_as_it_was(tmp_path, capsys, command):
    out = tmp_path / "out"
    out.mkdir()
    _old_run(out, "rlhf_dpo", finished=False)  # unfinished: run.json says whose it is
    before = _tree(out)
    assert cli.main([command[0], *DEMO, *command[1:], f"output_dir={out}"]) == 2
    line = _error(capsys)
    assert "'output_dir'" in line and "holds a run of rlhf_dpo" in line, line
    assert "overwrite=true" in line and "resume_from=latest" in line and "new output_dir" in line, line
    assert _tree(out) == before


@pytest.mark.timeout(300)
def test_overwrite_clears_the_old_run_then_a_rerun_is_refused_and_resume_continues(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    _old_run(out, "rlhf_dpo")
    assert cli.main(["run", *DEMO, "max_steps=2", "overwrite=true", f"output_dir={out}"]) == 0
    # the old run's files are gone, the inputs and the user's own file are kept
    assert not (out / "checkpoints" / "step_00000007").exists() and not (out / "export" / "critic").exists()
    assert not (out / "tensorboard" / "events.out.tfevents.1").exists() and not (out / "logs").exists()
    assert (out / "tiny" / "model.bin").read_bytes() == b"weights" and (out / "notes.txt").read_text() == "mine"
    assert (out / "sft" / "summary.json").is_file()
    assert _steps(out) == [1, 2]  # only this run's steps: nothing appended to the old curve
    assert json.loads((out / "summary.json").read_text())["recipe"] == "registry_demo"
    assert json.loads((out / "run.json").read_text())["recipe"] == "registry_demo"
    # the closing summary, not a JSON blob: what changed, where the export and summary.json are
    shown = capsys.readouterr().out
    assert "registry_demo: 2 steps on 1 rank in " in shown
    assert "  training loss: " in shown and "(first -> last step; " in shown
    assert f"  export: {out / 'export'} (actor)" in shown and f"  summary: {out / 'summary.json'}" in shown
    assert not shown.lstrip().startswith("{")

    # the same run again: a finished run of this recipe, refused, untouched
    before = _tree(out)
    assert cli.main(["run", *DEMO, "max_steps=2", f"output_dir={out}"]) == 2
    line = _error(capsys)
    assert "holds a finished registry_demo run" in line and "resume_from=latest" in line, line
    assert "checkpoint step_00000002" in line and "overwrite=true" in line, line
    assert _tree(out) == before
    # overwrite and resume together contradict each other
    assert cli.main(["run", *DEMO, "overwrite=true", "resume_from=latest", f"output_dir={out}"]) == 2
    assert "'overwrite'" in _error(capsys)
    assert _tree(out) == before

    # resume_from=latest continues it
    assert cli.main(["run", *DEMO, "max_steps=3", "resume_from=latest", f"output_dir={out}"]) == 0
    assert _steps(out) == [1, 2, 3]
    assert "registry_demo: 3 steps on 1 rank" in capsys.readouterr().out


def test_what_a_folder_holds(tmp_path):
    assert folder_run(str(tmp_path / "missing")) is None
    (tmp_path / "logs").mkdir()  # a run that failed its checks leaves logs only: not a run
    (tmp_path / "tiny").mkdir()
    assert folder_run(str(tmp_path)) is None
    (tmp_path / "metrics.jsonl").write_text("")  # a run from before run.json existed: whose is unknown
    assert folder_run(str(tmp_path)) == {"recipe": None, "finished": False, "outputs": ["metrics.jsonl", "logs"]}
    (tmp_path / "summary.json").write_text(json.dumps({"recipe": "rlhf_sft"}))
    assert folder_run(str(tmp_path))["recipe"] == "rlhf_sft" and folder_run(str(tmp_path))["finished"]


@pytest.mark.timeout(300)
def test_sub_runs_and_rlhf_e2e_reruns_are_not_refused(tmp_path, capsys):
    # a recipe that trains its SFT actor under output_dir/sft first: that sub-run is not the folder's run
    grpo = tmp_path / "grpo"
    (grpo / "sft").mkdir(parents=True)
    (grpo / "sft" / "summary.json").write_text(json.dumps({"recipe": "rlhf_sft"}))
    assert cli.main(["validate", "rlhf_grpo", "--config", "tiny", f"output_dir={grpo}"]) == 0
    # rlhf_e2e reuses or reruns its own steps: its finished folder is where it runs again
    e2e = tmp_path / "e2e"
    e2e.mkdir()
    (e2e / "summary.json").write_text(json.dumps({"recipe": "rlhf_e2e"}))
    assert cli.main(["validate", "rlhf_e2e", "--config", "tiny", f"output_dir={e2e}"]) == 0
    # ... but not into another recipe's run
    assert cli.main(["validate", "rlhf_e2e", "--config", "tiny", f"output_dir={grpo / 'sft'}"]) == 2
    assert "holds a run of rlhf_sft" in _error(capsys)


@pytest.mark.timeout(300)
def test_overwrite_never_clears_the_working_directory(tmp_path, capsys, monkeypatch):
    _old_run(tmp_path, "rlhf_dpo")
    monkeypatch.chdir(tmp_path / "tiny")
    before = _tree(tmp_path)
    assert cli.main(["validate", *DEMO, "overwrite=true", f"output_dir={tmp_path}"]) == 2
    assert "working directory" in _error(capsys)
    assert _tree(tmp_path) == before
    assert os.getcwd() == str(tmp_path / "tiny")


def test_the_closing_summary_compares_the_first_and_last_evaluation(tmp_path):
    from types import SimpleNamespace

    from multiengine.recipes.language.lifecycle import Recipe

    class Toy(Recipe):
        name = "toy"
        headline = (("accuracy", "held-out accuracy", True), ("loss", "held-out loss", False), ("judge", "judge", True))

    run = Toy(SimpleNamespace(output_dir=str(tmp_path), export=SimpleNamespace(enabled=False)))
    run.registry, run.step = SimpleNamespace(world_size=2), 5
    run.history = [{"tag": "before", "step": 0, "accuracy": 0.5, "loss": 1.0},
                   {"tag": "step_3", "step": 3, "accuracy": 0.9, "loss": 0.1, "judge": 0.3},
                   {"tag": "after", "step": 5, "accuracy": 0.75, "loss": 1.25, "judge": 0.4}]
    assert run.closing_summary({}, None, 75.0).splitlines() == [
        "toy: 5 steps on 2 ranks in 1 min 15 s",
        "  held-out accuracy: 0.5 -> 0.75 (before -> after; improved)",
        "  held-out loss: 1 -> 1.25 (before -> after; got worse)",  # the judge was not in the first evaluation
        "  export: none (export.enabled=false)",
        f"  summary: {tmp_path / 'summary.json'} (every figure, per-rank memory, the resolved config)"]

"""Bad input across the real recipes, through the real CLI in a subprocess: each case must exit 2 with exactly
one `error:` line naming the key or file, no traceback, and nothing written under the run's output_dir.

Most cases use `multiengine validate` (one process, no rank, no model built); the `run` cases show that a
launch checks first: no rank starts and no output folder appears. Every input is also a row of
docs/bad-inputs.md, run in-process by test_bad_input_table.py; here a sample of each kind goes through a real
subprocess (the console entry point, exit codes, stderr as a user sees it), the `run` cases all of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Case:
    id: str
    recipe: str
    args: tuple[str, ...]  # overrides / options; "{d}" is the folder of the data files below
    names: tuple[str, ...]  # each must appear in the error line (the key, the value or the file)
    command: str = "validate"


CASES = [
    # an unknown key (in a user's YAML file)
    Case("dpo-typo-in-yaml", "rlhf_dpo", ("--config", "{d}/dpo_typo.yaml"), ("dpo.betta", "dpo_typo.yaml")),
    # out-of-range values
    Case("sft-max-steps-0", "rlhf_sft", ("max_steps=0",), ("max_steps", "0")),
    # a wrong choice (sd_finetune's mode=foo is the `run` case below)
    Case("e2e-algorithm", "rlhf_e2e", ("algorithm=a2c",), ("algorithm", "a2c")),
    # bad override syntax
    Case("override-no-equals", "rlhf_reward", ("max_steps",), ("max_steps",)),
    # missing files and folders
    Case("ppo-missing-actor", "rlhf_ppo", ("roles.actor.model={d}/no_such_export",),
         ("roles.actor.model", "no_such_export")),
    Case("missing-config-file", "distill", ("--config", "{d}/nope.yaml"), ("nope.yaml",)),
    # bad data: unreadable images, held-out split too large
    Case("sd-corrupt-image", "sd_finetune", ("data.source={d}/corrupt",), ("broken.png",)),
    Case("heldout-too-big", "rlhf_sft", ("data.source={d}/sft.jsonl", "data.eval_split=1000"),
         ("data.eval_split", "1000")),
    # `run` checks before any rank starts
    Case("run-2ranks-stage", "rlhf_sft", ("--nproc-per-node", "2", "roles.actor.stage=7"),
         ("roles.actor.stage", "7"), command="run"),
    Case("run-2ranks-missing-data", "rlhf_reward", ("--nproc-per-node", "2", "data.source={d}/nope.jsonl"),
         ("data.source", "nope.jsonl"), command="run"),
    Case("run-2ranks-bad-choice", "sd_finetune", ("--nproc-per-node", "2", "mode=foo"), ("mode", "foo"),
         command="run"),
    Case("run-here-max-steps", "registry_demo", ("max_steps=0",), ("max_steps", "0"), command="run"),
]


def _write_data(d: Path) -> None:
    from PIL import Image

    def jsonl(name: str, rows: list[dict]) -> None:
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    jsonl("sft.jsonl", [{"prompt": f"list {i}", "response": "a b c"} for i in range(8)])
    (d / "dpo_typo.yaml").write_text("# a user's config with a typo\ndpo:\n  betta: 0.2\n")
    corrupt = d / "corrupt"
    corrupt.mkdir()
    for i in range(12):  # more rows than the tiny config holds out, so the image check is what fails
        Image.new("RGB", (16, 16), (i * 20, 0, 0)).save(corrupt / f"{i}.png")
    (corrupt / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature, no image
    jsonl("corrupt/metadata.jsonl", [{"file_name": f, "text": "a red square"}
                                     for f in [*(f"{i}.png" for i in range(12)), "broken.png"]])


def _argv(case: Case, d: Path) -> list[str]:
    args = [a.replace("{d}", str(d)) for a in case.args]
    config = [] if "--config" in args else ["--config", "tiny"]
    return [sys.executable, "-m", "multiengine.recipes.language.cli", case.command, case.recipe, *config, *args,
            f"output_dir={d / 'out' / case.id}"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path, float]]:
    """Every case run once; two at a time, as each spends most of its few seconds importing."""
    d = tmp_path_factory.mktemp("bad_inputs")
    _write_data(d)
    env = {k: v for k, v in os.environ.items()  # no rank variables left by another test's in-process registry
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")

    def one(case: Case) -> tuple[subprocess.CompletedProcess, Path, float]:
        start = time.monotonic()
        # cwd = d: relative default paths (a PPO config's `outputs/rlhf_sft/...`) resolve inside the tmp dir
        proc = subprocess.run(_argv(case, d), capture_output=True, text=True, env=env, cwd=d, timeout=240)
        return proc, d, time.monotonic() - start

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([c.id for c in CASES], pool.map(one, CASES)))


def test_enough_cases_across_the_recipes_and_both_commands():
    assert len({c.id for c in CASES}) == len(CASES) >= 12
    assert {c.command for c in CASES} == {"validate", "run"}
    assert {c.recipe for c in CASES} >= {"rlhf_sft", "rlhf_reward", "rlhf_ppo", "rlhf_dpo", "rlhf_e2e",
                                          "sd_finetune", "distill", "registry_demo"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_error_line_exit_2_and_no_output(results, case):
    proc, d, seconds = results[case.id]
    shown = f"{' '.join(_argv(case, d)[2:])}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, shown
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, shown
    for name in case.names:
        assert name.replace("{d}", str(d)) in errors[0], shown
    assert "Traceback" not in proc.stderr, shown
    assert not (d / "out" / case.id).exists(), f"{case.id}: the failed check left {d / 'out' / case.id}"
    assert not (d / "outputs").exists()  # nor under a recipe's default output folder

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
    # unknown keys (with a suggestion where one is close)
    Case("sft-unknown-key", "rlhf_sft", ("train.lrr=1e-3",), ("train.lrr", "train.lr")),
    Case("sft-unknown-section", "rlhf_sft", ("optimizer.lr=1e-3",), ("optimizer",)),
    Case("reward-unknown-role", "rlhf_reward", ("roles.critic.stage=2",), ("roles.critic",)),
    Case("dpo-typo-in-yaml", "rlhf_dpo", ("--config", "{d}/dpo_typo.yaml"), ("dpo.betta", "dpo_typo.yaml")),
    Case("distill-unknown-key", "distill", ("distill.temp=2",), ("distill.temp",)),
    Case("demo-removed-key", "sd_finetune", ("model.tiny_text_encoders=2",), ("model.tiny_text_encoders",)),
    # out-of-range values
    Case("sft-max-steps-0", "rlhf_sft", ("max_steps=0",), ("max_steps", "0")),
    Case("sft-max-steps-neg", "rlhf_sft", ("max_steps=-1",), ("max_steps", "-1")),
    Case("sft-stage-5", "rlhf_sft", ("roles.actor.stage=5",), ("roles.actor.stage", "5")),
    Case("sd-unet-stage-5", "sd_finetune", ("roles.unet.stage=5",), ("roles.unet.stage", "5")),
    Case("ppo-rollout-0", "rlhf_ppo", ("ppo.rollout_batch_size=0",), ("ppo.rollout_batch_size", "0")),
    Case("grpo-top-p-0", "rlhf_grpo", ("generation.top_p=0",), ("generation.top_p",)),
    Case("dpo-label-smoothing", "rlhf_dpo", ("dpo.label_smoothing=0.5",), ("dpo.label_smoothing", "0.5")),
    Case("reward-lr-0", "rlhf_reward", ("train.lr=0",), ("train.lr",)),
    Case("demo-seq-len", "registry_demo", ("seq_len=1000",), ("seq_len", "1000")),
    Case("distill-alpha", "distill", ("distill.alpha=2",), ("distill.alpha", "2")),
    Case("sd-resolution", "sd_finetune", ("data.resolution=4",), ("data.resolution", "4")),
    Case("timeout-0", "rlhf_grpo", ("dist_timeout_s=0",), ("dist_timeout_s",)),
    Case("e2e-timeout-0", "rlhf_e2e", ("dist_timeout_s=0",), ("dist_timeout_s", "0")),
    Case("nonfinite-max-skips", "registry_demo", ("nonfinite.max_skips=-2",), ("nonfinite.max_skips",)),
    # wrong choices and types
    Case("sd-mode-foo", "sd_finetune", ("mode=foo",), ("mode", "foo")),
    Case("ppo-generation-mode", "rlhf_ppo", ("generation.mode=beam",), ("generation.mode", "beam")),
    Case("dpo-loss", "rlhf_dpo", ("dpo.loss=hinge2",), ("dpo.loss", "hinge2")),
    Case("e2e-algorithm", "rlhf_e2e", ("algorithm=a2c",), ("algorithm", "a2c")),
    Case("sft-scheduler", "rlhf_sft", ("train.scheduler=cosyne",), ("train.scheduler", "cosyne")),
    Case("demo-backend", "registry_demo", ("backend=jax",), ("backend", "jax")),
    Case("nonfinite-policy", "rlhf_reward", ("nonfinite.policy=ignore",), ("nonfinite.policy", "ignore")),
    Case("sft-steps-not-int", "rlhf_sft", ("max_steps=ten",), ("max_steps", "ten")),
    Case("sd-offload-needs-z3", "sd_finetune", ("roles.unet.stage=2", "roles.unet.offload_params=true"),
         ("roles.unet.offload_params",)),
    # bad list / override syntax
    Case("sd-unclosed-list", "sd_finetune", ("validation.prompts=[a cat, a dog",), ("validation.prompts",)),
    Case("sft-list-for-int", "rlhf_sft", ("train.micro_batch_size=[1,2]",), ("train.micro_batch_size",)),
    Case("override-no-equals", "rlhf_reward", ("max_steps",), ("max_steps",)),
    Case("lora-empty-targets", "rlhf_sft", ("lora.enabled=true", "lora.target_modules=[]"),
         ("lora.target_modules",)),
    # missing files and folders
    Case("sft-missing-data", "rlhf_sft", ("data.source={d}/nope.jsonl",), ("data.source", "nope.jsonl")),
    Case("ppo-missing-actor", "rlhf_ppo", ("model.actor={d}/no_such_export",), ("model.actor", "no_such_export")),
    Case("sft-model-no-config", "rlhf_sft", ("model.pretrained={d}/empty_model",), ("model.pretrained", "empty_model")),
    Case("resume-missing", "rlhf_sft", ("resume_from={d}/no_ckpt",), ("resume_from", "no_ckpt")),
    Case("missing-config-file", "distill", ("--config", "{d}/nope.yaml"), ("nope.yaml",)),
    Case("sd-missing-folder", "sd_finetune", ("data.source={d}/no_images",), ("data.source", "no_images")),
    # bad data: columns, empty files, unreadable images
    Case("sft-wrong-columns", "rlhf_sft", ("data.source={d}/qa.jsonl",), ("qa.jsonl",)),
    Case("sft-bad-column-map", "rlhf_sft", ("data.source={d}/qa.jsonl", "data.columns.prompt=query"),
         ("query",)),
    Case("reward-no-rejected", "rlhf_reward", ("data.source={d}/chosen_only.jsonl",), ("chosen_only.jsonl",)),
    Case("dpo-empty-jsonl", "rlhf_dpo", ("data.source={d}/empty.jsonl",), ("empty.jsonl",)),
    Case("sd-no-images", "sd_finetune", ("data.source={d}/text_only",), ("text_only",)),
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

    jsonl("qa.jsonl", [{"question": f"list {i}", "answer": "a b c"} for i in range(8)])
    jsonl("sft.jsonl", [{"prompt": f"list {i}", "response": "a b c"} for i in range(8)])
    jsonl("chosen_only.jsonl", [{"prompt": f"list {i}", "chosen": "a b c"} for i in range(8)])
    (d / "empty.jsonl").write_text("")
    (d / "dpo_typo.yaml").write_text("# a user's config with a typo\ndpo:\n  betta: 0.2\n")
    (d / "empty_model").mkdir()
    (d / "text_only").mkdir()
    (d / "text_only" / "notes.txt").write_text("no images here\n")
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
    return [sys.executable, "-m", "multiengine.recipes.cli", case.command, case.recipe, *config, *args,
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


# each kind of input once (the table runs them all in-process), and every `run` case
SUBPROCESS = {"sft-unknown-key", "dpo-typo-in-yaml", "sft-max-steps-0", "sd-mode-foo", "e2e-algorithm",
              "sd-unclosed-list", "override-no-equals", "ppo-missing-actor", "missing-config-file",
              "reward-no-rejected", "sd-corrupt-image", "heldout-too-big", "distill-unknown-key"}
CASES = [c for c in CASES if c.id in SUBPROCESS or c.command == "run"]


def test_enough_cases_across_the_recipes_and_both_commands():
    assert len({c.id for c in CASES}) == len(CASES) >= 15
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

"""Rollouts out of lockstep from the CLI on 2 CPU ranks: the actor on rank 0 and its rollouts generated on rank 1
(roles.rollout.ranks=[1]; transformers and vLLM), one_step_off and bounded-staleness async in rlhf_grpo and rlhf_ppo;
every trained batch's version; runs killed with SIGKILL during a generation and during a save, resumed with
resume_from=latest, ending on the uninterrupted run's weights bit for bit with the same samples trained; on every
rank (no rollout ranks) async with max_staleness=0 is the sync run bit for bit."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_keys_read, subprocess_env

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli", "run"]
TIMING = ("time/", "gen/", "step_time_s", "sync_s", "wait_s")
EVAL = ["eval.size=64", "eval.batch_size=32", "eval.every=0"]
SPLIT = ["roles.rollout.ranks=[1]", "grpo.rollout_is_cap=2"]
# a reward function of weight 1 that adds 0 and, when told by the environment, kills its own rank with SIGKILL at a
# step: at once (the rollout rank is then generating the next batch), or when that step's checkpoint is being written
KILLER = """
import os, signal, threading, time
from pathlib import Path


def killer(prompts, completions, **kwargs):
    out = os.environ.get("KILL_DIR")
    if out:
        out, step = Path(out), int(os.environ["KILL_STEP"])
        metrics = out / "metrics.jsonl"
        done = sum('"train/' in x for x in metrics.read_text().splitlines()) if metrics.is_file() else 0
        if done + 1 == step and not (out / "killed").exists():
            (out / "killed").write_text(os.environ["KILL_WHEN"])
            if os.environ["KILL_WHEN"] == "generation":
                os.kill(os.getpid(), signal.SIGKILL)
            staging = out / "checkpoints" / f".tmp-step_{step:08d}"

            def kill_in_save():
                while not staging.exists():
                    time.sleep(0.0005)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=kill_in_save, daemon=True).start()
    return [0.0] * len(completions)
"""


def cli(*args: str, env: dict[str, str] | None = None, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900,
                          env=subprocess_env(**(env or {})))
    assert (proc.returncode == 0) == ok, proc.stderr[-6000:]
    return proc


def steps(out: Path) -> dict[int, dict]:
    """Each step's last logged metrics (a resumed run logs the steps after its checkpoint again)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if any(k.startswith("train/") for k in r)}


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "export" / "actor" / "model.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The rollouts on rank 1: one_step_off (its SFT actor, trained first, is every later run's) and async, each
    uninterrupted and killed (during a generation, during a save) then resumed."""
    root = tmp_path_factory.mktemp("async_rollouts")
    (root / "kill_rewards.py").write_text(KILLER)
    base = ["--config", "tiny", "--nproc-per-node", "2", *EVAL,
            f"reward.functions=[builtin:judge, {{fn: '{root}/kill_rewards.py:killer', weight: 1.0}}]"]
    out = {name: root / name for name in ("off", "off_killed", "async", "async_killed")}
    off = [*base, *SPLIT, "generation.schedule=one_step_off", "max_steps=12", "checkpoint.every=4",
           "checkpoint.keep_last=3"]
    cli("rlhf_grpo", *off, f"output_dir={out['off']}")
    actor = f"roles.actor.model={out['off']}/sft/export/actor"
    off.append(actor)
    kill = {"KILL_DIR": str(out["off_killed"]), "KILL_STEP": "7", "KILL_WHEN": "generation"}
    cli("rlhf_grpo", *off, f"output_dir={out['off_killed']}", env=kill, ok=False)
    cli("rlhf_grpo", *off, f"output_dir={out['off_killed']}", "resume_from=latest", env=kill)
    # async, 2 steps ahead, killed while writing its step-6 checkpoint
    asy = [*base, *SPLIT, actor, "generation.schedule=async", "generation.max_staleness=2", "max_steps=9",
           "checkpoint.every=3", "checkpoint.keep_last=3"]
    cli("rlhf_grpo", *asy, f"output_dir={out['async']}")
    kill = {"KILL_DIR": str(out["async_killed"]), "KILL_STEP": "6", "KILL_WHEN": "save"}
    cli("rlhf_grpo", *asy, f"output_dir={out['async_killed']}", env=kill, ok=False)
    latest = (out["async_killed"] / "checkpoints" / "latest").read_text()
    cli("rlhf_grpo", *asy, f"output_dir={out['async_killed']}", "resume_from=latest", env=kill)
    return {**out, "async_latest": latest, "actor": actor, "root": root}


@pytest.fixture(scope="module")
def more(runs):
    """PPO with its critic on a rollout rank; GRPO with vLLM on the rollout rank (its own SFT actor: vLLM's CPU
    attention needs head size 32); on every rank: sync, async with max_staleness 0, one_step_off."""
    root, actor = runs["root"], runs["actor"]
    out = {name: root / name for name in ("ppo", "vllm", "sync", "async0", "colocated", "dynamic", "multiturn")}
    cli("rlhf_ppo", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out['ppo']}", actor,
        f"roles.reward.model={runs['off']}/tiny/model", "roles.rollout.ranks=[1]", "generation.schedule=one_step_off",
        "max_steps=4", "eval.size=32", "eval.batch_size=32", "eval.every=0", "ppo.rollout_batch_size=16")
    if importlib.util.find_spec("vllm") is not None:
        cli("rlhf_grpo", "--config", "tiny_vllm", "--nproc-per-node", "2", *EVAL, *SPLIT,
            "generation.schedule=one_step_off", "max_steps=12", "checkpoint.every=0", f"output_dir={out['vllm']}")
    every = ["--config", "tiny", "--nproc-per-node", "2", *EVAL, actor, "max_steps=5", "checkpoint.every=0"]
    cli("rlhf_grpo", *every, f"output_dir={out['sync']}")
    cli("rlhf_grpo", *every, f"output_dir={out['async0']}", "generation.schedule=async", "generation.max_staleness=0")
    cli("rlhf_grpo", *every, f"output_dir={out['colocated']}", "generation.schedule=one_step_off")
    # the schedules with dynamic sampling's rounds and with multi-turn episodes (on every rank)
    cli("rlhf_grpo", "--config", "tiny", "--nproc-per-node", "2", *EVAL, actor, "max_steps=3", "checkpoint.every=0",
        f"output_dir={out['dynamic']}",
        "generation.schedule=one_step_off", "grpo.dynamic_sampling=true")
    cli("rlhf_grpo", "--config", "tiny_multiturn", "--nproc-per-node", "2", *EVAL, "max_steps=3",
        "checkpoint.every=0", f"output_dir={out['multiturn']}", "generation.schedule=async",
        "generation.max_staleness=2")
    return out


def _versions(run: Path, depth: int) -> None:
    for step, m in steps(run).items():  # step s (from 1) trains batch s-1, generated by version max(0, s-1-depth)
        version = max(0, step - 1 - depth)
        assert m["train/rollout/version_min"] == m["train/rollout/version_max"] == version, (step, m)
        assert m["train/rollout/staleness_max"] == min(step - 1, depth) <= depth


def test_one_step_off_on_a_rollout_rank_trains_each_batch_one_version_old_and_learns(runs):
    summary = json.loads((runs["off"] / "summary.json").read_text())
    m = summary["metrics"]
    assert m["eval/after/judge"] > m["eval/before/judge"] + 0.03, m  # test_grpo_variants' threshold
    _versions(runs["off"], 1)
    for step, x in steps(runs["off"]).items():
        assert x["train/rollout/sync_bytes"] > 0 and x["train/rollout/in_flight_rows"] == 64, x  # 16 prompts x 4
        assert x["train/rollout/trained_rows"] == 64 * step, x
        assert "train/rollout/logprob_mismatch" in x and abs(x["train/rollout/is_weight_mean"] - 1) < 1, x
    assert summary["rollouts"]["ranks"] == [1] and summary["rollouts"]["trained_rows"] == 12 * 64
    assert summary["roles"].keys() == {"actor", "ref"}  # no DeepSpeed engine on the rollout rank
    assert_keys_read(runs["off"], "rlhf_grpo", ("actor_sft.config",))


@pytest.mark.parametrize("run, killed", [("off", "off_killed"), ("async", "async_killed")])
def test_a_run_killed_and_resumed_ends_on_the_same_weights_and_samples(runs, run, killed):
    assert same_weights(runs[run], runs[killed])
    a = json.loads((runs[run] / "summary.json").read_text())["rollouts"]
    b = json.loads((runs[killed] / "summary.json").read_text())["rollouts"]
    assert a == b  # the same batches trained in the same order with the same versions, none lost or twice
    straight, resumed = steps(runs[run]), steps(runs[killed])
    assert straight.keys() == resumed.keys()
    for step, x in straight.items():
        y = resumed[step]
        assert {k: v for k, v in x.items() if not any(t in k for t in TIMING)} == \
            {k: v for k, v in y.items() if not any(t in k for t in TIMING)}, step


def test_the_save_kill_landed_during_the_save(runs):
    assert (runs["async_killed"] / "killed").read_text() == "save"
    assert runs["async_latest"] == "step_00000003"  # step 6's checkpoint never completed


def test_async_keeps_batches_at_most_max_staleness_old(runs):
    _versions(runs["async"], 2)
    assert_keys_read(runs["async"], "rlhf_grpo", ("actor_sft.config", "actor_sft.overrides"))


def test_ppo_with_its_critic_on_a_rollout_rank(more):
    _versions(more["ppo"], 1)
    for x in steps(more["ppo"]).values():
        assert x["train/value_loss"] > 0 and x["train/rollout/sync_bytes"] > 0, x
    rollouts = json.loads((more["ppo"] / "summary.json").read_text())["rollouts"]
    assert rollouts["trained_rows"] == 4 * 16 and rollouts["engine"]["engine"] == "transformers", rollouts


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (README)")
def test_one_step_off_with_vllm_on_the_rollout_rank_learns(more):
    summary = json.loads((more["vllm"] / "summary.json").read_text())
    m = summary["metrics"]
    assert m["eval/after/judge"] > m["eval/before/judge"] + 0.03, m
    assert summary["rollouts"]["engine"]["engine"] == "vllm"
    _versions(more["vllm"], 1)


def test_on_every_rank_async_with_no_staleness_is_sync_and_one_step_off_is_one_version_behind(more):
    assert same_weights(more["sync"], more["async0"])
    sync, async0 = steps(more["sync"]), steps(more["async0"])
    for step, x in sync.items():
        assert all(async0[step][k] == v for k, v in x.items() if not any(t in k for t in TIMING)), step
    _versions(more["colocated"], 1)
    assert not same_weights(more["sync"], more["colocated"])


def test_schedules_run_dynamic_sampling_and_multi_turn_episodes(more):
    _versions(more["dynamic"], 1)
    assert all(x["train/dynamic/rounds"] >= 1 for x in steps(more["dynamic"]).values())
    _versions(more["multiturn"], 2)
    assert all(x["train/multiturn/turns"] >= 1 for x in steps(more["multiturn"]).values())

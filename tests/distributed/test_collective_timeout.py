"""The collective timeout on 2 real ranks: a rank that stops inside the gradient reduction (ZeRO-2 and ZeRO-3) ends
the job within the timeout, with one error line naming the collective; and close() then a new registry in the same
process works, round after round, each round's timeout on every group DeepSpeed creates."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed

TOY_PKG = "stop_recipes"
# Rank 1 stops (SIGSTOP: alive, holding its sockets, answering nothing) after its forward, so rank 0's first
# collective afterwards is its backward's gradient reduction. One Linear(64, 1): every parameter is below ZeRO-3's
# persistence threshold, so the forward and backward gather nothing at either stage.
STOP = '''
import os
import signal
import time
from dataclasses import dataclass

import torch
from multiengine.engines import EngineRegistry, RoleSpec, train_ds_config
from multiengine.engines.settings import setting
from multiengine.recipes.language.lifecycle import Recipe, RunConfig


@dataclass(frozen=True)
class StopConfig(RunConfig):
    max_steps: int = setting(40, "steps")
    dist_timeout_s: float = setting(10.0, "collective timeout")
    stage: int = setting(2, "ZeRO stage")
    stop_at: int = setting(2, "the step whose backward rank 1 never joins")


class StopInReduction(Recipe):
    name = "stop"
    Config = StopConfig

    @classmethod
    def main(cls, cfg):
        registry = EngineRegistry(backend="deepspeed", timeout_s=cfg.dist_timeout_s)
        torch.manual_seed(0)
        registry.add(RoleSpec("actor", lambda: torch.nn.Linear(64, 1),
                              train_ds_config(stage=cfg.stage, dtype="fp32", micro_batch_size=2),
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01)))
        registry.build()
        actor = registry["actor"]
        for step in range(cfg.max_steps):
            loss = actor(torch.randn(2, 64)).pow(2).mean()
            if step == cfg.stop_at and registry.rank == 1:
                with open(os.path.join(cfg.output_dir, "stopped_at"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            actor.backward(loss)
            actor.step()
        return {"steps": cfg.max_steps}


RECIPE = StopInReduction
'''


@pytest.fixture(scope="module")
def stop_recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop_recipes")
    (root / TOY_PKG).mkdir()
    (root / TOY_PKG / "__init__.py").write_text("")
    (root / TOY_PKG / "stop.py").write_text(STOP)
    (root / "configs").mkdir()
    return root


def _live(marker: str) -> list[str]:
    """Processes (not zombies) whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and int(pid) != os.getpid():
            found.append(f"{pid} [{state}] {cmdline[:160]}")
    return found


# ZeRO-2 all-reduces each gradient bucket; ZeRO-3 reduce-scatters it (both in the engine's backward epilogue).
REDUCTION = {2: ("stage_1_and_2.py", "allreduce_bucket"), 3: ("stage3.py", "reduce")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_rank_stopped_in_the_gradient_reduction_ends_the_job_within_the_timeout(tmp_path, stop_recipes, stage):
    out, timeout_s = tmp_path / f"stop{stage}", 10
    cmd = [sys.executable, "-m", "multiengine.recipes.language.cli", "--recipes-package", TOY_PKG, "--configs-dir",
           str(stop_recipes / "configs"), "run", "stop", "--nproc-per-node", "2", f"output_dir={out}",
           f"dist_timeout_s={timeout_s}", f"stage={stage}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(stop_recipes),
                                                                            os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    ended = time.time()
    assert (out / "stopped_at").is_file(), proc.stderr[-3000:]
    took = ended - float((out / "stopped_at").read_text())
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the timeout, then the launcher's grace before it kills the stopped rank, and the report
    assert took <= timeout_s + 15, f"the job took {took:.0f} s after the rank stopped"
    assert _live(str(out)) == []
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("error: rank 0: collective ") and f"timed out after {timeout_s} s" in errors[0]
    assert "Traceback" not in proc.stderr
    trace = (out / "logs" / "rank0-error.log").read_text()
    where, what = REDUCTION[stage]
    assert any(where in line and what in line.lower() for line in trace.splitlines()), trace[-3000:]


@pytest.mark.timeout(600)
def test_close_then_a_new_registry_in_the_same_process_three_times(tmp_path):
    ranks = launch("rebuild", tmp_path, timeout=500)
    for rank in ranks:
        rounds = rank["rounds"]
        assert len(rounds) == 3
        for timeout_s, one in zip((41, 42, 43), rounds):
            assert one["timeouts"] == [timeout_s], one  # the default group and each of DeepSpeed's
            assert one["groups"] >= 2 and one["after_close"] is False, one
            for losses in one["losses"].values():
                assert losses[1] < losses[0]  # the step trained
        # the same seed and data: every round trains exactly as the first
        assert rounds[1]["losses"] == rounds[0]["losses"] == rounds[2]["losses"]
    assert ranks[0]["rounds"][0]["losses"] != ranks[1]["rounds"][0]["losses"]  # each rank's own data

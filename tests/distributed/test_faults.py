"""Faults on 2 real ranks: crafted checkpoints, a kill inside a re-save, a stopped rank, stop signals,
a lost launcher, non-finite losses (skip and stop policies), and a stale JIT build lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]


# --- crafted checkpoints ------------------------------------------------------------------------
def test_malicious_pickle_in_any_checkpoint_file_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    prepared = launch("faults_ckpt", tmp_path / "prepare", "prepare", str(ckpt))
    ranks = launch("faults_ckpt", tmp_path / "poison", "poison", str(ckpt))
    kinds = ranks[0]["kinds"]
    # Every file the loader reads: ours (JSON + safetensors) and each DeepSpeed file of both roles.
    expected = {
        "manifest.json",
        "client_state/rank_{r}.json", "client_state/rank_{r}.safetensors",
        "rng/rank_{r}.json", "rng/rank_{r}.safetensors",
        "ema/rank_{r}.json", "ema/rank_{r}.safetensors",
        "actor/state/zero_pp_rank_{r}_mp_rank_00_model_states.pt",  # ZeRO-3: model states per rank
        "actor/state/zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        "critic/state/mp_rank_00_model_states.pt",  # ZeRO-2 (bf16)
        "critic/state/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
    }
    assert set(kinds) == expected, kinds
    for r in ranks:
        for kind in kinds:
            refused = r["refused"][kind]
            assert refused is not None, f"{kind} with a malicious pickle was loaded"
            assert refused["type"] in ("CheckpointError", "UnsafeCheckpointError"), refused
            assert os.path.basename(kind).split("{r}")[0] in refused["message"], (kind, refused["message"])
            if kind.endswith(".pt"):
                assert refused["type"] == "UnsafeCheckpointError" and "GLOBAL exec" in refused["message"], refused
        assert "format 1" in r["old_format"] and "pickle" in r["old_format"]
        assert r["markers"] == [], "unpickling ran the attacker's code"
        # The clean checkpoint still loads: the allow-list covers what DeepSpeed really writes.
        assert r["client_state"] == {"step": 2, "note": "clean"}
    for p, q in zip(prepared, ranks):
        for role in ("actor", "critic", "ema"):
            assert q["params"][role] == pytest.approx(p["params"][role], rel=1e-6)


def test_kill_while_resaving_the_latest_tag_keeps_latest_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch("faults_ckpt", tmp_path / "resave", "resave", str(ckpt), expect_fail=True)
    before = json.loads((tmp_path / "resave" / "rank0.json").read_text())
    assert before["entries_after_resave"] == ["latest", "same"]  # a normal re-save leaves no aside copy
    # Killed after the old 'same' was removed, before the new one was renamed in: `latest` names the aside copy.
    assert (ckpt / "latest").read_text() == ".old-same"
    assert not (ckpt / "same").exists() and (ckpt / ".tmp-same").is_dir()
    ranks = launch("faults_ckpt", tmp_path / "verify", "verify", str(ckpt))
    for r in ranks:
        assert r["client_state"] == {"step": 2}
        for role in ("actor", "critic", "ema"):
            assert r["params"][role] == pytest.approx(before["params_at_2"][role], rel=1e-6)
        # The next save clears the aside copy and the stale temp folder of the same tag stays harmless.
        assert r["latest_after_next"] == "next"
        assert ".old-same" not in r["entries_after_next"]


# --- a stopped rank, stop signals, a lost launcher --------------------------------------------------
TOY_PKG = "me_fault_recipes"

HANG = '''
import os
import signal
import time
from dataclasses import dataclass

import torch
from multiengine.engines import EngineRegistry, RoleSpec, train_ds_config
from multiengine.engines.settings import setting
from multiengine.recipes.language.lifecycle import Recipe, RunConfig


@dataclass(frozen=True)
class HangConfig(RunConfig):
    max_steps: int = setting(40, "steps")
    dist_timeout_s: float = setting(10.0, "collective timeout")
    stop_at: int = setting(3, "the step at which rank 1 stops")


class Hang(Recipe):
    name = "hang"
    Config = HangConfig

    @classmethod
    def main(cls, cfg):
        registry = EngineRegistry(backend="deepspeed", timeout_s=cfg.dist_timeout_s)
        torch.manual_seed(0)
        registry.add(RoleSpec("actor", lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)),
                              train_ds_config(stage=3, dtype="fp32", micro_batch_size=2),
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01)))
        registry.build()
        actor = registry["actor"]
        for step in range(cfg.max_steps):
            if step == cfg.stop_at and registry.rank == 1:
                with open(os.path.join(cfg.output_dir, "stopped_at"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, holding its sockets, answering nothing
            loss = actor(torch.randn(2, 64)).pow(2).mean()
            actor.backward(loss)
            actor.step()
        return {"steps": cfg.max_steps}


RECIPE = Hang
'''

SLEEPER = '''
import os
import time
from pathlib import Path

from multiengine.recipes.language.lifecycle import Recipe, RunConfig


class Sleeper(Recipe):
    name = "sleeper"
    Config = RunConfig

    @classmethod
    def main(cls, cfg):
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
        time.sleep(600)
        return {}


RECIPE = Sleeper
'''


NAN = '''
import json
import os
from dataclasses import dataclass

import torch
from multiengine.engines import OptimSpec, Placement, mean_over_ranks, save_role, trainable_role
from multiengine.engines.settings import section, setting
from multiengine.recipes.language.lifecycle import CheckpointSettings, Recipe, RunConfig

STAGES = {"s0": 0, "s2": 2, "s3": 3}  # stage 0: our own check decides; 2 and 3: DeepSpeed's overflow verdict


@dataclass(frozen=True)
class NaNConfig(RunConfig):
    max_steps: int = setting(4, "steps")
    backend: str = setting("deepspeed", "the backend")
    tensorboard: bool = setting(False, "events")
    plot: bool = setting(False, "curves")
    nan_at: list[int] = setting([], "the steps whose loss is NaN on nan_rank")
    nan_rank: int = setting(1, "the rank whose loss is NaN")
    checkpoint: CheckpointSettings = section(CheckpointSettings, "every step", every=1)


class NaN(Recipe):
    name = "nan"
    Config = NaNConfig

    def build(self):
        for name, stage in STAGES.items():
            self.registry.add(trainable_role(
                name, lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                Placement(stage=stage, dtype="fp32"), OptimSpec(name="adamw", lr=1e-2, scheduler="linear",
                                                              total_steps=8), micro_batch_size=2, grad_accum=2))
        self.registry.build()

    def train_step(self):
        registry, losses = self.registry, []
        g = registry.generator(self.step, "x")
        for micro in range(2):
            x = torch.randn(2, 8, generator=g)
            for name in STAGES:
                loss = registry[name](x).pow(2).mean()
                if self.step + 1 in self.cfg.nan_at and registry.rank == self.cfg.nan_rank and micro == 1:
                    loss = loss * float("nan")  # on one rank only
                registry[name].backward(loss)
                registry[name].step()
                losses.append(loss.item())
        self.record()
        return mean_over_ranks({"loss": sum(losses) / len(losses)})

    def record(self):
        """Each rank's view of every role's full weights after the step, and its learning rates."""
        row = {"step": self.step + 1}
        for name in STAGES:
            with self.registry.gathered(name):
                row[name] = [round(float(p.double().sum()), 12) for p in self.registry.role(name).module.parameters()]
            row[name + "_lr"] = self.registry[name].get_lr()[0]
        with open(os.path.join(self.output_dir, f"weights_rank{self.registry.rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\\n")

    def export(self):
        return {n: save_role(self.registry, n, self.path("export", n))["model"] for n in STAGES}


RECIPE = NaN
'''


@pytest.fixture(scope="module")
def fault_recipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault_recipes")
    pkg = root / TOY_PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "hang.py").write_text(HANG)
    (pkg / "sleeper.py").write_text(SLEEPER)
    (pkg / "nan.py").write_text(NAN)
    (root / "configs").mkdir()
    return root


def _cli_env(extra_path=None):
    path = [str(extra_path)] if extra_path else []
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))


def _toy_cli(root, recipe, *args):
    return [*CLI, "--recipes-package", TOY_PKG, "--configs-dir", str(root / "configs"), "run", recipe, *args]


def _job_processes(marker: str) -> list[str]:
    """Live processes whose command line contains `marker` (each test's unique output folder)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(f"{pid} [{state}] {cmdline[:160]}")
    return found


def _running(pid: int) -> bool:
    """A live process (not gone, not a zombie) with this pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _wait_gone(marker: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        left = _job_processes(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@pytest.mark.timeout(400)
def test_stopped_rank_ends_the_job_within_the_timeout(tmp_path, fault_recipes):
    out = tmp_path / "hang_out"
    timeout_s = 10
    proc = subprocess.run(_toy_cli(fault_recipes, "hang", "--nproc-per-node", "2", f"output_dir={out}",
                                   f"dist_timeout_s={timeout_s}"),
                          capture_output=True, text=True, timeout=360, env=_cli_env(fault_recipes))
    ended = time.time()
    stopped = float((out / "stopped_at").read_text())
    assert proc.returncode == 1, proc.stderr[-3000:]
    # the timeout, then FAILED_GRACE_S before the stopped rank is killed (torchrun alone would wait 30 s more)
    assert ended - stopped <= timeout_s + 25, f"the job took {ended - stopped:.0f} s after the rank stopped"
    assert _wait_gone(str(out), 5) == []  # the stopped rank too (the launcher kills it)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    # Which rank saw it, which collective, after how long; then who did not answer.
    assert errors[0].startswith("error: rank 0: collective ") and f"timed out after {timeout_s} s" in errors[0]
    assert "partition_parameters.py" in errors[0]  # ZeRO-3's parameter all-gather, waited on in the forward
    assert "rank 1 (killed by SIGKILL)" in proc.stderr and "dist_timeout_s" in proc.stderr
    assert "Traceback" not in proc.stderr


def _file_digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(900)
def test_sigterm_to_the_cli_stops_every_rank(tmp_path):
    out = tmp_path / "demo_sigterm"
    base = [*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}"]
    first = subprocess.run([*base, "max_steps=2"], capture_output=True, text=True, timeout=600, env=_cli_env())
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = out / "checkpoints"
    tag = (ckpts / "latest").read_text()
    before = _file_digests(ckpts)
    # the second run continues the first (a finished run's folder takes only resume_from or overwrite) and writes
    # no checkpoint of its own (keep_last back to its default: it applies only with checkpoint.every): the first
    # one's must survive it untouched
    proc = subprocess.Popen([*base, "max_steps=100000", "checkpoint.every=0", "checkpoint.keep_last=2",
                             "resume_from=latest"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cli_env())
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:  # until the second run is training
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        ranks = [p for p in _job_processes(str(out)) if "multiengine.recipes.language.cli --recipes-package" in p]
        assert len(ranks) == 2, _job_processes(str(out))  # both ranks run (in sessions of their own)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in stderr
    # 30 s for the whole job, CLI and ranks together (ranks get cli.STOP_GRACE_S = 20 s, then SIGKILL)
    left = _wait_gone(str(out), max(0.0, 30 - (time.monotonic() - sent)))
    assert left == [], f"{time.monotonic() - sent:.1f} s after SIGTERM: {left}"
    assert (ckpts / "latest").read_text() == tag and _file_digests(ckpts) == before  # the last checkpoint intact


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", ["launcher", "cli"])
def test_ranks_exit_when_their_launcher_dies(tmp_path, fault_recipes, victim):
    out = tmp_path / f"sleep_{victim}"
    proc = subprocess.Popen(_toy_cli(fault_recipes, "sleeper", "--nproc-per-node", "2", f"output_dir={out}"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_cli_env(fault_recipes))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all((out / f"rank{r}.pid").is_file() for r in range(2)):
            time.sleep(0.5)
        rank_pids = [int((out / f"rank{r}.pid").read_text()) for r in range(2)]
        launcher = [int(p.split()[0]) for p in _job_processes(str(out)) if " _launch " in p]
        assert len(launcher) == 1, _job_processes(str(out))
        # SIGKILL cannot be caught: the CLI gets no chance to forward anything.
        os.kill(launcher[0] if victim == "launcher" else proc.pid, signal.SIGKILL)
        left = _wait_gone(str(out), 20)
        assert left == [], left
        # a rank in the middle of exiting has dropped its command line (so _job_processes no longer lists it) but is
        # not a zombie yet: give it a few seconds to finish
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_running(pid) for pid in rank_pids):
            time.sleep(0.2)
        assert not any(_running(pid) for pid in rank_pids)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# --- non-finite losses and gradients -----------------------------------------------------------------
def _nan_run(root, out, *overrides):
    return subprocess.run(_toy_cli(root, "nan", "--nproc-per-node", "2", f"output_dir={out}", *overrides),
                          capture_output=True, text=True, timeout=600, env=_cli_env(root))


def _rank_weights(out, rank):
    return [json.loads(line) for line in (out / f"weights_rank{rank}.jsonl").read_text().splitlines()]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # valid JSON or fails


ROLES = ("s0", "s2", "s3")


@pytest.mark.timeout(700)
def test_nonfinite_skip_on_two_ranks_skips_the_same_update_everywhere(tmp_path, fault_recipes):
    out = tmp_path / "nan_skip"
    # a NaN loss on rank 1 only, in the second micro batch of step 2
    proc = _nan_run(fault_recipes, out, "nan_at=[2]", "nonfinite.policy=skip", "nonfinite.max_skips=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = _metrics(out)
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert lines[1]["train/loss"] is None and [x.get("train/nonfinite_skips") for x in lines] == [None, 1.0, 1.0, 1.0]
    assert "NaN" not in (out / "metrics.jsonl").read_text()
    w0, w1 = _rank_weights(out, 0), _rank_weights(out, 1)
    assert w0 == w1  # both ranks hold the same weights at every step: no rank applied what the other skipped
    for role in ROLES:  # stage 0 (our check), 2 and 3 (DeepSpeed's verdict): the same outcome
        assert w0[1][role] == w0[0][role] and w0[1][f"{role}_lr"] == w0[0][f"{role}_lr"], role  # step 2: no update
        assert w0[2][role] != w0[1][role] and w0[2][f"{role}_lr"] < w0[1][f"{role}_lr"], role  # step 3 trains again
    for role in ROLES:
        assert f"role '{role}': non-finite" in proc.stderr
    assert "step 2: non-finite values (loss=nan" in proc.stderr
    assert "step skipped (1 of nonfinite.max_skips=1)" in proc.stderr
    assert all((out / "export" / role / "model.safetensors").is_file() for role in ROLES)


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("policy", "nan_at", "why"), [
    ("stop", "[3]", "nonfinite.policy=stop"),
    ("skip", "[2,3]", "more than nonfinite.max_skips=1 steps were skipped"),
])
def test_nonfinite_stop_on_two_ranks_exits_3_and_keeps_the_last_checkpoint(tmp_path, fault_recipes, policy, nan_at,
                                                                          why):
    out = tmp_path / f"nan_{policy}"
    skips = ["nonfinite.max_skips=1"] if policy == "skip" else []  # max_skips applies only to the skip policy
    proc = _nan_run(fault_recipes, out, f"nan_at={nan_at}", f"nonfinite.policy={policy}", *skips)
    assert proc.returncode == 3, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: step 3: non-finite values (loss=nan"), proc.stderr[-3000:]
    assert why in errors[0] and "nothing was exported" in errors[0]
    assert "fix: lower the learning rate" in proc.stderr and "Traceback" not in proc.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002" and not (ckpts / "step_00000003").exists()
    assert not (out / "export").exists() and not (out / "summary.json").exists()
    assert [x["step"] for x in _metrics(out)] == [1, 2, 3] and _metrics(out)[2]["train/loss"] is None
    w0 = _rank_weights(out, 0)
    assert w0 == _rank_weights(out, 1) and all(w0[2][r] == w0[1][r] for r in ROLES)  # step 3 applied nothing


@pytest.mark.timeout(700)
def test_a_diverging_registry_demo_stops_with_exit_3(tmp_path):
    """The real recipe on 2 ranks, an absurd learning rate and no clipping: it goes NaN, stops, exports nothing."""
    out = tmp_path / "diverge"
    proc = subprocess.run([*CLI, "run", "registry_demo", "--config", "tiny", "--nproc-per-node", "2",
                           f"output_dir={out}", "roles.actor.lr=1e10", "roles.actor.max_grad_norm=0", "max_steps=8",
                           "checkpoint.every=1"],
                          capture_output=True, text=True, timeout=600, env=_cli_env())
    assert proc.returncode == 3, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "non-finite values" in errors[0] and "role 'actor'" in errors[0], proc.stderr[-3000:]
    stopped = int(errors[0].split("error: step ", 1)[1].split(":", 1)[0])
    assert 1 < stopped <= 8
    lines = _metrics(out)
    assert lines[-1]["step"] == stopped and lines[-1]["train/loss"] is None
    assert all(x["train/loss"] is not None for x in lines[:-1])
    assert (out / "checkpoints" / "latest").read_text() == f"step_{stopped - 1:08d}"
    assert not (out / "export").exists() and "Traceback" not in proc.stderr


# --- a stale JIT build lock ---------------------------------------------------------------------------
STALE_LOCK_SCRIPT = '''
from multiengine.engines import EngineRegistry
registry = EngineRegistry(backend="deepspeed")
registry.close()
print("started")
'''


@pytest.mark.timeout(300)
def test_stale_build_lock_does_not_hang_deepspeed_start(tmp_path):
    from multiengine.engines.jit_locks import extension_roots

    # the op as this run built it (TORCH_EXTENSIONS_DIR where set): one built by another torch is rebuilt, ~1 min
    built = [p for root in extension_roots() for p in Path(root).glob("deepspeed_shm_comm") if any(p.glob("*.so"))]
    if not built:
        pytest.skip("DeepSpeed's shm comm op was never built on this machine (a first start builds it, ~1 min)")
    exts = tmp_path / "exts"
    shutil.copytree(built[0], exts / "deepspeed_shm_comm")  # keeps mtimes: ninja finds it up to date
    lock = exts / "deepspeed_shm_comm" / "lock"
    lock.write_text("")  # what a build killed half way leaves behind
    old = time.time() - 60
    os.utime(lock, (old, old))
    env = dict(_cli_env(), TORCH_EXTENSIONS_DIR=str(exts))
    proc = subprocess.run([sys.executable, "-c", STALE_LOCK_SCRIPT], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr[-3000:]
    assert "removed a stale JIT build lock" in proc.stderr and str(lock) in proc.stderr
    assert not lock.exists()

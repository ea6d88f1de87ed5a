"""The process supervisor behind `multiengine run --nproc-per-node N`: torchrun as a quiet child, every rank in
its own session, stop signals forwarded to all of them, and a failure reported once as one ``error:`` line from
the ranks' records in ``<output_dir>/logs/`` (exit codes: 0, 1 failure, 2 user error, 3 non-finite stop, 128+N
signal N). It writes to stderr directly: talking to the terminal is its job."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RECIPES_PACKAGE, RecipeConfigError, configs_dir

logger = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_USAGE = 2  # bad recipe, config, key or value (argparse's own usage errors use 2 as well)
EXIT_NONFINITE = 3  # the run's nonfinite policy stopped it
ENV_ERROR_DIR = "MULTIENGINE_ERROR_DIR"  # where ranks leave their error records for this process
ENV_VALIDATED = "MULTIENGINE_VALIDATED"  # the launching process already ran the recipe's validate(cfg)
STOP_GRACE_S = 20.0  # after forwarding a stop signal, how long ranks get before SIGKILL
FAILED_GRACE_S = 5.0  # after a rank's failure record, how long a stopped rank is left before SIGKILL
_LAUNCH = "_launch"  # hidden sub-command: the launcher process (torchrun's agent, quiet)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use, not the whole machine
    except AttributeError:
        return os.cpu_count() or 1


RDZV_BACKENDS = ("static", "c10d")


@dataclass(frozen=True)
class Nodes:
    """Where a job's ranks run: the number of nodes, this node's rank and the rendezvous (torchrun's options)."""

    nnodes: int = 1
    node_rank: int | None = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str = "static"
    rdzv_id: str = "multiengine"


def _rendezvous_args(nodes: Nodes) -> list[str]:
    """torchrun's rendezvous options, checked: a wrong node rank or a missing address would hang every node."""
    nnodes, node_rank, master_addr, master_port = nodes.nnodes, nodes.node_rank, nodes.master_addr, nodes.master_port
    rdzv_backend, rdzv_id = nodes.rdzv_backend, nodes.rdzv_id
    if rdzv_backend not in RDZV_BACKENDS:
        raise RecipeConfigError(f"--rdzv-backend {rdzv_backend!r}; use one of {list(RDZV_BACKENDS)}")
    if nnodes < 1:
        raise RecipeConfigError(f"--nnodes must be >= 1, got {nnodes}")
    where = ("rank 0's host and port" if rdzv_backend == "static"
             else "the rendezvous endpoint: one node's host and a free port, the same on every node")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise RecipeConfigError(f"--nnodes > 1 needs --master-addr and --master-port ({where})")
    from multiengine.engines.dist import free_port

    addr = master_addr or "127.0.0.1"
    port = str(master_port if master_port is not None else free_port())
    if rdzv_backend == "c10d":
        if node_rank is not None and nnodes > 1:
            raise RecipeConfigError("--node-rank has no effect with --rdzv-backend c10d (nodes are numbered as they "
                                    "join); drop it, or use the static rendezvous")
        return ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:{port}", "--rdzv_id", rdzv_id]
    if node_rank is None:
        if nnodes > 1:
            raise RecipeConfigError(
                f"--nnodes {nnodes} needs --node-rank on every node: 0 on rank 0's node (--master-addr), 1 to "
                f"{nnodes - 1} on the others (or --rdzv-backend c10d, which numbers nodes as they join)")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise RecipeConfigError(f"--node-rank {node_rank} is not in [0, --nnodes {nnodes})")
    return ["--node_rank", str(node_rank), "--master_addr", addr, "--master_port", port]


CLI = "multiengine.recipes.language.cli"


def build_launch_command(recipe: str, config_file: str | None, overrides: Sequence[str], *, nproc_per_node: int,
                         nodes: Nodes = Nodes(), package: str = RECIPES_PACKAGE,
                         folder: str | Path | None = None) -> list[str]:
    """``python -m <cli> _launch <torchrun options> -m <cli> run <recipe> ...``: torchrun's launcher (run quietly in
    its own process, see _launch_main), starting every rank."""
    if nproc_per_node < 1:
        raise RecipeConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    cmd = [
        sys.executable, "-m", CLI, _LAUNCH,
        "--nproc_per_node", str(nproc_per_node),
        "--nnodes", str(nodes.nnodes),
        *_rendezvous_args(nodes),
        "-m", CLI,
        "--recipes-package", package,
        "--configs-dir", str(folder if folder is not None else configs_dir(package)),
        "run", recipe,
    ]
    if config_file is not None:
        cmd += ["--config", config_file]
    return cmd + list(overrides)


def _launch_env(nproc_per_node: int, package: str, nnodes: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    # N ranks each using every core oversubscribe the CPU badly (torch's launcher would force 1).
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // nproc_per_node)))
    if nnodes == 1:  # the rollout ranks' bridge (engines/placement.py): a rendezvous port of its own
        from multiengine.engines.dist import free_port
        from multiengine.engines.placement import BRIDGE_PORT_ENV

        env.setdefault(BRIDGE_PORT_ENV, str(free_port()))
    if package != RECIPES_PACKAGE:
        # The ranks must import the recipe package the parent validated, wherever it was found.
        top = sys.modules[package.split(".")[0]]
        locations = [str(Path(p).parent) for p in getattr(top, "__path__", [])]
        env["PYTHONPATH"] = os.pathsep.join([*locations, *filter(None, [env.get("PYTHONPATH")])])
    return env


# --- the job's processes: signals and their tree ----------------------------------------------------
def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command (state, ppid, ...); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the command may contain spaces and ')'


def _children_map() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc (Linux); empty elsewhere."""
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        fields = _stat_fields(name) if name.isdigit() else None
        if fields is not None:
            out.setdefault(int(fields[1]), []).append(int(name))
    return out


def _descendants(pid: int) -> list[int]:
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_job(root: int, sig: int, seen_groups: set[int]) -> None:
    """`sig` to the launcher and SIGTERM (or SIGKILL) to every rank's process group: torchrun starts
    each rank in its own session, so only its group reaches the rank's own children too."""
    rank_sig = signal.SIGKILL if sig == signal.SIGKILL else signal.SIGTERM
    own = os.getpgid(0)
    for pid in _descendants(root):
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if pgid != own:
            seen_groups.add(pgid)
    for pgid in seen_groups:
        for s in (rank_sig, signal.SIGCONT):  # SIGCONT: a stopped rank acts on its SIGTERM at once
            try:
                os.killpg(pgid, s)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.kill(root, sig)
    except ProcessLookupError:
        pass


def _exit_with_parent() -> None:
    """In the launcher child, before exec: get SIGTERM when this CLI dies (even by SIGKILL)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _stopped_ranks(root: int) -> list[int]:
    """The job's processes that are stopped (state T: SIGSTOP, a debugger): they cannot act on a SIGTERM."""
    return [pid for pid in _descendants(root) if (_stat_fields(pid) or ["?"])[0] in ("T", "t")]


def _launch(cmd: list[str], env: dict[str, str], error_dir: str | None = None) -> tuple[int, int | None]:
    """Run the launcher, forwarding SIGTERM/SIGINT to it and every rank; once a rank recorded a failure, a stopped
    rank gets SIGKILL after FAILED_GRACE_S (torchrun cannot reach it). Returns (exit code, stop signal or None)."""
    logger.info("launching: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_exit_with_parent if sys.platform.startswith("linux") else None)
    received: list[int] = []
    groups: set[int] = set()

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        _signal_job(proc.pid, signal.SIGKILL if len(received) > 1 else signum, groups)  # twice: no more waiting

    import threading

    # Handlers can only be installed from the main thread (cli.main called from another thread
    # still runs the job, without forwarding).
    handled = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        deadline = failed_at = None
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if error_dir and failed_at is None and any(Path(error_dir).glob("rank*-error.json")):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + FAILED_GRACE_S:
                    for pid in _stopped_ranks(proc.pid):
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(pid, signal.SIGKILL)
                if received and deadline is None:
                    deadline = time.monotonic() + STOP_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    _signal_job(proc.pid, signal.SIGKILL, groups)
                    deadline = float("inf")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:  # the launcher is gone; make sure no rank outlived it
        for pgid in groups:
            for s in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pgid, s)
                except (ProcessLookupError, PermissionError):
                    pass
    code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it
    return code, (received[0] if received else None)


def _launch_main(argv: list[str]) -> int:
    """The launcher process: torchrun's agent with its log lines sent to a file instead of the
    terminal (the CLI reports failures itself, once), and its failure summary written as a record."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    error_dir = os.environ.get(ENV_ERROR_DIR)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run"):
        log = logging.getLogger(name)
        log.setLevel(logging.INFO)
        log.propagate = False
        for handler in list(log.handlers):
            log.removeHandler(handler)
        if error_dir:
            file_handler = logging.FileHandler(os.path.join(error_dir, "launcher.log"))
            file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(file_handler)
        else:
            log.addHandler(logging.NullHandler())
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        failures = {str(rank): {"exitcode": f.exitcode, "signal": f.signal_name() if f.exitcode < 0 else None,
                                "pid": f.pid} for rank, f in exc.failures.items()}
        if error_dir:
            _write_json(os.path.join(error_dir, "launcher.json"), {"failures": failures})
            with open(os.path.join(error_dir, "launcher.log"), "a") as f:
                f.write(exc.format_msg() + "\n")
        else:
            sys.stderr.write(exc.format_msg() + "\n")
        return EXIT_FAILURE
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


# --- errors: recorded per rank, reported once -------------------------------------------------------
# gloo's words for "the peer went away": a consequence of another rank's failure, not a cause.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
              "connection refused")


def _is_user_error(exc: BaseException) -> bool:
    if _is_config_error(exc):
        return True
    ckpt = sys.modules.get("multiengine.engines.safe_io")
    return ckpt is not None and isinstance(exc, ckpt.CheckpointError)


def _is_nonfinite_stop(exc: BaseException) -> bool:
    mod = sys.modules.get("multiengine.engines.nonfinite")
    return mod is not None and isinstance(exc, mod.NonFiniteError)


def _exit_code(exc: BaseException) -> int:
    if _is_user_error(exc):
        return EXIT_USAGE
    return EXIT_NONFINITE if _is_nonfinite_stop(exc) else EXIT_FAILURE


def _describe(exc: BaseException) -> tuple[str, str | None]:
    """(the error line, the fix or None) for an exception raised while running a recipe."""
    dist_mod = sys.modules.get("multiengine.engines.dist")
    timeout = dist_mod.collective_timeout_message(exc) if dist_mod is not None else None
    if timeout:
        return timeout, ("find out why the other rank stalled (its log; py-spy dump --pid); if a step really"
                         " takes that long, raise the collective timeout (dist_timeout_s)")
    if _is_user_error(exc) or _is_nonfinite_stop(exc):
        text = str(exc)
        return text, getattr(exc, "fix", None)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__, None


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _logs_dir(output_dir: str | None) -> str:
    """<output_dir>/logs, or a fresh temp folder if there is none or it cannot be created."""
    if output_dir:
        path = os.path.join(output_dir, "logs")
        try:
            os.makedirs(path, exist_ok=True)
            return path
        except OSError:
            pass
    return tempfile.mkdtemp(prefix="multiengine-logs-")


def _record_failure(exc: BaseException, output_dir: str | None, rank: int, world: int) -> int:
    """A rank's failure: traceback to its log file; then either a record for the launching CLI
    (which prints the job's error once) or, launched some other way, one `error:` line here."""
    user = _is_user_error(exc)
    code = _exit_code(exc)
    message, fix = _describe(exc)
    error_dir = os.environ.get(ENV_ERROR_DIR)
    log_dir = error_dir or _logs_dir(output_dir)
    log_path = os.path.join(log_dir, f"rank{rank}-error.log")
    try:
        with open(log_path, "w") as f:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=f)
    except OSError:
        log_path = "(could not be written)"
    if error_dir:
        secondary = any(m.lower() in str(exc).lower() for m in _SECONDARY)
        _write_json(os.path.join(error_dir, f"rank{rank}-error.json"),
                    {"rank": rank, "world": world, "message": message, "fix": fix, "user": user, "code": code,
                     "secondary": secondary, "log": log_path, "time": time.time()})
    else:
        who = f"rank {rank}: " if world > 1 else ""
        _print_error(f"{who}{message}", fix, log_path)
    return code


def _print_error(message: str, fix: str | None, log_path: str | None) -> None:
    sys.stderr.write(f"error: {message}" + "\n")
    if fix and f"fix: {fix}" not in message:
        sys.stderr.write(f"  fix: {fix}" + "\n")
    if log_path:
        sys.stderr.write(f"  traceback: {log_path}" + "\n")
    sys.stderr.flush()


def _how_ended(failure: dict[str, Any]) -> str:
    return f"killed by {failure['signal']}" if failure.get("signal") else f"exit code {failure['exitcode']}"


def _report_job(error_dir: str, code: int, stop: int | None, nproc: int) -> int:
    """After the launcher exits: print the job's failure once and choose the exit code."""
    if stop is not None:
        sys.stderr.write(f"multiengine: stopped by {signal.Signals(stop).name}; every rank was stopped" + "\n")
        return 128 + stop
    records = []
    for path in sorted(Path(error_dir).glob("rank*-error.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    launcher: dict[str, Any] = {}
    try:
        launcher = json.loads((Path(error_dir) / "launcher.json").read_text()).get("failures", {})
    except (OSError, ValueError):
        pass
    if code == 0 and not records:
        return 0
    if sys.stderr.isatty():
        sys.stderr.write("\n")  # a rank's progress bar may have left its line unfinished
    if records:
        first = min(records, key=lambda r: (r["secondary"], r["time"]))
        same = len(records) == first["world"] and all(r["message"] == first["message"] for r in records)
        who = "" if same and first["world"] > 1 else f"rank {first['rank']}: " if first["world"] > 1 else ""
        _print_error(f"{who}{first['message']}", first.get("fix"), first.get("log"))
        reported = {r["rank"] for r in records}
        silent = [f"rank {r} ({_how_ended(f)})" for r, f in sorted(launcher.items()) if int(r) not in reported]
        if silent and not same:
            sys.stderr.write(f"  ended without reporting an error: {', '.join(silent)}" + "\n")
        return int(first.get("code", EXIT_USAGE if first["user"] else EXIT_FAILURE))
    dead = [f"rank {r} {_how_ended(f)}" for r, f in sorted(launcher.items())]
    log = Path(error_dir) / "launcher.log"
    _print_error(f"{', '.join(dead) or 'the launcher failed'} without reporting an error (out of memory? killed?)",
                 None, str(log) if log.is_file() else None)
    return EXIT_FAILURE if code == 0 else code


def _is_config_error(exc: BaseException) -> bool:
    """A user error: a settings error of the recipe language, the engines or the pipelines (SettingsError)."""
    from multiengine.engines.settings import SettingsError

    return isinstance(exc, SettingsError)


def _leave(code: int) -> None:
    """End a rank now, skipping the interpreter's teardown, which can only fail a finished job (about one exit in 40
    aborted in C++ with gloo and DeepSpeed loaded)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- the two sides of `multiengine run --nproc-per-node N` --------------------------------------------
def launch_job(cmd: list[str], env: dict[str, str], output_dir: str, nproc_per_node: int) -> int:
    """Run build_launch_command's ``cmd`` for a config this process has checked for every rank; the error records
    of an earlier run in output_dir are removed first, so only this job's are reported. Returns its exit code."""
    error_dir = _logs_dir(output_dir)
    for pattern in ("rank*-error.*", "launcher.*"):
        for stale in Path(error_dir).glob(pattern):
            stale.unlink(missing_ok=True)
    code, stop = _launch(cmd, {**env, ENV_ERROR_DIR: error_dir, ENV_VALIDATED: "1"}, error_dir)
    return _report_job(error_dir, code, stop, nproc_per_node)


def run_rank(load: Callable[[bool], Any], run: Callable[[Any], str | None]) -> int:
    """Run a recipe alone or as one rank: ``load(checked)`` reads the config (``checked``: also run the checks),
    ``run(cfg)`` returns what rank 0 prints. A failure is recorded once; a launched rank skips the teardown."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    launched = "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if launched:
        from multiengine.engines.dist import watch_launcher

        watch_launcher()  # from the start: imports and model builds can take minutes
    cfg = None
    checked = os.environ.get(ENV_VALIDATED) != "1"
    try:
        cfg = load(checked)
        text = run(cfg)
        from multiengine.engines.dist import shutdown

        shutdown()  # all ranks leave together (no-op when the recipe ran without a process group)
    except KeyboardInterrupt:
        if launched:
            os._exit(128 + signal.SIGINT)
        raise
    except Exception as exc:
        if cfg is None and checked and _is_user_error(exc):
            # Launched without the CLI's checks (torchrun directly) every rank runs them and fails alike, before any
            # model is built: rank 0 reports, once, and nothing is written (no log file for a config error).
            code = EXIT_USAGE
            if rank == 0:
                _print_error(*_describe(exc), None)
        else:
            output_dir = None
            with contextlib.suppress(Exception):
                output_dir = str(cfg.output_dir) if cfg is not None else None
            code = _record_failure(exc, output_dir, rank, world)
        if launched and world > 1:
            # Peers may still be inside a collective with us: skip the process group's teardown (and atexit hooks)
            # that could wait on them, and leave now.
            _leave(code)
        return code
    if rank == 0 and text:
        sys.stdout.write(text + "\n")
    if launched and world > 1:
        _leave(0)
    return 0

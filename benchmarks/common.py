"""Shared plumbing for the benchmarks: self-launch on N ranks, medians, results JSON, tables."""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def in_distributed_run() -> bool:
    return "LOCAL_RANK" in os.environ


def run_ranks(module: str, nproc: int, args: list[str]) -> Any:
    """Run `python -m <module> args` on `nproc` ranks through torch's launcher (one thread per rank)
    and return the JSON that rank 0 printed on a line starting with RESULT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           "-m", module, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        # the first rank's traceback, not the launcher's report that follows it
        at = proc.stderr.find("Traceback")
        raise RuntimeError(f"{module} on {nproc} ranks exited {proc.returncode}:\n"
                           f"{proc.stderr[max(at, 0):][:6000] if at >= 0 else proc.stderr[-4000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def emit(result: Any) -> None:
    """Rank 0 hands its result to the parent process (see run_ranks)."""
    print("RESULT " + json.dumps(result, default=str), flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "deepspeed", "transformers", "diffusers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # a benchmark that does not need a library still runs without it
            continue
    return out


def write_results(name: str, payload: dict[str, Any], command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "command": command, "date": datetime.date.today().isoformat(),
               "versions": versions(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)

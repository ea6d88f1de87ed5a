"""A hung rank ends the job within the collective timeout: run a recipe on 2 CPU ranks, stop one rank (SIGSTOP: alive,
holding its sockets, answering nothing) at a random point of its training, and time until every process of the job
is gone. Target: within 60 s with ``dist_timeout_s=30``, in every try.

    python -m benchmarks.hung_rank --tries 5 \\
        --set rlhf_ppo:roles.actor.model=outputs/rlhf_sft/export/actor \\
        --set rlhf_ppo:roles.reward.model=outputs/rlhf_reward/export/reward

prints one row per try (which rank stopped, when, how long until the job was gone, its exit code and error line) and
writes them to benchmarks/results/hung_rank.json. One job at a time; each try takes one to two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _rank_of(pid: int) -> int | None:
    """RANK from a process's environment (a rank of the job), None for the launcher and helpers."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if b"_launch" in cmdline:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def error_lines(stderr: str) -> list[str]:
    """The job's ``error:`` lines; one may follow a rank's unfinished progress bar on the same line."""
    return [m.group(1) for m in re.finditer(r"(?:^|\] *)(error: [^\r\n]*)", stderr, re.MULTILINE)]


def one_try(recipe: str, config: str, overrides: list[str], timeout_s: float, delay_s: float, rank: int,
            limit_s: float, work: Path) -> dict:
    """One job: wait for its first metrics line, then ``delay_s``, stop ``rank``, time until every process is gone."""
    out = work / f"{recipe}-{int(time.time() * 1000)}"
    cmd = [sys.executable, "-m", "multiengine.recipes.language.cli", "run", recipe, "--config", config,
           "--nproc-per-node", "2", f"output_dir={out}", f"dist_timeout_s={timeout_s:g}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    started = time.monotonic()
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    row = {"recipe": recipe, "rank": rank, "delay_s": round(delay_s, 1), "log": str(log_path)}
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and metrics.stat().st_size > 0):
        time.sleep(0.2)
    time.sleep(delay_s)
    victims = [p for p in _descendants(proc.pid) if _rank_of(p) == rank]
    if proc.poll() is not None or not victims:
        row.update(result="finished before the stop", code=proc.wait())
        return row
    job = [proc.pid, *_descendants(proc.pid)]
    os.kill(victims[0], signal.SIGSTOP)
    stopped = time.monotonic()
    row["stopped_after_s"] = round(stopped - started, 1)
    while any(_alive(p) for p in job) and time.monotonic() < stopped + limit_s + 60:
        time.sleep(0.2)
        proc.poll()
    left = [p for p in job if _alive(p)]
    for pid in left:  # past the limit: end what this try started
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait()
    gone = time.monotonic() - stopped
    errors = error_lines(log_path.read_text(errors="replace"))
    row.update(gone_after_s=None if left else round(gone, 1), code=proc.returncode, errors=len(errors),
               error=errors[0][:200] if errors else "", result="ok" if not left and gone <= limit_s else "FAIL")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["rlhf_ppo", "rlhf_grpo"])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--tries", type=int, default=5, help="per recipe")
    parser.add_argument("--timeout", type=float, default=30.0, help="dist_timeout_s")
    parser.add_argument("--limit", type=float, default=60.0, help="seconds after the stop the job may take")
    parser.add_argument("--delay", type=float, nargs=2, default=(5.0, 20.0),
                        help="stop after a random delay in this range (s) from the first metrics line")
    parser.add_argument("--set", action="append", default=[], metavar="RECIPE:KEY=VALUE",
                        help="an override for one recipe (e.g. the models rlhf_ppo starts from)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "results" / "hung_rank.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="hung_rank-"))
    rows = []
    print(f"{'recipe':<10} {'try':>3} {'rank':>4} {'stopped after':>13} {'gone after':>10} {'code':>4} {'errors':>6}  "
          "result / error line", flush=True)
    for recipe in args.recipes:
        overrides = [s.split(":", 1)[1] for s in args.set if s.split(":", 1)[0] == recipe]
        for i in range(args.tries):
            row = one_try(recipe, args.config, overrides, args.timeout, rng.uniform(*args.delay), rng.randrange(2),
                          args.limit, work)
            rows.append(row)
            gone = f"{row['gone_after_s']:.1f} s" if row.get("gone_after_s") is not None else "-"
            stopped = f"{row['stopped_after_s']:.1f} s" if "stopped_after_s" in row else "-"
            print(f"{recipe:<10} {i + 1:>3} {row['rank']:>4} {stopped:>13} {gone:>10} {row.get('code', ''):>4} "
                  f"{row.get('errors', ''):>6}  {row['result']}: {row.get('error', '')}", flush=True)
    ok = sum(r["result"] == "ok" for r in rows)
    print(f"{ok} of {len(rows)} jobs gone within {args.limit:g} s of the stop (dist_timeout_s={args.timeout:g})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "timeout_s": args.timeout,
                                          "limit_s": args.limit, "tries": rows}, indent=1) + "\n")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

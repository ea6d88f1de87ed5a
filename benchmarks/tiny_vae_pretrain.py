"""How long the tiny vae pre-train of sd_finetune's tiny config takes on 2 CPU ranks, at the config's 32 px and
at 64 px: the shipped command shortened to one training step (no validation, checkpoint or export), in a
scratch output_dir, its time read from summary.json (``tiny_vae_pretrain.seconds``: the pre-train alone, the
slowest rank's, from its first step to the latent statistics). Stores the figures with the date, the command
and the load average (``os.getloadavg``, as ``uptime`` prints it) before and after each run in
benchmarks/results/tiny_vae_pretrain.json; docs/diffusion.md quotes them.

    python -m benchmarks.tiny_vae_pretrain                 # both resolutions, about 7 minutes on 2 cores
    python -m benchmarks.tiny_vae_pretrain --resolutions 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tiny_vae_pretrain.json"
BASE = "multiengine run sd_finetune --config tiny --nproc-per-node 2"
SHORT = "max_steps=1 validation.enabled=false checkpoint.every=0 export.enabled=false plot=false"


def measure(resolution: int, workdir: str) -> dict:
    extra = "" if resolution == 32 else f" data.resolution={resolution}"
    command = f"{BASE}{extra} {SHORT}"
    out = os.path.join(workdir, f"r{resolution}")
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run([*shlex.split(command), f"output_dir={out}"], capture_output=True, text=True,
                          cwd=workdir)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{command} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        pre = json.load(f)["tiny_vae_pretrain"]
    return {"resolution": resolution, "command": command, "steps": pre["steps"], "images": pre["images"],
            "world_size": pre["world_size"], "pretrain_s": pre["seconds"],
            "s_per_step": round(pre["seconds"] / pre["steps"], 3), "run_wall_s": round(wall, 1),
            "mse": round(pre["mse"], 4), "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[32, 64])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for r in args.resolutions:
            rows.append(measure(r, work))
            print(json.dumps(rows[-1]))
    result = {"date": datetime.date.today().isoformat(), "runs": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""One optimizer step, torch AdamW against DeepSpeed's Adam (``build_optimizer("ds_adam")``: its CPU Adam
here), on flat fp32 parameters of several sizes - what a ZeRO engine hands its optimizer (the fp32
master partition of a role). One process, one thread (as each benchmark rank runs); the variants
alternate step by step, so load changes hit both alike.

    python -m benchmarks.optimizer_step               # sizes 1.7e5 (the tiny OPT), 1e6, 1e7, 5e7: ~1 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="165760,1000000,10000000,50000000")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch
    from multiengine.engines.optim import build_optimizer, ds_adam_kind

    from benchmarks.common import table, write_results

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    rows, results = [], {}
    for n in (int(float(x)) for x in args.sizes.split(",")):
        steps = max(5, args.steps if n <= 10**7 else args.steps // 3)
        opts, params = {}, {}
        for name in ("adamw", "ds_adam"):
            p = torch.nn.Parameter(torch.randn(n))
            p.grad = torch.randn(n)
            params[name], opts[name] = p, build_optimizer(name, [p], **kwargs)
            opts[name].step()  # state allocation outside the timing
        times: dict[str, list[float]] = {name: [] for name in opts}
        for _ in range(steps):
            for name, opt in opts.items():
                t0 = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) for name, t in times.items()}
        results[n] = med
        rows.append([n, 1000 * med["adamw"], 1000 * med["ds_adam"], med["ds_adam"] / med["adamw"]])
    load_end = os.getloadavg()
    print(table(["parameters", "torch AdamW ms", f"ds_adam ({ds_adam_kind(False)}) ms", "ds_adam / AdamW"], rows))
    print(f"\nmedian of alternating steps, {args.threads} thread(s); load average (1 min) {load_start[0]:.2f} at "
          f"start, {load_end[0]:.2f} at end")
    path = write_results("optimizer_step", {"threads": args.threads, "median_step_s": results,
                                            "load_average_start": load_start, "load_average_end": load_end},
                         command="python -m benchmarks.optimizer_step " + " ".join(sys.argv[1:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

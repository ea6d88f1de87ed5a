"""Run one recipe config on the baseline tree (/work/base, HEAD before the refactor) and on the current tree, and
compare metrics.jsonl and summary.json metrics. Usage: compare.py TAG RECIPE CONFIG [key=value ...] [--new-only k=v]
Baseline runs are cached under /work/cmp/TAG/base. Overrides after --new are given to the new run only (renamed keys).
"""
import json, math, os, shutil, subprocess, sys

tag, recipe, config, *rest = sys.argv[1:]
new_only = []
if "--new" in rest:
    i = rest.index("--new"); rest, new_only = rest[:i], rest[i + 1:]
root = f"/work/cmp/{tag}"
os.makedirs(root, exist_ok=True)
nproc = os.environ.get("NPROC", "2")

def run(which):
    out = f"{root}/{which}"
    if which == "base" and os.path.isfile(f"{out}/summary.json"):
        return out
    shutil.rmtree(out, ignore_errors=True)
    py = "/work/venv-base/bin/python" if which == "base" else sys.executable
    mod = "multiengine.recipes.cli" if which == "base" else "multiengine.recipes.language.cli"
    extra = new_only if which == "new" else []
    cmd = [py, "-m", mod, "run", recipe, "--config", config, "--nproc-per-node", nproc, f"output_dir={out}", *rest, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/tmp")
    open(f"{root}/{which}.log", "w").write(r.stdout + r.stderr)
    if r.returncode:
        print(f"{which} FAILED rc={r.returncode}; tail:\n" + "\n".join((r.stdout + r.stderr).splitlines()[-15:]))
        sys.exit(1)
    return out

def flat(d, p=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{p}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[p + k] = float(v)
    return out

b, n = run("base"), run("new")
skip = ("time", "seconds", "step_time", "_s_mean", "_s_median", "tokens_per_s", "ms_per_token", "_s", "memory", "rss", "/mem", "mem/")
worst, count, missing = 0.0, 0, []
recs = [[json.loads(l) for l in open(f"{x}/metrics.jsonl")] for x in (b, n)]
if len(recs[0]) != len(recs[1]):
    print(f"metrics.jsonl rows differ: {len(recs[0])} vs {len(recs[1])}")
for i, (rb, rn) in enumerate(zip(*recs)):
    fb, fn = flat(rb), flat(rn)
    for k, v in fb.items():
        if any(s in k for s in skip):
            continue
        if k not in fn:
            missing.append(k); continue
        w = fn[k]
        d = 0.0 if (v == w or (math.isnan(v) and math.isnan(w))) else abs(v - w)
        count += 1
        if d > worst:
            worst, where = d, (i, k, v, w)
sb, sn = (json.load(open(f"{x}/summary.json"))["metrics"] for x in (b, n))
fb, fn = flat(sb), flat(sn)
for k, v in fb.items():
    if any(s in k for s in skip):
        continue
    if k not in fn:
        missing.append("summary:" + k); continue
    count += 1
    d = 0.0 if v == fn[k] or (math.isnan(v) and math.isnan(fn[k])) else abs(v - fn[k])
    if d > worst:
        worst, where = d, ("summary", k, v, fn[k])
print(f"{tag}: {count} figures compared, max |diff| = {worst:.3g}" + (f" at {where}" if worst else " (bit for bit)"))
if missing:
    print(f"  missing in new: {sorted(set(missing))[:10]}")

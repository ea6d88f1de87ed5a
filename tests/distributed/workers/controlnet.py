"""The controlnet recipe (tiny config, shortened) on 2 ranks: a trainable controlnet initialised from the
unet, the frozen unet, vae and text encoder all ZeRO-3; 3 optimizer steps, one validation before and after,
export. Records partitions, weight changes per role and what the controlnet started from.

argv: out_dir
"""

import os

from common import dump, out_dir
from multiengine.engines import write_summary
from multiengine.engines.settings import track_reads
from multiengine.recipes import controlnet as recipe
from multiengine.recipes.language.config import checked_config, load_config

ROOT = out_dir()
OVERRIDES = [
    f"output_dir={os.path.join(ROOT, 'run')}", "max_steps=3", "model.tiny_vae_steps=0", "data.builtin_size=24",
    "roles.controlnet.micro_batch_size=2", "eval.heldout_size=4", "eval.timesteps=2", "validation.num_prompts=2",
    "validation.num_inference_steps=2", "validation.every=0", "checkpoint.every=0",
]


def gathered(job, role):
    module = job.registry.role(role).module
    with job.registry.gathered(role):
        return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def max_change(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


track_reads()  # which config keys the checks (rank 0, as the CLI) and the run read
cfg = (checked_config if os.environ.get("RANK", "0") == "0" else load_config)("controlnet", "tiny", OVERRIDES)
job = recipe.ControlNetTraining(cfg)
job.setup()
before = {role: gathered(job, role) for role in ("controlnet", "unet")}
# Initialised from the unet: its encoder half (shared names) starts as the unet's weights.
shared = [n for n in before["controlnet"] if n in before["unet"]]
init_error = max((before["controlnet"][n] - before["unet"][n]).abs().max().item() for n in shared)
job.train()
after = {role: gathered(job, role) for role in ("controlnet", "unet")}
exported = job.export()
summary = job.summary(exported)
if job.registry.is_main:
    write_summary(job.path("summary.json"), summary)
job.plot()
job.write_key_reads()
dump({
    "memory": {row["role"]: row for row in job.registry.memory_report()},
    "stages": {r.name: r.stage for r in job.registry.roles()},
    "trainable": {r.name: r.trainable for r in job.registry.roles()},
    "shared_with_unet": len(shared),
    "init_error": init_error,
    "controlnet_change": max_change(before["controlnet"], after["controlnet"]),
    "unet_change": max_change(before["unet"], after["unet"]),
    "losses": job.losses,
    "heldout": job.heldout,
    "validations": [v["file"] for v in job.validations],
    "export": exported,
    "model_path": job.model_path,
    "summary_extra": {k: summary.get(k) for k in ("conditioning_column", "pipeline", "conditioning_kind")},
    "planned_vs_measured": summary["memory"]["planned_vs_measured"],
})
job.close()
from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""The sd_finetune recipe on 2 ranks, seven runs in one process group (one launch keeps the test short):

Each run is checked as the CLI checks it and records which config keys it read.

  zero3     unet + vae + text_encoder + ema all ZeRO-3, 4 steps of 2 x 2 micro batches (accumulation),
            checkpoints at 2 and 4, export
  resume    from zero3's step-2 checkpoint to step 4
  seed      seed_baseline mode (vae/text_encoder full copies), same seed and data
  lora      LoRA adapters on the unet, 3 steps, export of the adapter
  sdxl      a tiny SDXL-style model: text_encoder + text_encoder_2 as two frozen ZeRO-3 roles, its vae
            pretrained for 4 steps on both ranks first
  sdxl_seed the same SDXL model in seed_baseline mode (frozen roles whole), same seed and data

argv: out_dir
"""

import os

import torch
from common import dump, out_dir
from multiengine.engines import write_summary
from multiengine.engines.partition import local_tensors
from multiengine.engines.settings import track_reads
from multiengine.recipes import sd_finetune as recipe
from multiengine.recipes.language.config import checked_config, load_config

ROOT = out_dir()
COMMON = [
    "max_steps=4", "data.resolution=32",
    "roles.unet.micro_batch_size=2", "roles.unet.grad_accum=2", "roles.unet.gradient_checkpointing=true",
    "eval.heldout_size=4", "eval.timesteps=4", "checkpoint.every=2", "export.roles=[unet,ema]",
]
VALIDATION = ["validation.prompts=[a red square on a white background,a blue circle on a black background]",
              "validation.num_inference_steps=2"]
NO_VALIDATION = ["validation.enabled=false", "validation.guidance_scale=null"]  # tiny.yaml sets the guidance


def run(name: str, *overrides: str):
    # as the CLI runs it (its checks once, then the run on every rank), recording which keys it reads
    track_reads()
    load = checked_config if os.environ.get("RANK", "0") == "0" else load_config
    cfg = load("sd_finetune", "tiny", [*COMMON, f"output_dir={os.path.join(ROOT, name)}", *overrides])
    job = recipe.SDFinetune(cfg)
    job.setup()
    hook = CHECKS_BEFORE.get(name)
    before = hook(job) if hook else None
    job.train()
    hook = CHECKS_AFTER.get(name)
    checks = hook(job, before) if hook else {}
    exported = job.export()
    summary = job.summary(exported)
    result = {
        "losses": job.losses,
        "heldout": job.heldout,
        "memory": {row["role"]: row for row in job.registry.memory_report()},
        "export": exported,
        "validations": [v["file"] for v in job.validations],
        "stages": {r.name: r.stage for r in job.registry.roles()},
        "step_time_s": summary["metrics"]["step_time_s_median"],
        "lr": job.registry["unet"].get_lr()[0],
        "sampler": job.images.state_dict(),
        "vae_pretrain": job.vae_pretrain,
    }
    result.update(checks)
    if job.registry.is_main:
        write_summary(job.path("summary.json"), summary)  # its config: what assert_keys_read checks against
    job.plot()
    job.close()
    job.write_key_reads()
    return result


def gathered_cpu(job, role, names=None):
    module = job.registry.role(role).module
    with job.registry.gathered(role):
        return {n: p.detach().float().clone() for n, p in module.named_parameters() if names is None or n in names}


def ema_full_copies_current(job, _):
    """Persistent (always-gathered) EMA parameters must carry the updated values, not stale ones."""
    worst = 0.0
    held = 0
    for p in job.registry.role("ema").module.parameters():
        if getattr(p, "ds_persist", False) and p.data.numel() == p.ds_numel:
            held += 1
            parts = [torch.empty_like(p.ds_tensor) for _ in range(job.registry.world_size)]
            torch.distributed.all_gather(parts, p.ds_tensor.contiguous())
            full = torch.cat(parts)[: p.ds_numel].view(p.ds_shape)
            worst = max(worst, (full - p.data).abs().max().item())
    raw, ema = gathered_cpu(job, "unet"), gathered_cpu(job, "ema")
    return {"ema_persistent_held": held, "ema_persistent_error": worst,
            "ema_vs_unet": max((raw[n] - ema[n]).abs().max().item() for n in raw),
            "ema_local_numel": sum(t.numel() for t in local_tensors(job.registry.role("ema").module))}


def lora_snapshot(job):
    module = job.registry.role("unet").module
    return {
        "base": {n: t for n, t in gathered_cpu(job, "unet").items() if "lora_" not in n},
        "lora": {n: t for n, t in gathered_cpu(job, "unet").items() if "lora_" in n},
        "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
    }


def lora_after(job, before):
    after = gathered_cpu(job, "unet")
    base_change = max((after[n] - t).abs().max().item() for n, t in before["base"].items())
    lora_change = max((after[n] - t).abs().max().item() for n, t in before["lora"].items())
    return {"base_change": base_change, "lora_change": lora_change, "n_lora": len(before["lora"]),
            "trainable_all_lora": all("lora_" in n for n in before["trainable"]) and bool(before["trainable"])}


CHECKS_BEFORE = {"lora": lora_snapshot}
CHECKS_AFTER = {"zero3": ema_full_copies_current, "lora": lora_after}

results = {"zero3": run("zero3", *VALIDATION, "model.tiny_vae_steps=0", "data.builtin_size=40")}
model = os.path.join(ROOT, "zero3", "tiny_sd")
data = os.path.join(ROOT, "zero3", "data", "shapes")
shared = [f"model.pretrained={model}", f"data.source={data}"]
ckpt = os.path.join(ROOT, "zero3", "checkpoints", "step_00000002")
results["resume"] = run("resume", *shared, *VALIDATION, f"resume_from={ckpt}")
results["seed"] = run("seed", *shared, *VALIDATION, "mode=seed_baseline")
results["lora"] = run("lora", *shared, *NO_VALIDATION, "roles.unet.lora.r=4", "ema.enabled=false",
                      "export.roles=[unet]", "max_steps=3", "roles.unet.lr=1.0e-2", "checkpoint.every=0")
# model.tiny_vae_steps: both ranks pretrain the tiny SDXL's vae (sdxl_seed skips it: its folder has that vae).
sdxl = [f"data.source={data}", "max_steps=2", "checkpoint.every=0", "ema.enabled=false", "export.roles=[unet]"]
results["sdxl"] = run("sdxl", *sdxl, *VALIDATION, "model.tiny_family=sdxl", "model.tiny_vae_steps=4")
# The same tiny SDXL in diffusers' layout (both text encoders and the vae whole on every rank).
results["sdxl_seed"] = run("sdxl_seed", *sdxl, *NO_VALIDATION, "mode=seed_baseline", "export.enabled=false",
                           "export.roles=[]", f"model.pretrained={os.path.join(ROOT, 'sdxl', 'tiny_sdxl')}")
results["paths"] = {"model": model, "root": ROOT}
dump(results)

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

"""Tiny SD3, FLUX and ControlNet training on 2 ranks, each in two layouts (one launch keeps the test short):

  zero3   every role ZeRO-3: the trainable transformer / controlnet and every frozen role (vae, each text
          encoder, the ControlNet's unet); the T5 encoder with its parameters offloaded to the host
  seed    diffusers' layout: the trainable role ZeRO-3, every frozen role a full copy (stage 0)

3 optimizer steps of 2 micro batches x 2 images per rank, fp32, the same seed and data in both layouts;
then the held-out loss. Roles are written here as RoleSpecs (no recipe). The zero3 SD3 run exports its
pipeline. Then the sd_finetune recipe on the tiny FLUX (its own checkpoints and export, EMA on):

  flux_full     4 steps, checkpoints at 2 and 4, export/pipeline
  flux_resume   from flux_full's step-2 checkpoint to step 4
  flux_lora     2 steps of LoRA on the transformer, export/lora and the merged export/pipeline

argv: out_dir
"""

import os

import torch
from common import dump, out_dir
from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
from multiengine.engines.dist import barrier
from multiengine.pipelines.diffusion.controlnet import controlnet_factory
from multiengine.pipelines.diffusion.data import (
    ImageTransform,
    _draw_shape,
    _shapes_rows,
    conditioning_pixels,
    shapes_conditioning_image,
)
from multiengine.pipelines.diffusion.export import export_pipeline
from multiengine.pipelines.diffusion.families import family_roles, model_family
from multiengine.pipelines.diffusion.models import load_component
from multiengine.pipelines.diffusion.tiny import build_tiny
from multiengine.pipelines.diffusion.training import (
    ControlNetObjective,
    DiffusionSettings,
    FlowMatchingObjective,
    heldout_loss,
    prompt_input_ids,
    step_generator,
)

ROOT = out_dir()
SEED, STEPS, ACCUM, MICRO, RES, T5_LEN = 0, 3, 2, 2, 32, 16
ROWS = _shapes_rows(64, RES, seed=1)
TRANSFORM = ImageTransform(RES)


def frozen_spec(path, name, layout):
    stage = 3 if layout == "zero3" else 0
    offload = layout == "zero3" and name == "text_encoder_3"  # SD3's T5 offloaded to the host
    return RoleSpec(name, lambda: load_component(path, name),
                    eval_ds_config(stage=stage, dtype="fp32", offload_params=offload),
                    gather_forward=stage == 3 and name == "vae")


def trainable_spec(name, factory):
    return RoleSpec(name, factory, train_ds_config(stage=3, dtype="fp32", micro_batch_size=MICRO, grad_accum=ACCUM),
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0))


def batch(registry, tokenizers, lengths, step, micro, controlnet=False):
    start = ((step * ACCUM + micro) * registry.world_size + registry.rank) * MICRO
    rows = [ROWS[(start + i) % len(ROWS)] for i in range(MICRO)]
    out = {"pixel_values": torch.stack([TRANSFORM(_draw_shape(r, RES)) for r in rows]),
           **prompt_input_ids(tokenizers, [r["text"] for r in rows], lengths)}
    if controlnet:
        out["conditioning_pixel_values"] = torch.stack(
            [conditioning_pixels(shapes_conditioning_image(r, RES, "edge"), RES) for r in rows])
    return out


def checksum(registry, name):
    with registry.gathered(name):
        return float(sum(p.detach().double().abs().sum() for p in registry.role(name).module.parameters()))


def train(registry, objective, trained, make_batch, heldout):
    engine = registry[trained]
    before = checksum(registry, trained)
    frozen_before = {r.name: checksum(registry, r.name) for r in registry.roles() if not r.trainable}
    losses = []
    for step in range(STEPS):
        micro_losses = []
        for micro in range(ACCUM):
            out = objective.loss(make_batch(step, micro), step_generator(SEED, step, micro, registry.rank))
            engine.backward(out.loss)
            engine.step()
            micro_losses.append(out.loss.detach())
        loss = torch.stack(micro_losses).mean()
        torch.distributed.all_reduce(loss)
        losses.append(loss.item() / registry.world_size)
    return {
        "losses": losses,
        "heldout": heldout(),
        "trained_change": abs(checksum(registry, trained) - before),
        "frozen_change": max(abs(checksum(registry, n) - v) for n, v in frozen_before.items()),
        "memory": {row["role"]: row for row in registry.memory_report()},
        "stages": {r.name: r.stage for r in registry.roles()},
    }


def run_flow(family, path, layout):
    from transformers import AutoTokenizer

    roles = family_roles(family)
    registry = EngineRegistry()
    registry.add(trainable_spec("transformer", lambda: load_component(path, "transformer")))
    for name in roles.frozen:
        registry.add(frozen_spec(path, name, layout))
    registry.build()
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
    # SD3 with its scripts' default (logit-normal density, preconditioned outputs); FLUX with a loss weighting.
    options = {"weighting_scheme": "logit_normal", "precondition_outputs": True} if family == "sd3" else \
        {"weighting_scheme": "cosmap", "guidance_scale": 3.5}
    objective = FlowMatchingObjective(registry, family, config, DiffusionSettings(**options))
    tokenizers = [AutoTokenizer.from_pretrained(path, subfolder=t) for t in roles.tokenizers]
    lengths = [None] * (len(tokenizers) - 1) + [T5_LEN]
    heldout_batches = [batch(registry, tokenizers, lengths, 100, 0)]
    result = train(registry, objective, "transformer", lambda s, m: batch(registry, tokenizers, lengths, s, m),
                   lambda: heldout_loss(objective, heldout_batches, objective.heldout_points(2), seed=7))
    result["guidance"] = objective.guidance_scale
    if layout == "zero3" and family == "sd3":  # every component gathered from its engine, as the recipe does
        components = {"transformer": "transformer", **{n: n for n in roles.frozen}}
        result["export"] = export_pipeline(registry, path, os.path.join(ROOT, f"{family}_export"), components)
    return result


def run_recipe(name, *overrides):
    from multiengine.engines import write_summary
    from multiengine.engines.settings import track_reads
    from multiengine.recipes import sd_finetune
    from multiengine.recipes.language.config import checked_config, load_config

    track_reads()  # which config keys the checks (rank 0, as the CLI) and the run read
    load = checked_config if os.environ.get("RANK", "0") == "0" else load_config
    # the tiny config on the tiny FLUX folder (tiny_flux.yaml names the tiny model's family, refused beside a folder)
    cfg = load("sd_finetune", "tiny", [
        f"output_dir={os.path.join(ROOT, name)}", f"model.pretrained={paths['flux']}", "max_steps=4",
        "diffusion.max_sequence_length=16",
        "data.builtin_size=20", "roles.transformer.micro_batch_size=2", "roles.transformer.grad_accum=1",
        "eval.heldout_size=4", "eval.timesteps=2", "validation.enabled=false", "validation.guidance_scale=null",
        "checkpoint.every=2", "export.roles=[]", *overrides])
    job = sd_finetune.SDFinetune(cfg)
    job.setup()
    job.train()
    exported = job.export()
    summary = job.summary(exported)
    if job.registry.is_main:
        write_summary(job.path("summary.json"), summary)
    job.plot()
    job.write_key_reads()
    out = {"losses": job.losses, "heldout": job.heldout, "export": exported,
           "lr": job.registry["transformer"].get_lr()[0], "sampler": job.images.state_dict(),
           "weights": {role: checksum(job.registry, role) for role in ("transformer", "ema") if role in job.registry}}
    job.close()
    return out


def run_controlnet(path, layout):
    from diffusers import DDPMScheduler
    from transformers import AutoTokenizer

    registry = EngineRegistry()
    registry.add(trainable_spec("controlnet", controlnet_factory(path, seed=SEED)))
    for name in ("unet", "vae", "text_encoder"):
        registry.add(frozen_spec(path, name, layout))
    registry.build()
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    objective = ControlNetObjective(registry, ["text_encoder"], scheduler)
    tokenizers = [AutoTokenizer.from_pretrained(path, subfolder="tokenizer")]
    heldout_batches = [batch(registry, tokenizers, None, 100, 0, controlnet=True)]
    result = train(registry, objective, "controlnet", lambda s, m: batch(registry, tokenizers, None, s, m, True),
                   lambda: heldout_loss(objective, heldout_batches, objective.heldout_points(2), seed=7))
    return result


paths = {f: os.path.join(ROOT, f) for f in ("sd3", "flux", "sd")}
if EngineRegistry().is_main:  # the first registry brings the process group up; rank 0 builds, the others wait
    for family, path in paths.items():
        build_tiny(family, path, seed=SEED, resolution=RES)
barrier()
results = {"families": {f: model_family(p) for f, p in paths.items()}}
for family in ("sd3", "flux"):
    for layout in ("zero3", "seed"):
        results[f"{family}_{layout}"] = run_flow(family, paths[family], layout)
for layout in ("zero3", "seed"):
    results[f"controlnet_{layout}"] = run_controlnet(paths["sd"], layout)
results["flux_full"] = run_recipe("flux_full")
ckpt = os.path.join(ROOT, "flux_full", "checkpoints", "step_00000002")
results["flux_resume"] = run_recipe("flux_resume", f"resume_from={ckpt}")
# LoRA on the FLUX transformer (the family's default targets): export/lora for load_lora_weights, and the
# merged export/pipeline beside it.
results["flux_lora"] = run_recipe("flux_lora", "roles.transformer.lora.r=4", "ema.enabled=false",
                                  "roles.transformer.lr=1.0e-2", "max_steps=2", "checkpoint.every=0")
results["paths"] = paths
dump(results)

from common import finish  # noqa: E402

finish()  # leave together, skip the interpreter's teardown

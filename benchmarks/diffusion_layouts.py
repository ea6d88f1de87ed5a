"""Per-GPU model states of each diffusion family on paper, diffusers' layout (frozen roles whole on every
GPU) vs every role sharded, through the recipes' own planners (`multiengine plan`): SD 1.5, SDXL base,
SD3-medium, FLUX.1-dev (full and LoRA) and a ControlNet for SD 1.5, on 1, 8 and 64 GPUs. Computed from the
built-in architectures (parameter counts exact), bf16 weights, Adam in fp32; no weights loaded, no GPU.

    python -m benchmarks.diffusion_layouts          # a markdown table
"""

from __future__ import annotations

from multiengine.engines import planner as P

GPUS = (1, 8, 64)
# the trained role plain ZeRO-3 (no offload) in every case, so that only the frozen roles' layout differs
COMMON = [f"roles.{r}.dtype=bf16" for r in ("vae", "text_encoder")]
# (title, recipe, shipped config, overrides); every run at batch 1 with gradient checkpointing, no EMA
CASES = [
    ("SD 1.5 full, 512 px", "sd_finetune", "sd15_full", []),
    ("SDXL base full, 1024 px", "sd_finetune", "sdxl_full", []),
    ("SD3-medium full, 1024 px", "sd_finetune", "sd3_medium_full", []),
    ("FLUX.1-dev full, 1024 px", "sd_finetune", "flux_dev_lora", ["roles.transformer.lora.r=0"]),
    ("FLUX.1-dev LoRA r16, 1024 px", "sd_finetune", "flux_dev_lora", []),
    ("ControlNet for SD 1.5, 512 px", "controlnet", "tiny",
     ["model.pretrained=stable-diffusion-v1-5/stable-diffusion-v1-5", "data.resolution=512",
      "roles.controlnet.micro_batch_size=1", "roles.controlnet.gradient_checkpointing=true",
      "roles.controlnet.dtype=bf16", "roles.unet.dtype=bf16"]),
]


def states(recipe: str, config: str, overrides: list[str], mode: str, gpus: int) -> dict[str, float]:
    """Per-GPU model-state GiB per role at the config's placements (every role ZeRO-3 in zero3 mode)."""
    from multiengine.recipes.language.config import load_config, load_recipe

    extra = ["ema.enabled=false", "roles.unet.offload_optimizer=false"] if recipe == "sd_finetune" else []
    cfg = load_config(recipe, config, [*overrides, *COMMON, *extra, f"mode={mode}"])
    (item,) = load_recipe(recipe).plan(cfg)
    plan = P.plan(item.roles, P.Budget(world_size=gpus, gpu_bytes=80 * P.GIB, gpus_per_node=min(gpus, 8),
                                       host_bytes=P.TIB))
    return {r.request.name: r.current.states.accelerator / P.GIB for r in plan.roles}


def main() -> None:
    header = "| model | layout |" + "".join(f" {g} GPU{'s' if g > 1 else ''} |" for g in GPUS)
    header += " frozen roles at 8 GPUs |"
    print(header)
    print("|---|---|" + "---:|" * len(GPUS) + "---|")
    for title, recipe, config, overrides in CASES:
        for mode, label in (("seed_baseline", "diffusers' (frozen whole)"), ("zero3", "all ZeRO-3")):
            per = {g: states(recipe, config, overrides, mode, g) for g in GPUS}
            trained = next(iter(per[8]))  # the planners list the trained role first
            frozen = ", ".join(f"{n} {v:.1f}" for n, v in per[8].items() if n != trained)
            cells = "".join(f" {sum(per[g].values()):.1f} |" for g in GPUS)
            print(f"| {title} | {label} |{cells} {frozen} |")


if __name__ == "__main__":
    main()

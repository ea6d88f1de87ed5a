"""diffusion_grpo then diffusion_dpo in one 2-rank launch, in process (checked_config + main, as the CLI runs
them): one process start and one set of imports for both recipes. Then each again in a new folder, resumed from
the first run's step-6 checkpoint (its tiny pipeline and reward model linked in: the same pretrained weights).
Last, 2-step runs of the flow families: GRPO on tiny SD3 and on tiny FLUX with LoRA (both leaving zero-advantage
rows out of the loss, as Flow-GRPO), DPO on tiny SD3.

argv: out_dir, then per recipe a JSON list of overrides: grpo_overrides, dpo_overrides.
"""

import json
import os
import sys

import torch
from common import dump, finish, link_into
from multiengine.recipes.language.config import checked_config, load_recipe

out = sys.argv[1]
FAST = ["eval.every=0", "checkpoint.every=0"]


def run(recipe: str, folder: str, overrides: list[str], resume: str = "") -> dict:
    if resume:
        link_into(folder, {n: os.path.join(resume, n) for n in ("tiny_sd", "tiny_reward")
                           if os.path.isdir(os.path.join(resume, n))})
        overrides = [*overrides, f"resume_from={resume}/checkpoints/step_00000006"]
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", *FAST, *overrides])
    load_recipe(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


grpo, dpo = json.loads(sys.argv[2]), json.loads(sys.argv[3])
results = {"grpo": run("diffusion_grpo", f"{out}/grpo", grpo), "dpo": run("diffusion_dpo", f"{out}/dpo", dpo)}
results["grpo_resumed"] = run("diffusion_grpo", f"{out}/grpo_resumed", grpo, resume=f"{out}/grpo")
results["dpo_resumed"] = run("diffusion_dpo", f"{out}/dpo_resumed", dpo, resume=f"{out}/dpo")
FLOW = ["max_steps=2", "model.tiny_unet_steps=0", "model.tiny_vae_steps=0", "plot=false", "tensorboard=false"]
DROP = ["diffusion.drop_zero_advantages=true"]
results["flow"] = {
    "grpo_sd3": run("diffusion_grpo", f"{out}/grpo_sd3", [*FLOW, "model.tiny_family=sd3", *DROP]),
    "grpo_flux_lora": run("diffusion_grpo", f"{out}/grpo_flux_lora", [*FLOW, "model.tiny_family=flux", *DROP,
                                                                     "roles.policy.lora.r=4", "roles.policy.lr=1e-3"]),
    "dpo_sd3": run("diffusion_dpo", f"{out}/dpo_sd3", [*FLOW, "model.tiny_family=sd3"])}
dump(results)
finish()

"""diffusion_grpo then diffusion_dpo in one 2-rank launch, in process (checked_config + main, as the CLI runs
them): one process start and one set of imports for both recipes. Then diffusion_dpo again in a new folder,
resumed from the first DPO run's step-6 checkpoint (its tiny pipeline linked in: the same pretrained vae).

argv: out_dir, then per recipe a JSON list of overrides: grpo_overrides, dpo_overrides.
"""

import json
import os
import sys

import torch
from common import dump, finish
from multiengine.engines.recipe_config import checked_config, load_recipe

out = sys.argv[1]
FAST = ["eval.every=0", "checkpoint.every=0"]


def run(recipe: str, folder: str, overrides: list[str], tiny: str = "") -> dict:
    if tiny:
        if torch.distributed.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            os.symlink(tiny, os.path.join(folder, "tiny_sd"))
        torch.distributed.barrier()  # the other rank's config check creates output_dir too
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", *FAST, *overrides])
    load_recipe(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


dpo = json.loads(sys.argv[3])
results = {"grpo": run("diffusion_grpo", f"{out}/grpo", json.loads(sys.argv[2])),
           "dpo": run("diffusion_dpo", f"{out}/dpo", dpo)}
results["dpo_resumed"] = run("diffusion_dpo", f"{out}/dpo_resumed",
                             [*dpo, f"resume_from={out}/dpo/checkpoints/step_00000006"], tiny=f"{out}/dpo/tiny_sd")
dump(results)
finish()

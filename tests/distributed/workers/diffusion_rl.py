"""diffusion_grpo then diffusion_dpo in one 2-rank launch, in process (checked_config + main, as the CLI runs
them): one process start and one set of imports for both recipes.

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


def run(recipe: str, folder: str, overrides: list[str]) -> dict:
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", *FAST, *overrides])
    load_recipe(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


results = {"grpo": run("diffusion_grpo", f"{out}/grpo", json.loads(sys.argv[2])),
           "dpo": run("diffusion_dpo", f"{out}/dpo", json.loads(sys.argv[3]))}
dump(results)
finish()

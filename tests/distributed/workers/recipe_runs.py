"""Several recipe runs one after another in one 2-rank launch, in process (checked_config + main, as the CLI
runs them): one process start and one set of imports for all of them.

argv: out_dir, then a JSON list of [recipe, [overrides...]]; each run's output_dir is among its overrides.
"""

import json
import sys

import torch
from common import dump, finish
from multiengine.recipes.language.config import checked_config, load_recipe

for recipe, overrides in json.loads(sys.argv[2]):
    load_recipe(recipe).main(checked_config(recipe, "tiny", overrides))
    torch.distributed.barrier()  # rank 0 writes summary.json before the next run reads the folder
dump({})
finish()

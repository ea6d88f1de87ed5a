"""One optimizer step of several tiny recipes at several ZeRO stages, in one launch (recipes compose in one
process, each with its own registry on the same ranks); each run writes its summary.json, whose
memory.planned_vs_measured the test reads.

    worker.py OUT ASSETS SD_MODEL SHAPES STUDENT STAGES...
"""

from __future__ import annotations

import os
import sys

from common import dump
from multiengine.recipes.config import load_config, load_recipe

QUIET = ["max_steps=1", "checkpoint.every=0", "tensorboard=false", "plot=false", "export.enabled=false"]


def runs(assets: str, sd_model: str, shapes: str, student: str, stage: int) -> dict[str, list[str]]:
    model, data = os.path.join(assets, "model"), os.path.join(assets, "data")
    s = str(stage)
    return {
        "sd_finetune": [f"model.pretrained={sd_model}", f"data.source={shapes}", "data.resolution=32",
                        "train.micro_batch_size=2", "validation.enabled=false", "eval.heldout_size=2",
                        "eval.timesteps=1", "ema.enabled=true", f"roles.unet.stage={s}", f"roles.vae.stage={s}",
                        f"roles.text_encoder.stage={s}"],
        "rlhf_ppo": [f"model.actor={model}", f"model.reward={model}", f"data.source={data}",
                     "ppo.rollout_batch_size=4", "ppo.mini_batch_size=4", "ppo.ppo_epochs=1",
                     "generation.max_new_tokens=4", "eval.size=2", "eval.batch_size=1", "eval.greedy=false",
                     f"roles.actor.stage={s}", f"roles.critic.stage={s}"],
        "rlhf_grpo": [f"model.actor={model}", f"data.source={data}", "grpo.rollout_batch_size=2",
                      "grpo.n_samples_per_prompt=2", "grpo.mini_batch_size=4", "generation.max_new_tokens=4",
                      "eval.size=0", f"roles.actor.stage={s}"],
        "distill": [f"model.teacher={model}", f"model.student={student}", f"data.source={data}",
                    "train.micro_batch_size=4", "data.heldout_size=8", "eval.size=0", f"roles.teacher.stage={s}",
                    f"roles.student.stage={s}"],
    }


def main() -> None:
    out, assets, sd_model, shapes, student, *stages = sys.argv[1:]
    done = []
    for stage in (int(x) for x in stages):
        for recipe, overrides in runs(assets, sd_model, shapes, student, stage).items():
            run_dir = os.path.join(out, f"{recipe}_stage{stage}")
            cfg = load_config(recipe, "tiny", [*QUIET, f"output_dir={run_dir}", *overrides])
            load_recipe(recipe).main(cfg)
            done.append(run_dir)
    dump({"runs": done})


if __name__ == "__main__":
    main()

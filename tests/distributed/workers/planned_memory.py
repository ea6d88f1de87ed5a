"""One optimizer step of several tiny recipes at several ZeRO stages, in one launch (recipes compose in one
process, each with its own registry on the same ranks); each run writes its summary.json, whose
memory.planned_vs_measured the test reads. The SDXL, SD3 and FLUX tiny configs run through the same
sd_finetune recipe as SD (run names sd_finetune_<family>), each from its prebuilt tiny model.

    worker.py OUT ASSETS SD_MODEL SHAPES STUDENT FAMILY_MODELS STAGES...

FAMILY_MODELS: comma-separated family=folder pairs (sdxl=/x,sd3=/y,flux=/z), or "-" for none.
"""

from __future__ import annotations

import os
import sys

from common import dump, finish
from multiengine.engines.settings import track_reads
from multiengine.recipes.language.config import checked_config, load_config, load_recipe

QUIET = ["max_steps=1", "checkpoint.every=0", "checkpoint.keep_last=2", "tensorboard=false", "plot=false",
         "export.enabled=false"]
# The smallest sd_finetune run that still takes one optimizer step (Adam state exists) and builds every role.
SD_SMALL = ["data.resolution=32", "validation.enabled=false", "validation.guidance_scale=null", "export.roles=[]",
            "eval.heldout_size=2", "eval.timesteps=1", "ema.enabled=true"]
FAMILY_ROLES = {"sdxl": ("unet", "vae", "text_encoder", "text_encoder_2"),
                "sd3": ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"),
                "flux": ("transformer", "vae", "text_encoder", "text_encoder_2")}


def runs(assets: str, sd_model: str, shapes: str, student: str, families: dict[str, str],
         stage: int) -> dict[str, tuple[str, str, list[str]]]:
    """run name -> (recipe, config, overrides)."""
    model, data = os.path.join(assets, "model"), os.path.join(assets, "data")
    s = str(stage)
    out = {
        "sd_finetune": ("sd_finetune", "tiny", [
            f"model.pretrained={sd_model}", f"data.source={shapes}", *SD_SMALL, "roles.unet.micro_batch_size=2",
            f"roles.unet.stage={s}", f"roles.vae.stage={s}", f"roles.text_encoder.stage={s}"]),
        "rlhf_ppo": ("rlhf_ppo", "tiny", [
            f"roles.actor.model={model}", f"roles.reward.model={model}", f"data.source={data}",
            "ppo.rollout_batch_size=4", "roles.actor.micro_batch_size=4", "roles.critic.micro_batch_size=4",
            "ppo.epochs=1", "generation.max_new_tokens=4", "eval.size=2",
            "eval.batch_size=1", "eval.greedy=false", f"roles.actor.stage={s}", f"roles.critic.stage={s}"]),
        "rlhf_grpo": ("rlhf_grpo", "tiny", [
            f"roles.actor.model={model}", f"data.source={data}", "grpo.rollout_batch_size=2",
            "grpo.n_samples_per_prompt=2", "roles.actor.micro_batch_size=4", "generation.max_new_tokens=4",
            "eval.size=0",
            f"roles.actor.stage={s}"]),
        "distill": ("distill", "tiny", [
            f"roles.teacher.model={model}", f"roles.student.model={student}", f"data.source={data}",
            "roles.student.micro_batch_size=4",
            "data.heldout_size=8", "eval.size=0", f"roles.teacher.stage={s}", f"roles.student.stage={s}"]),
    }
    for family, folder in families.items():
        out[f"sd_finetune_{family}"] = ("sd_finetune", f"tiny_{family}", [
            # the family comes from the folder (model.tiny_family back to its default)
            f"model.pretrained={folder}", "model.tiny_family=sd", f"data.source={shapes}", *SD_SMALL,
            f"roles.{FAMILY_ROLES[family][0]}.micro_batch_size=2",
            *(f"roles.{role}.stage={s}" for role in FAMILY_ROLES[family])])
    return out


def main() -> None:
    out, assets, sd_model, shapes, student, family_models, *stages = sys.argv[1:]
    families = dict(pair.split("=", 1) for pair in family_models.split(",")) if family_models != "-" else {}
    done = []
    track_reads()  # from the start, as the CLI does: the keys the checks read count toward each run's key reads
    for stage in (int(x) for x in stages):
        for name, (recipe, config, overrides) in runs(assets, sd_model, shapes, student, families, stage).items():
            run_dir = os.path.join(out, f"{name}_stage{stage}")
            # rank 0 runs the checks the CLI runs before launch (they read keys too), the others only load
            load = checked_config if os.environ.get("RANK", "0") == "0" else load_config
            cfg = load(recipe, config, [*QUIET, f"output_dir={run_dir}", *overrides])
            load_recipe(recipe).main(cfg)
            done.append(run_dir)
    dump({"runs": done})
    finish()  # leave together, skip the interpreter's teardown


if __name__ == "__main__":
    main()

"""diffusion_grpo and diffusion_dpo on 2 ranks, short runs from the random tiny SD unet, both in one launch (as the
CLI runs them: checked_config + main): the held-out reward rises (GRPO), the held-out implicit reward accuracy rises
above 0.5 (DPO, a LoRA policy), the frozen ref and reward roles hold half of their parameters per rank, and in a
fresh process the exported policy loads and generates in diffusers and the DPO adapter loads with
load_lora_weights, giving the merged export's images. Each recipe resumed from its run's step-6 checkpoint
repeats that run's steps 7-12 exactly (the GRPO run keeps DDPO's per-prompt reward buffers, which the checkpoint
carries). The flow families (tiny SD3 and FLUX) run both recipes for 2 steps with
every frozen role sharded, and the FLUX LoRA adapter loads with load_lora_weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import FLUX_LORA_CHECK, assert_keys_read, launch

pytestmark = pytest.mark.distributed

# GRPO: a shorter unet pretrain than the documented run's 400 steps (the vae's 100 are needed: with 40 the
# sampled images carry no colour and the reward stays at 0), with DDPO's per-prompt reward buffers (16) so that the
# resumed run needs their state. DPO: LoRA from the random unet, a brief vae pretrain.
# Measured (2 ranks, seed 0): GRPO reward 0.116 -> 0.559 in 12 steps; DPO implicit accuracy 0 -> 0.78 in 12.
GRPO = ["max_steps=12", "model.tiny_unet_steps=100", "checkpoint.every=6", "diffusion.prompt_buffer=16"]
DPO = ["max_steps=12", "model.tiny_unet_steps=0", "model.tiny_vae_steps=30", "roles.policy.lora.r=8",
       "roles.policy.lr=1e-3", "checkpoint.every=6"]
# In a fresh process, diffusers alone: the GRPO export generates; the DPO adapter on its base pipeline gives the
# merged export's image and not the base's.
FRESH = FLUX_LORA_CHECK + """
import json, sys
import numpy as np, torch
from diffusers import StableDiffusionPipeline
paths = json.loads(sys.argv[1])
def run(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe(["a red square on a white background"], height=16, width=16, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="np").images
out = {"grpo_shape": list(run(StableDiffusionPipeline.from_pretrained(paths["grpo"])).shape)}
merged = run(StableDiffusionPipeline.from_pretrained(paths["dpo"]))
base = StableDiffusionPipeline.from_pretrained(paths["base"])
plain = run(base)
base.load_lora_weights(paths["lora"])
adapted = run(base)
out.update(adapters=base.get_active_adapters(), lora_vs_base=float(np.abs(adapted - plain).max()),
           lora_vs_merged=float(np.abs(adapted - merged).max()))
out["flux"] = flux_lora_check(paths["flux_base"], paths["flux_lora"], paths["flux_merged"], 16)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("diffusion_rl")
    return launch("diffusion_rl", out, json.dumps(GRPO), json.dumps(DPO), timeout=900)[0], out


@pytest.fixture(scope="module")
def fresh(runs):
    out = runs[1]
    paths = {"grpo": str(out / "grpo" / "export" / "policy"), "dpo": str(out / "dpo" / "export" / "policy"),
             "base": str(out / "dpo" / "tiny_sd"), "lora": str(out / "dpo" / "export" / "lora"),
             "flux_base": str(out / "grpo_flux_lora" / "tiny_flux"),
             "flux_lora": str(out / "grpo_flux_lora" / "export" / "lora"),
             "flux_merged": str(out / "grpo_flux_lora" / "export" / "policy")}
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


# run -> (recipe, the text encoders its family lacks, LoRA on): what each run's options leave unused
RUNS = {"grpo": ("diffusion_grpo", (2, 3), False), "grpo_resumed": ("diffusion_grpo", (2, 3), False),
        "dpo": ("diffusion_dpo", (2, 3), True), "dpo_resumed": ("diffusion_dpo", (2, 3), True),
        "grpo_sd3": ("diffusion_grpo", (), False), "grpo_flux_lora": ("diffusion_grpo", (3,), True),
        "dpo_sd3": ("diffusion_dpo", (), False)}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_every_key_is_read_by_the_runs(runs, run):
    from multiengine.recipes.language.config import leaves, load_recipe, recipe_schema

    recipe, absent, lora = RUNS[run]
    skip = tuple(f"roles.text_encoder_{i}." for i in absent)  # the family has no such text encoder
    if not lora:  # lora.r 0: the adapters' other options have nothing to act on
        skip += ("roles.policy.lora.alpha", "roles.policy.lora.dropout", "roles.policy.lora.target_modules")
    unread = tuple(k for k in leaves(recipe_schema(load_recipe(recipe))) if k.startswith(skip)) if skip else ()
    assert_keys_read(runs[1] / run, recipe, unread=unread)


def _half_per_rank(summary: dict, *roles: str) -> None:
    for rank in summary["memory"]["per_rank"]:
        rows = {r["role"]: r for r in rank["roles"]}
        for role in roles:
            local, total = rows[role]["params_local"], rows[role]["params_total"]
            assert total > local and 2 * local >= total and 2 * local - total < 64, (role, local, total)


def test_diffusion_grpo_raises_the_held_out_reward_and_exports(runs, fresh):
    summary = runs[0]["grpo"]
    before, after = summary["evaluations"][0], summary["evaluations"][-1]
    assert after["reward"] > before["reward"] + 0.2, (before, after)
    assert summary["roles"]["ref"]["stage"] == 3 and summary["roles"]["reward"]["stage"] == 3
    _half_per_rank(summary, "ref", "reward", "vae")
    assert [os.path.basename(g) for g in summary["grids"]] == ["000000_before.png", "000012_after.png"]
    assert fresh["grpo_shape"] == [1, 16, 16, 3]


def test_diffusion_dpo_raises_the_held_out_implicit_accuracy(runs, fresh):
    summary, out = runs[0]["dpo"], runs[1] / "dpo"
    before, after = summary["evaluations"][0], summary["evaluations"][-1]
    # the policy starts equal to the ref: every margin is 0, no pair counts as correct
    assert before["implicit_acc"] == 0 and before["margin"] == 0
    assert after["implicit_acc"] > 0.6 and after["margin"] > 0, after
    _half_per_rank(summary, "ref", "vae")
    assert (out / "export" / "policy" / "unet" / "config.json").is_file()
    # a LoRA policy: the adapter is all that trained, and diffusers' load_lora_weights reads export/lora
    policy = {r["role"]: r for r in summary["memory"]["per_rank"][0]["roles"]}["policy"]
    assert summary["roles"]["policy"]["lora"] and 0 < 10 * policy["grad_bytes"] < policy["param_bytes"], policy
    assert fresh["adapters"] and fresh["lora_vs_base"] > 1e-3 and fresh["lora_vs_merged"] < 1e-4, fresh


def _train_lines(path) -> dict[int, dict]:
    # the step's training figures; memory and timings differ between any two runs
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return {x["step"]: {k: v for k, v in x.items() if k.startswith("train/") and not k.startswith("train/mem/")
                        and not k.endswith("_s")} for x in lines if any(k.startswith("train/") for k in x)}


@pytest.mark.parametrize("recipe", ["grpo", "dpo"])
def test_diffusion_rl_resumed_from_a_checkpoint_repeats_the_run(runs, recipe):
    straight = _train_lines(runs[1] / recipe / "metrics.jsonl")
    resumed = _train_lines(runs[1] / f"{recipe}_resumed" / "metrics.jsonl")
    assert sorted(resumed) == list(range(7, 13)) and len(straight[7]) > 3, (sorted(resumed), straight[7])
    assert {s: straight[s] for s in resumed} == resumed
    assert runs[0][f"{recipe}_resumed"]["evaluations"][-1] == runs[0][recipe]["evaluations"][-1]


@pytest.mark.parametrize("name, family, encoders", [("grpo_sd3", "sd3", 3), ("grpo_flux_lora", "flux", 2),
                                                     ("dpo_sd3", "sd3", 3)])
def test_flow_families_run_both_recipes_with_every_frozen_role_sharded(runs, fresh, name, family, encoders):
    summary = runs[0]["flow"][name]
    assert summary["family"] == family and summary["metrics"]["steps"] == 2
    frozen = ["ref", "vae", "text_encoder", *(f"text_encoder_{i}" for i in range(2, encoders + 1))]
    assert {r: summary["roles"][r]["stage"] for r in frozen} == dict.fromkeys(frozen, 3)
    assert summary["roles"]["policy"]["stage"] == 2 and summary["roles"]["policy"]["lora"] == (family == "flux")
    _half_per_rank(summary, *frozen)
    if name == "dpo_sd3":  # the policy moved away from the ref
        assert summary["evaluations"][-1]["margin"] > 0, summary["evaluations"]
    if family == "flux":  # the transformer's adapter changes the image and equals the merged export
        assert "transformer" in fresh["flux"]["adapters"], fresh["flux"]
        # measured: 1.5e-4 from the base after 2 steps, 6.6e-7 from the merged export (float noise)
        assert fresh["flux"]["lora_vs_base"] > 3e-5 and fresh["flux"]["lora_vs_merged"] < 5e-6, fresh["flux"]

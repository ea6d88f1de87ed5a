"""SD3- and FLUX-style flow matching and ControlNet on 2 real ranks (DeepSpeed CPU accelerator, gloo): every
role ZeRO-3, frozen ones included (each holds half of itself per rank), gives the same losses as diffusers'
layout (frozen roles whole on every rank) for the same seed and data; a flow-matching run resumes identically;
the SD3 and FLUX exports load in their diffusers pipelines alone in a fresh process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import FLUX_LORA_CHECK, assert_keys_read, launch

pytestmark = pytest.mark.distributed

RUNS = {"sd3": "transformer", "flux": "transformer", "controlnet": "controlnet"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("flow_families", tmp_path_factory.mktemp("flow_families"), timeout=900)


# What the FLUX recipe runs leave unused: the roles and options of the other families (an SD/SDXL unet, SD3's third
# text encoder, the DDPM options), the logit-normal and mode densities' options (FLUX's scheme is none), the built-in
# data's image check; without LoRA its options, without EMA its role.
@pytest.mark.parametrize("run", ["flux_full", "flux_resume", "flux_lora"])
def test_every_key_is_read_by_the_recipe_runs(ranks, run):
    from multiengine.recipes.language.config import leaves, load_recipe, recipe_schema

    skip = ("roles.unet.", "roles.text_encoder_3.", "diffusion.prediction_type", "diffusion.snr_gamma",
            "diffusion.noise_offset", "diffusion.input_perturbation", "diffusion.logit_", "diffusion.mode_scale",
            "data.check_images")
    skip += ("roles.ema.", "validation.use_ema") if run == "flux_lora" else \
        ("roles.transformer.lora.alpha", "roles.transformer.lora.dropout", "roles.transformer.lora.target_modules")
    unread = tuple(k for k in leaves(recipe_schema(load_recipe("sd_finetune"))) if k.startswith(skip))
    assert_keys_read(os.path.join(os.path.dirname(ranks[0]["paths"]["flux"]), run), "sd_finetune", unread=unread)


def test_family_detection(ranks):
    assert ranks[0]["families"] == {"sd3": "sd3", "flux": "flux", "sd": "sd"}


def test_every_role_is_sharded_in_the_zero3_layout(ranks):
    expected = {"sd3": {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"},
                "flux": {"transformer", "vae", "text_encoder", "text_encoder_2"},
                "controlnet": {"controlnet", "unet", "vae", "text_encoder"}}
    for r in ranks:
        for run, trained in RUNS.items():
            z, s = r[f"{run}_zero3"], r[f"{run}_seed"]
            assert set(z["memory"]) == expected[run]
            assert set(z["stages"].values()) == {3}, (run, z["stages"])
            assert s["stages"] == {n: 3 if n == trained else 0 for n in expected[run]}, (run, s["stages"])
            for role, row in z["memory"].items():
                # this rank's partition is half of the role (DeepSpeed pads each tensor to a multiple of 2) ...
                assert 0.49 < row["local_fraction"] < 0.51, (run, role, row)
                if role != trained:
                    # ... and with the small tensors kept whole (persistent) a frozen role stays well under all of it
                    assert row["param_bytes"] < 0.7 * row["params_total"] * 4, (run, role, row)
                    assert row["optimizer_bytes"] == 0 and s["memory"][role]["local_fraction"] == 1.0
            assert z["memory"][trained]["optimizer_bytes"] > 0


def test_losses_equal_the_seed_layout(ranks):
    for r in ranks:
        for run in RUNS:
            z, s = r[f"{run}_zero3"], r[f"{run}_seed"]
            assert len(z["losses"]) == 3 and all(math.isfinite(x) and 0 < x < 20 for x in z["losses"])
            assert s["losses"] == pytest.approx(z["losses"], rel=1e-5, abs=1e-6), run
            assert s["heldout"] == pytest.approx(z["heldout"], rel=1e-5), run
            assert len(set(z["losses"])) == 3  # the steps really differ (new data, updated weights)
    for run in RUNS:  # averaged over ranks: the same numbers on both
        assert ranks[0][f"{run}_zero3"]["losses"] == ranks[1][f"{run}_zero3"]["losses"]


def test_only_the_trained_role_changes(ranks):
    for r in ranks:
        for run in RUNS:
            for layout in ("zero3", "seed"):
                out = r[f"{run}_{layout}"]
                assert out["trained_change"] > 1e-3 and out["frozen_change"] == 0.0, (run, layout)
        assert r["flux_zero3"]["guidance"] == 3.5 and r["sd3_zero3"]["guidance"] is None


def test_flow_matching_resume_continues_identically(ranks):
    for r in ranks:
        full, resumed = r["flux_full"], r["flux_resume"]
        assert len(full["losses"]) == 4 and len(set(full["losses"])) == 4
        assert resumed["losses"][:2] == full["losses"][:2]  # restored from the checkpoint's client state
        assert resumed["losses"][2:] == pytest.approx(full["losses"][2:], rel=1e-6, abs=1e-7)
        assert resumed["lr"] == full["lr"] and resumed["sampler"] == full["sampler"]
        assert resumed["heldout"]["after/loss"] == pytest.approx(full["heldout"]["after/loss"], rel=1e-6)
        # the transformer, its optimizer state and the EMA continue: the same weights after step 4
        for role in ("transformer", "ema"):
            assert resumed["weights"][role] == pytest.approx(full["weights"][role], rel=1e-7), role


FRESH = FLUX_LORA_CHECK + textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    paths = json.loads(sys.argv[1])
    out = {}
    for name, cls, kwargs in (("sd3", StableDiffusion3Pipeline, {}), ("flux", FluxPipeline, {"guidance_scale": 3.5})):
        pipe = cls.from_pretrained(paths[name])
        img = pipe("a red square on a white background", num_inference_steps=2, height=32, width=32,
                   max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="np",
                   **kwargs).images
        out[name] = {"class": type(pipe).__name__, "shape": list(img.shape), "finite": bool(np.isfinite(img).all()),
                     "std": float(img.std()), "dtype": str(pipe.transformer.dtype)}

    # The FLUX LoRA run: export/lora on the base model, against the merged export (export/pipeline) and the base.
    out["flux_lora"] = flux_lora_check(paths["flux_base"], paths["flux_lora"], paths["flux_merged"], 32)
    print("RESULT" + json.dumps(out))
    """
)


def test_sd3_and_flux_exports_load_with_diffusers_alone_in_a_fresh_process(ranks):
    r = ranks[0]
    paths = {"sd3": r["sd3_zero3"]["export"], "flux": r["flux_full"]["export"]["pipeline"],
             "flux_base": r["paths"]["flux"], "flux_lora": r["flux_lora"]["export"]["lora"],
             "flux_merged": r["flux_lora"]["export"]["pipeline"]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no project code on the path
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name, cls in (("sd3", "StableDiffusion3Pipeline"), ("flux", "FluxPipeline")):
        assert out[name]["class"] == cls
        assert out[name]["shape"] == [1, 32, 32, 3] and out[name]["finite"] and out[name]["std"] > 0, out[name]
        assert out[name]["dtype"] == "torch.float32"
    # the transformer's adapter loads with load_lora_weights, changes the image, and equals the merged export
    lora = out["flux_lora"]
    assert lora["adapters"] and "transformer" in lora["adapters"], lora
    # measured: 8.8e-4 from the base after 2 steps, 4.8e-7 from the merged export (float noise)
    assert lora["lora_vs_base"] > 1e-4 and lora["lora_vs_merged"] < 1e-5, lora

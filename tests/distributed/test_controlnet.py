"""The controlnet recipe on 2 real ranks (DeepSpeed CPU accelerator, gloo, no mocks): the frozen unet is
partitioned beside the trainable controlnet, only the controlnet changes, and the exported pipeline loads
with diffusers alone in a fresh process and generates from a conditioning image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_keys_read, launch

pytestmark = pytest.mark.distributed

ROLES = {"controlnet", "unet", "vae", "text_encoder"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("controlnet")
    return launch("controlnet", out, timeout=600), out


def test_every_key_is_read_by_the_run(ranks):
    from multiengine.recipes.language.config import leaves, load_recipe, recipe_schema

    absent = tuple(k for k in leaves(recipe_schema(load_recipe("controlnet")))
                   if k.startswith(("roles.text_encoder_2.", "roles.text_encoder_3.")))  # a tiny SD has one encoder
    assert_keys_read(ranks[1] / "run", "controlnet", unread=(*absent, "data.check_images"))  # built-in data


def test_every_role_is_sharded_and_only_the_controlnet_trains(ranks):
    for r in ranks[0]:
        assert set(r["memory"]) == ROLES
        assert r["stages"] == dict.fromkeys(ROLES, 3)
        assert r["trainable"] == {n: n == "controlnet" for n in ROLES}
        for role, row in r["memory"].items():
            # this rank holds half of every role (DeepSpeed pads each tensor to a multiple of 2) ...
            assert 0.49 < row["local_fraction"] < 0.51, (role, row)
        unet = r["memory"]["unet"]
        # ... the frozen unet's bytes too (well under a full copy even with its small persistent tensors)
        assert unet["param_bytes"] < 0.7 * unet["params_total"] * 4, unet
        assert unet["optimizer_bytes"] == 0 and r["memory"]["controlnet"]["optimizer_bytes"] > 0
    # `multiengine plan controlnet` predicts these per-rank model states (the ControlNet built on the meta device)
    report = ranks[0][0]["planned_vs_measured"]
    assert set(report["roles"]) == ROLES, report
    assert all(row["within_tolerance"] for row in report["roles"].values()), report


def test_controlnet_starts_from_the_unet_and_only_it_changes(ranks):
    for r in ranks[0]:
        assert r["shared_with_unet"] > 10 and r["init_error"] == 0.0  # diffusers' ControlNetModel.from_unet
        assert r["controlnet_change"] > 1e-4
        assert r["unet_change"] == 0.0
        assert len(r["losses"]) == 3 and all(0 < x < 10 for x in r["losses"])
    assert ranks[0][0]["losses"] == ranks[0][1]["losses"]  # averaged over ranks


def test_validation_grids_and_summary(ranks):
    from PIL import Image

    r = ranks[0][0]
    assert len(r["validations"]) == 2
    with Image.open(r["validations"][-1]) as grid:
        width, height = grid.size
    # two columns (conditioning image | generation) of 32 px images upscaled to 256, one labelled row per prompt
    assert width == 2 * 256 and 2 * 256 < height < 2 * 320, grid.size
    assert r["summary_extra"] == {"conditioning_column": "conditioning_image",
                                  "pipeline": "StableDiffusionControlNetPipeline", "conditioning_kind": "edge"}


FRESH = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
    from PIL import Image
    from safetensors.torch import load_file

    paths = json.loads(sys.argv[1])
    pipe = StableDiffusionControlNetPipeline.from_pretrained(paths["pipeline"])
    alone = ControlNetModel.from_pretrained(paths["controlnet"])
    edge = Image.new("RGB", (32, 32))
    edge.paste((255, 255, 255), (8, 8, 24, 24))
    edge.paste((0, 0, 0), (9, 9, 23, 23))
    def run(scale):
        return pipe("a red square on a white background", image=edge, num_inference_steps=2, height=32, width=32,
                    controlnet_conditioning_scale=scale, generator=torch.Generator().manual_seed(0),
                    output_type="np").images
    img, plain = run(1.0), run(0.0)
    name = "diffusion_pytorch_model.safetensors"
    exported, source = load_file(paths["pipeline"] + "/unet/" + name), load_file(paths["model"] + "/unet/" + name)
    out = {"class": type(pipe).__name__, "shape": list(img.shape), "finite": bool(np.isfinite(img).all()),
           "std": float(img.std()), "control_effect": float(np.abs(img - plain).max()),
           "same_controlnet": all(torch.equal(a, b) for a, b in zip(pipe.controlnet.state_dict().values(),
                                                                     alone.state_dict().values())),
           "unet_as_source": all(torch.equal(exported[k], source[k].float()) for k in source)}
    print("RESULT" + json.dumps(out))
    """
)


def test_export_loads_with_diffusers_alone_in_a_fresh_process(ranks):
    r = ranks[0][0]
    paths = {"pipeline": r["export"]["pipeline"], "controlnet": r["export"]["controlnet"], "model": r["model_path"]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no project code on the path
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["class"] == "StableDiffusionControlNetPipeline"
    assert out["shape"] == [1, 32, 32, 3] and out["finite"] and out["std"] > 0
    assert out["control_effect"] > 0  # the conditioning image reaches the generation
    assert out["same_controlnet"] and out["unet_as_source"]

"""sd_finetune on 2 real ranks (DeepSpeed CPU accelerator, gloo, no mocks): sharding of every role,
equivalence with the seed baseline, resume, EMA, LoRA, two text encoders, and exports that load with
diffusers alone in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_keys_read, launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("sd_finetune", tmp_path_factory.mktemp("sd_finetune"), timeout=600)


def keys_under(recipe: str, *prefixes: str) -> tuple[str, ...]:
    from multiengine.recipes.language.config import leaves, load_recipe, recipe_schema

    return tuple(k for k in leaves(recipe_schema(load_recipe(recipe))) if k.startswith(prefixes))


# What a run's options leave unused, by reason: the roles a tiny SD builds none of (SDXL: has text_encoder_2), the
# LoRA options without LoRA (lora.r 0), the EMA role without an EMA, the built-in data's size beside data.source and
# the image check of generated data, validation.num_prompts beside validation.prompts
NOT_SD = keys_under("sd_finetune", "roles.transformer.", "roles.text_encoder_3.")
NO_LORA = ("roles.unet.lora.alpha", "roles.unet.lora.dropout", "roles.unet.lora.target_modules")
NO_EMA = ("roles.ema.dtype", "roles.ema.offload_params")
UNREAD = {
    "zero3": (*NOT_SD, "roles.text_encoder_2.", *NO_LORA, "data.check_images", "validation.num_prompts"),
    "resume": (*NOT_SD, "roles.text_encoder_2.", *NO_LORA, "data.builtin_size", "validation.num_prompts"),
    "seed": (*NOT_SD, "roles.text_encoder_2.", *NO_LORA, "data.builtin_size", "validation.num_prompts"),
    "lora": (*NOT_SD, "roles.text_encoder_2.", *NO_EMA, "data.builtin_size"),
    "sdxl": (*NOT_SD, *NO_LORA, *NO_EMA, "data.builtin_size", "validation.num_prompts"),
    "sdxl_seed": (*NOT_SD, *NO_LORA, *NO_EMA, "data.builtin_size"),
}


@pytest.mark.parametrize("run", sorted(UNREAD))
def test_every_key_is_read_by_the_runs(ranks, run):
    root = ranks[0]["paths"]["root"]
    unread = UNREAD[run]
    assert_keys_read(os.path.join(root, run), "sd_finetune",
                     unread=(*unread, *keys_under("sd_finetune", *(u for u in unread if u.endswith(".")))))


def test_every_role_is_sharded_in_zero3_mode(ranks):
    for r in ranks:
        mem = r["zero3"]["memory"]
        assert set(mem) == {"unet", "vae", "text_encoder", "ema"}
        for role in ("unet", "vae", "text_encoder", "ema"):
            row = mem[role]
            assert row["stage"] == 3, role
            # This rank's partition is half of the model (DeepSpeed pads each tensor to a multiple of 2) ...
            assert 0.49 < row["local_fraction"] < 0.51, (role, row)
            # ... and with the small always-gathered (persistent) tensors it still holds well under all of it.
            assert row["param_bytes"] < 0.7 * row["params_total"] * 4, (role, row)
        assert mem["unet"]["optimizer_bytes"] > 0 and mem["vae"]["optimizer_bytes"] == 0
        # The same ranks in seed_baseline: the unet sharded, the vae and text encoder whole on every rank.
        seed = r["seed"]["memory"]
        assert seed["unet"]["stage"] == 3 and 0.49 < seed["unet"]["local_fraction"] < 0.51
        for role in ("vae", "text_encoder", "ema"):
            assert seed[role]["stage"] == 0 and seed[role]["local_fraction"] == 1.0, role


def test_it_learns_and_writes_grids(ranks):
    z = ranks[0]["zero3"]
    assert z["heldout"]["after/loss"] < 0.9 * z["heldout"]["before/loss"], z["heldout"]
    assert ranks[0]["zero3"]["heldout"] == ranks[1]["zero3"]["heldout"]  # averaged over ranks
    assert len(z["validations"]) == 2 and all(p.endswith(".png") for p in z["validations"])
    from PIL import Image

    with Image.open(z["validations"][0]) as grid:
        # two 32 px images side by side, each upscaled 8x to a viewable 256 px, a caption strip under each
        width, height = grid.size
        assert width == 512 and 256 < height <= 256 + 80, grid.size
        strip = grid.convert("RGB").crop((0, 257, 512, height))
        colours = strip.getcolors(maxcolors=1 << 16)
        assert max(colours)[1] == (255, 255, 255)  # mostly white paper ...
        assert sum(n for n, c in colours if max(c) < 64) > 100  # ... with dark (anti-aliased) caption text on it
        size = grid.size
    # The same grids in TensorBoard, beside the scalars: one image tag, one event per validation (before, after).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = os.path.join(ranks[0]["paths"]["root"], "zero3", "tensorboard")
    events = EventAccumulator(folder, size_guidance={"images": 0})
    events.Reload()
    assert "validation/grid" in events.Tags()["images"] and "train/loss" in events.Tags()["scalars"]
    images = events.Images("validation/grid")
    assert [e.step for e in images] == [0, 4]
    assert all((e.width, e.height) == size for e in images)


def test_losses_match_seed_baseline(ranks):
    for r in ranks:
        assert len(r["zero3"]["losses"]) == 4
        assert r["seed"]["losses"] == pytest.approx(r["zero3"]["losses"], rel=1e-5, abs=1e-6)
        assert r["seed"]["heldout"] == pytest.approx(r["zero3"]["heldout"], rel=1e-5)


def test_resume_continues_identically(ranks):
    for r in ranks:
        full, resumed = r["zero3"]["losses"], r["resume"]["losses"]
        assert resumed[:2] == full[:2]  # restored from the checkpoint's client state
        assert resumed[2:] == pytest.approx(full[2:], rel=1e-6, abs=1e-7)
        assert r["resume"]["lr"] == r["zero3"]["lr"]
        assert r["resume"]["sampler"] == r["zero3"]["sampler"]
        assert r["resume"]["heldout"]["after/loss"] == pytest.approx(r["zero3"]["heldout"]["after/loss"], rel=1e-6)


def test_resumed_weights_equal_uninterrupted(ranks):
    from safetensors.torch import load_file

    a = load_file(ranks[0]["zero3"]["export"]["unet"] + "/diffusion_pytorch_model.safetensors")
    b = load_file(ranks[0]["resume"]["export"]["unet"] + "/diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_ema_is_sharded_updated_and_exported(ranks):
    from safetensors.torch import load_file

    r = ranks[0]["zero3"]
    assert r["ema_vs_unet"] > 1e-4
    assert r["ema_local_numel"] == r["memory"]["unet"]["params_local"]  # a shard, not a full copy
    # Parameters DeepSpeed keeps gathered between forwards carry the updated EMA values.
    assert r["ema_persistent_held"] > 0 and r["ema_persistent_error"] == 0.0
    name = "diffusion_pytorch_model.safetensors"
    unet, ema = load_file(f"{r['export']['unet']}/{name}"), load_file(f"{r['export']['ema']}/{name}")
    piped = load_file(f"{r['export']['pipeline']}/unet/{name}")
    assert max((unet[k] - ema[k]).abs().max().item() for k in unet) > 1e-4
    assert all((piped[k] == ema[k]).all() for k in ema)  # the pipeline ships the EMA weights
    assert all(t.numel() > 0 for t in piped.values())  # full tensors, never empty shards


def test_lora_trains_only_the_adapter(ranks):
    for r in ranks:
        lora = r["lora"]
        assert lora["trainable_all_lora"] and lora["n_lora"] > 0
        assert lora["base_change"] == 0.0
        assert lora["lora_change"] > 1e-4
        assert 0.49 < lora["memory"]["unet"]["local_fraction"] < 0.51  # adapters are sharded too


def test_two_text_encoders(ranks):
    for r in ranks:
        sdxl = r["sdxl"]
        assert sdxl["stages"] == {"unet": 3, "vae": 3, "text_encoder": 3, "text_encoder_2": 3}
        assert 0.49 < sdxl["memory"]["text_encoder_2"]["local_fraction"] < 0.51
        assert len(sdxl["losses"]) == 2 and all(0 < x < 10 for x in sdxl["losses"])
        assert len(sdxl["validations"]) == 2


def test_tiny_vae_pretrain_runs_on_both_ranks_in_lockstep(ranks):
    pre = [r["sdxl"]["vae_pretrain"] for r in ranks]
    assert pre[0] == pre[1]
    assert pre[0]["world_size"] == 2 and pre[0]["steps"] == 4 and pre[0]["resolution"] == 32
    digests = pre[0]["rank_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]  # both ranks end with the same weights
    with open(os.path.join(ranks[0]["paths"]["root"], "sdxl", "tiny_sdxl", "vae", "pretrained.json")) as f:
        assert json.load(f) == pre[0]  # what rank 0 saved
    assert all(r["sdxl_seed"]["vae_pretrain"] is None for r in ranks)  # model.pretrained brings its vae


def test_sdxl_losses_match_seed_baseline(ranks):
    for r in ranks:
        seed = r["sdxl_seed"]
        assert seed["stages"] == {"unet": 3, "vae": 0, "text_encoder": 0, "text_encoder_2": 0}
        assert seed["memory"]["text_encoder_2"]["local_fraction"] == 1.0  # whole on every rank
        assert seed["losses"] == pytest.approx(r["sdxl"]["losses"], rel=1e-5, abs=1e-6)
        assert seed["heldout"] == pytest.approx(r["sdxl"]["heldout"], rel=1e-5)


FRESH = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    paths = json.loads(sys.argv[1])
    out = {}
    def run(pipe, seed=0):
        g = torch.Generator().manual_seed(seed)
        return pipe("a red square on a white background", num_inference_steps=2, height=32, width=32,
                    generator=g, output_type="np").images

    pipe = StableDiffusionPipeline.from_pretrained(paths["pipeline"])
    img = run(pipe)
    out["sd"] = {"shape": list(img.shape), "finite": bool(np.isfinite(img).all()), "std": float(img.std()),
                 "dtype": str(pipe.unet.dtype)}

    base = StableDiffusionPipeline.from_pretrained(paths["base"])
    plain = run(base)
    base.load_lora_weights(paths["lora"])
    adapted = run(base)
    out["lora"] = {"adapters": base.get_active_adapters(), "diff": float(np.abs(adapted - plain).max())}

    xl = DiffusionPipeline.from_pretrained(paths["sdxl"])
    img = run(xl)
    out["sdxl"] = {"class": type(xl).__name__, "shape": list(img.shape), "finite": bool(np.isfinite(img).all())}
    print("RESULT" + json.dumps(out))
    """
)


def test_exports_load_with_diffusers_alone_in_a_fresh_process(ranks):
    r = ranks[0]
    paths = {"pipeline": r["zero3"]["export"]["pipeline"], "base": r["paths"]["model"],
             "lora": r["lora"]["export"]["lora"], "sdxl": r["sdxl"]["export"]["pipeline"]}
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["sd"]["shape"] == [1, 32, 32, 3] and out["sd"]["finite"] and out["sd"]["std"] > 0
    assert out["sd"]["dtype"] == "torch.float32"
    assert out["lora"]["adapters"] and out["lora"]["diff"] > 0
    assert out["sdxl"]["class"] == "StableDiffusionXLPipeline" and out["sdxl"]["shape"] == [1, 32, 32, 3]
    assert out["sdxl"]["finite"]

"""The tiny vae pre-train of sd_finetune / controlnet: it trains at data.resolution whatever the images' size,
is skipped when the model folder brings its own vae, and keeps a finished pre-train on a rerun."""

from __future__ import annotations

import os
import types

import pytest
import torch
from multiengine.pipelines.diffusion.tiny import build_tiny_sd, pretrain_tiny_vae, vae_pretrain_images
from PIL import Image


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return build_tiny_sd(str(tmp_path_factory.mktemp("tiny_vae") / "sd"), resolution=16)


def _photos(folder, sizes):
    os.makedirs(folder, exist_ok=True)
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (40 * i, 200 - 30 * i, 90)).save(os.path.join(folder, f"{i:02d}.png"))
    return str(folder)


def test_images_are_resized_and_cropped_to_the_resolution(tmp_path):
    images = [Image.new("RGB", (40, 24), (255, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 255))]
    pixels = vae_pretrain_images(images, 16)
    assert pixels.shape == (2, 3, 16, 16) and pixels.dtype == torch.float32
    assert pixels[0, 0].eq(1.0).all() and pixels[0, 2].eq(-1.0).all()  # red in [-1, 1]
    folder = _photos(tmp_path / "photos", [(48, 32), (32, 48), (64, 64)])
    assert vae_pretrain_images(folder, 8).shape == (3, 3, 8, 8)
    with pytest.raises(ValueError, match="no .png"):
        vae_pretrain_images(str(tmp_path), 8)


def test_pretrain_trains_at_the_given_resolution(tiny_sd, tmp_path, monkeypatch):
    from diffusers import AutoencoderKL

    images = _photos(tmp_path / "big", [(64, 48), (48, 64), (64, 64), (80, 64)])  # larger than 16 px, not square
    seen = []
    encode = AutoencoderKL.encode

    def spy(self, x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return encode(self, x, *args, **kwargs)

    monkeypatch.setattr(AutoencoderKL, "encode", spy)
    result = pretrain_tiny_vae(tiny_sd, images, steps=2, batch_size=4, resolution=16, progress=False)
    assert seen[:2] == [(4, 3, 16, 16)] * 2  # the two training batches
    assert {s[1:] for s in seen} == {(3, 16, 16)}  # and the latent statistics after them
    assert result["resolution"] == 16 and result["images"] == 4 and result["world_size"] == 1
    assert len(result["rank_digests"]) == 1
    seen.clear()
    assert pretrain_tiny_vae(tiny_sd, images, steps=2, batch_size=4, resolution=16, progress=False) == result
    assert seen == []  # kept: same steps, seed, resolution and images
    again = pretrain_tiny_vae(tiny_sd, images, steps=2, batch_size=4, resolution=8, progress=False)
    assert again["resolution"] == 8 and seen and {s[1:] for s in seen} == {(3, 8, 8)}


def _job(tmp_path, *overrides):
    from multiengine.recipes.language.config import load_config

    cfg = load_config("sd_finetune", "tiny", [f"output_dir={tmp_path}", *overrides])
    return cfg, types.SimpleNamespace(is_main=True, rank=0, world_size=1, device=torch.device("cpu"))


def test_recipe_pretrains_at_data_resolution_on_the_training_images(tmp_path, monkeypatch):
    from multiengine.pipelines.diffusion import runs

    calls = []
    monkeypatch.setattr(runs, "build_tiny_model", lambda *a, **k: None)
    monkeypatch.setattr(runs, "pretrain_tiny_vae", lambda path, images, steps, **kw: calls.append(
        (path, [images[i].size for i in range(len(images))], steps, kw)) or {"steps": steps})
    cfg, registry = _job(tmp_path, "data.resolution=16", "data.builtin_size=10", "eval.heldout_size=2",
                         "model.tiny_vae_steps=7")
    source = runs.image_source(cfg, registry, str(tmp_path / "data" / "shapes"))
    rows = cfg.data.load(source, cfg.eval.heldout_size, cfg.seed)
    path, vae_pretrain = runs.image_model(cfg, registry, rows, str(tmp_path / "tiny_sd"))
    (where, sizes, steps, kw), = calls
    assert where == path == str(tmp_path / "tiny_sd") and steps == 7
    assert kw["resolution"] == 16 and kw["seed"] == cfg.seed
    train = rows.train  # the same rows the fine-tune trains on: the held-out rows are not among them
    assert len(sizes) == len(train) < 10 and set(sizes) == {(16, 16)}
    assert vae_pretrain == {"steps": 7}


def test_recipe_skips_the_pretrain_when_the_model_brings_a_vae(tiny_sd, tmp_path, monkeypatch):
    from multiengine.pipelines.diffusion import runs
    from multiengine.recipes.language.config import RecipeConfigError

    def fail(*args, **kwargs):
        raise AssertionError("pretrain_tiny_vae called for a model with its own vae")

    monkeypatch.setattr(runs, "pretrain_tiny_vae", fail)
    cfg, registry = _job(tmp_path, f"model.pretrained={tiny_sd}")
    assert runs.image_model(cfg, registry, None, str(tmp_path / "tiny_sd")) == (tiny_sd, None)
    # the tiny model's options are refused beside a model folder: they would be ignored
    with pytest.raises(RecipeConfigError, match="model.tiny_vae_steps.*applies only while model.pretrained is empty"):
        _job(tmp_path, f"model.pretrained={tiny_sd}", "model.tiny_vae_steps=7")

"""The tiny shapes task's rewards (pipelines/diffusion/rewards.py): the programmatic colour / shape reward on clean,
wrong, blank and blended images, its input formats and calling style, and the tiny CNN reward model trained on it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from multiengine.pipelines.diffusion.data import SHAPES_COLORS, _draw_shape, _shapes_rows
from multiengine.pipelines.diffusion.rewards import (
    COLOR_NAMES,
    as_image_array,
    color_reward,
    color_scores,
    load_tiny_reward_model,
    parse_shapes_prompt,
    reward_model_fn,
    reward_training_images,
    save_tiny_reward_model,
    shape_reward,
    shapes_reward,
    train_tiny_reward_model,
)
from PIL import Image


@pytest.fixture(scope="module")
def clean():
    rows = _shapes_rows(54, 32, seed=5)  # every colour x shape x background once
    return rows, [_draw_shape(r, 32) for r in rows], [r["text"] for r in rows]


def test_parse_prompt():
    assert parse_shapes_prompt("a red square on a white background") == {
        "color": "red", "shape": "square", "background": "white"}
    assert parse_shapes_prompt("A Purple triangle, please") == {"color": "purple", "shape": "triangle",
                                                               "background": None}
    assert parse_shapes_prompt("a cat") == {"color": None, "shape": None, "background": None}


def test_colour_reward_on_clean_wrong_blank_and_blended_images(clean):
    rows, images, prompts = clean
    own = color_reward(prompts, images)
    assert min(own) > 0.98  # the colour the prompt names, on any background
    wrong = [p.replace(r["color"], "blue" if r["color"] != "blue" else "red") for p, r in zip(prompts, rows)]
    assert max(color_reward(wrong, images)) < 0.01
    blank = [Image.new("RGB", (32, 32), bg) for bg in ((255, 255, 255), (0, 0, 0), (128, 128, 128))]
    assert max(color_reward(["a red circle on a white background"] * 3, blank)) < 0.01
    # a red shape faded towards its white background: the reward falls continuously (half-faded red is pink,
    # nearer orange than red, and scores about 0)
    red = next(im for r, im in zip(rows, images) if r["color"] == "red" and r["background"] == "white")
    arr = torch.from_numpy(np.asarray(red, dtype=np.float32) / 255).permute(2, 0, 1)
    faded = torch.stack([a * arr + (1 - a) * torch.ones_like(arr) for a in (1.0, 0.8, 0.7, 0.5, 0.0)])
    r = color_reward(["a red square"] * 5, faded)
    assert r[0] > 0.98 and r[-1] < 0.01 and all(x >= y - 1e-6 for x, y in zip(r, r[1:]))
    assert 0.02 < r[2] < 0.98  # partial credit in between


def test_shape_and_combined_reward(clean):
    rows, images, prompts = clean
    assert np.mean(shape_reward(prompts, images)) > 0.9
    other = {"square": "circle", "circle": "triangle", "triangle": "square"}
    swapped = [p.replace(r["shape"], other[r["shape"]]) for p, r in zip(prompts, rows)]
    assert np.mean(shape_reward(swapped, images)) < 0.1
    both = shapes_reward(swapped, images, shape_weight=0.5)
    colour = color_reward(swapped, images)
    shape = shape_reward(swapped, images)
    assert both == pytest.approx([0.5 * c + 0.5 * s for c, s in zip(colour, shape)])
    assert shapes_reward(["a cat", "a red thing", "a circle"], images[:3]) == [
        None, color_reward(["a red thing"], images[1:2])[0], shape_reward(["a circle"], images[2:3])[0]]


def test_reward_inputs_and_calling_style(clean):
    _, images, prompts = clean
    pil = color_reward(prompts=prompts[:6], images=images[:6], seed=[0] * 6)  # extra columns are ignored
    u8 = np.stack([np.asarray(im) for im in images[:6]])
    assert color_reward(prompts[:6], u8) == pytest.approx(pil, abs=1e-6)
    pt = torch.from_numpy(u8).permute(0, 3, 1, 2).float() / 255
    assert color_reward(prompts[:6], pt) == pytest.approx(pil, abs=1e-6)
    assert color_reward(["a cat"], images[:1]) == [None]
    scores = color_scores(images)
    assert scores.shape == (54, len(COLOR_NAMES)) and scores.min() >= 0 and scores.max() <= 1
    with pytest.raises(ValueError, match=r"\(x / 2 \+ 0.5\)"):
        as_image_array(pt * 2 - 1)
    with pytest.raises(ValueError, match="prompts"):
        color_reward(prompts[:2], images[:3])


def test_tiny_reward_model_tracks_the_programmatic_reward_on_held_out_images(clean, tmp_path):
    model = train_tiny_reward_model(n_images=512, steps=300, seed=0)
    held_out = reward_training_images(256, 32, seed=123)  # other shapes, blends and noise than in training
    target = color_scores(held_out)
    with torch.no_grad():
        scores = model.all_scores(held_out)
    assert np.corrcoef(target.flatten(), scores.flatten())[0, 1] > 0.8
    dominant = target.argmax(1)  # the prompt names the image's dominant colour: scores spread over [0, 1]
    rows = torch.arange(256)
    assert np.corrcoef(target[rows, dominant], scores[rows, dominant])[0, 1] > 0.3
    # as a reward function on clean images: high for the named colour, low for another
    _, images, prompts = clean
    fn = reward_model_fn(model)
    right = np.array(fn(prompts=prompts, images=images))
    wrong = np.array(fn(prompts=[p.replace(c, "green" if c != "green" else "red") for p in prompts
                                 for c in [next(k for k in SHAPES_COLORS if k in p.split())]], images=images))
    assert right.mean() > 0.7 and wrong.mean() < 0.2 and (right > wrong).mean() > 0.9
    # saved and loaded: the same scores
    loaded = load_tiny_reward_model(save_tiny_reward_model(model, str(tmp_path / "rm")))
    assert reward_model_fn(loaded)(prompts[:8], images[:8]) == fn(prompts[:8], images[:8])
    with pytest.raises(FileNotFoundError, match="save_tiny_reward_model"):
        load_tiny_reward_model(str(tmp_path))

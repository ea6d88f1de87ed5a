"""SD validation grids: viewable cells (nearest-neighbour upscaling of tiny images) with prompt and step written
under each image, checked by reading the PNG back."""

from __future__ import annotations

import numpy as np
from multiengine.pipelines.diffusion.validation import image_grid
from PIL import Image


def test_grid_upscales_and_labels_each_image(tmp_path):
    rng = np.random.default_rng(0)
    tiles = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(3)]
    prompts = ["a red square on a white background", "a blue circle on a black background", "x"]
    path = tmp_path / "grid.png"
    image_grid(tiles, prompts=prompts, step=100).save(path)
    with Image.open(path) as im:
        grid = np.asarray(im.convert("RGB"))
    height, width, _ = grid.shape
    assert width == 2 * 256  # 2 columns of 32 px images upscaled 8x
    cell = height // 2
    strip = cell - 256
    assert strip >= 12 and height == 2 * cell
    # the image area is the tile, each pixel an 8x8 block (nearest neighbour)
    assert np.array_equal(grid[:256:8, :256:8], np.asarray(tiles[0]))
    assert np.array_equal(grid[cell:cell + 256, :256], np.asarray(tiles[2].resize((256, 256), Image.NEAREST)))
    # text in every label strip, dark on white; the empty fourth cell has none
    for r, c in ((0, 0), (0, 1), (1, 0)):
        label = grid[r * cell + 256:(r + 1) * cell, c * 256:(c + 1) * 256]
        assert (label.min(axis=-1) < 100).sum() > 20, (r, c)
    assert grid[cell + 256:, 256:].min() == 255
    # a longer prompt wraps onto more lines than fit in one: the strip grows, text stays within its cell
    long = image_grid(tiles[:1], prompts=[" ".join(["word"] * 80)], step=1)
    assert long.size[1] - 256 > strip


def test_big_images_are_not_rescaled():
    grid = image_grid([Image.new("RGB", (300, 300), (10, 20, 30))] * 2)
    assert grid.size == (600, 300)  # no labels asked for: no strip

"""Rewards on decoded images for the tiny shapes task: a programmatic colour reward and a tiny CNN trained to
imitate it. ``fn(prompts, images, **kwargs) -> list[float | None]`` with images as PIL, ``[N, 3, H, W]`` in
``[0, 1]`` or ``[N, H, W, 3]``; ``None`` where the prompt names no colour. The colour score is ``share * presence``
of a soft assignment of pixels to the palette (docs/diffusion-rl.md)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from .data import SHAPES_BACKGROUNDS, SHAPES_COLORS, SHAPES_KINDS, _draw_shape, _shapes_rows, describe_shapes_image

logger = logging.getLogger(__name__)

__all__ = [
    "COLOR_NAMES",
    "TinyShapesRewardModel",
    "as_image_array",
    "color_reward",
    "color_scores",
    "load_tiny_reward_model",
    "parse_shapes_prompt",
    "reward_model_fn",
    "reward_training_images",
    "save_tiny_reward_model",
    "shape_reward",
    "shapes_reward",
    "train_tiny_reward_model",
]

COLOR_NAMES: tuple[str, ...] = tuple(SHAPES_COLORS)
# The shape colours first, then the backgrounds: pixels near a background colour count as background.
_PALETTE = torch.tensor([*SHAPES_COLORS.values(), *SHAPES_BACKGROUNDS.values()], dtype=torch.float32) / 255.0


def parse_shapes_prompt(prompt: str) -> dict[str, str | None]:
    """The ``color``, ``shape`` and ``background`` a prompt names (``None`` for each it does not): the first word
    that is a shape colour, a shape kind, and the background word before ``background``."""
    words = re.findall(r"[a-z]+", prompt.lower())
    color = next((w for w in words if w in SHAPES_COLORS), None)
    shape = next((w for w in words if w in SHAPES_KINDS), None)
    background = next((a for a, b in zip(words, words[1:]) if b == "background" and a in SHAPES_BACKGROUNDS), None)
    return {"color": color, "shape": shape, "background": background}


def as_image_array(images: Any) -> torch.Tensor:
    """``images`` as float32 ``[N, H, W, 3]`` in ``[0, 1]``; ValueError for pixels outside ``[0, 1]`` or a bad
    shape."""
    if isinstance(images, torch.Tensor):
        x = images.detach().float().cpu()
        if x.ndim != 4 or x.shape[1] != 3:
            raise ValueError(f"image tensors must be [N, 3, H, W], got {tuple(x.shape)}")
        x = x.permute(0, 2, 3, 1)
    elif isinstance(images, np.ndarray):
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"image arrays must be [N, H, W, 3], got {images.shape}")
        x = torch.from_numpy(images.astype(np.float32) / 255.0 if images.dtype == np.uint8 else
                             images.astype(np.float32))
    else:
        x = torch.stack([torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0) for im in images])
    if x.numel() and (x.min() < -1e-3 or x.max() > 1 + 1e-3):
        raise ValueError(f"image values must lie in [0, 1], got [{x.min():.3f}, {x.max():.3f}]; rescale a vae "
                         "decode in [-1, 1] with (x / 2 + 0.5).clamp(0, 1).")
    return x.clamp(0, 1)


def color_scores(images: Any, temperature: float = 0.1, min_fraction: float = 0.05) -> torch.Tensor:
    """``[N, 6]`` ``share * presence`` scores per :data:`COLOR_NAMES`: ``temperature`` the soft assignment's tau
    (orange and yellow are 0.31 apart), ``min_fraction`` the cover counted as fully present (shapes cover 8-49 %)."""
    if not temperature > 0 or not 0 < min_fraction <= 1:
        raise ValueError(f"temperature={temperature} must be > 0 and min_fraction={min_fraction} in (0, 1]")
    x = as_image_array(images)
    pixels = x.reshape(x.shape[0], -1, 1, 3)
    d2 = ((pixels - _PALETTE) ** 2).sum(-1)  # [N, P, 9]
    mass = torch.softmax(-d2 / (2 * temperature**2), dim=-1).mean(dim=1)[:, : len(COLOR_NAMES)]  # [N, 6]
    share = mass / mass.sum(dim=1, keepdim=True).clamp_min(1e-8)
    presence = (mass / min_fraction).clamp(max=1.0)
    return share * presence


def _per_prompt(prompts: Sequence[str], n: int) -> list[dict[str, str | None]]:
    if len(prompts) != n:
        raise ValueError(f"{len(prompts)} prompts for {n} images")
    return [parse_shapes_prompt(p) for p in prompts]


def color_reward(prompts: Sequence[str], images: Any, **kwargs: Any) -> list[float | None]:
    """How well each image's dominant colour matches the colour its prompt names (:func:`color_scores`), in
    ``[0, 1]``; ``None`` for a prompt that names no shapes colour. Other keyword arguments (columns) are ignored."""
    scores = color_scores(images)
    named = _per_prompt(prompts, scores.shape[0])
    return [None if p["color"] is None else float(scores[i, COLOR_NAMES.index(p["color"])])
            for i, p in enumerate(named)]


def shape_reward(prompts: Sequence[str], images: Any, **kwargs: Any) -> list[float | None]:
    """1.0 where the shape read back from the image (:func:`describe_shapes_image`) is the one the prompt names,
    else 0.0; ``None`` for a prompt that names no shape."""
    from PIL import Image

    x = as_image_array(images)
    named = _per_prompt(prompts, x.shape[0])
    out: list[float | None] = []
    for i, p in enumerate(named):
        if p["shape"] is None:
            out.append(None)
            continue
        image = Image.fromarray((x[i].numpy() * 255).round().astype(np.uint8))
        out.append(float(describe_shapes_image(image)["shape"] == p["shape"]))
    return out


def shapes_reward(prompts: Sequence[str], images: Any, shape_weight: float = 0.5, **kwargs: Any
                  ) -> list[float | None]:
    """``(1 - shape_weight) * colour + shape_weight * shape`` (:func:`color_reward`, :func:`shape_reward`) in
    ``[0, 1]``; a prompt missing one of the two is scored on the other alone, ``None`` if it names neither."""
    if not 0 <= shape_weight <= 1:
        raise ValueError(f"shape_weight={shape_weight} must be in [0, 1]")
    colors = color_reward(prompts, images)
    shapes = shape_reward(prompts, images) if shape_weight > 0 else [None] * len(colors)
    out: list[float | None] = []
    for c, s in zip(colors, shapes):
        if c is None or s is None:
            out.append(c if s is None else s)
        else:
            out.append((1 - shape_weight) * c + shape_weight * s)
    return out


# --- the tiny reward model -------------------------------------------------------------------------------
class TinyShapesRewardModel(nn.Module):
    """A small CNN: ``forward(pixel_values [N, 3, H, W] in [0, 1], color_ids [N]) -> [N]`` in ``(0, 1)``, the
    score for each prompt's colour."""

    def __init__(self, channels: int = 16, num_colors: int = len(COLOR_NAMES)) -> None:
        super().__init__()
        self.config = {"channels": channels, "num_colors": num_colors}
        c = channels
        # Halving the resolution first keeps every colour's pixel fraction (what the score reads) at 1/4 the cost.
        self.features = nn.Sequential(
            nn.AvgPool2d(2), nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * c, num_colors)

    def all_scores(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, num_colors]`` scores in ``(0, 1)``."""
        return torch.sigmoid(self.head(self.features(pixel_values)))

    def forward(self, pixel_values: torch.Tensor, color_ids: torch.Tensor) -> torch.Tensor:
        return self.all_scores(pixel_values).gather(1, color_ids.long().reshape(-1, 1)).squeeze(1)


def reward_training_images(n: int, resolution: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` shapes images in ``[0, 1]``, most perturbed (blends, noise) so their colour scores spread over
    ``[0, 1]``; deterministic in ``seed``."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    rows = _shapes_rows(2 * n, resolution, seed)
    pics = torch.stack([torch.from_numpy(np.asarray(_draw_shape(r, resolution), dtype=np.float32) / 255.0)
                        for r in rows]).permute(0, 3, 1, 2)
    g = torch.Generator().manual_seed(seed)
    a, b = pics[:n], pics[n:]
    kind = torch.randint(0, 4, (n,), generator=g)  # 0 clean, 1 blended, 2 noisy, 3 blended and noisy
    alpha = torch.rand(n, 1, 1, 1, generator=g)
    blended = torch.where((kind % 2 == 1).view(-1, 1, 1, 1), alpha * a + (1 - alpha) * b, a)
    noise_std = torch.rand(n, 1, 1, 1, generator=g) * 0.3 * (kind >= 2).view(-1, 1, 1, 1)
    out = blended + noise_std * torch.randn(blended.shape, generator=g)
    pure = torch.rand(n, generator=g) < 0.05
    out[pure] = torch.rand((int(pure.sum()), *out.shape[1:]), generator=g)
    return out.clamp(0, 1)


def train_tiny_reward_model(n_images: int = 512, resolution: int = 32, steps: int = 300, batch_size: int = 64,
                            lr: float = 1e-2, seed: int = 0, channels: int = 16) -> TinyShapesRewardModel:
    """Fit a :class:`TinyShapesRewardModel` to :func:`color_scores` (BCE on all colours); deterministic in ``seed``,
    returned in eval mode."""
    images = reward_training_images(n_images, resolution, seed)
    targets = color_scores(images.permute(0, 2, 3, 1).numpy())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyShapesRewardModel(channels)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, n_images, (batch_size,), generator=g)
        logits = model.head(model.features(images[idx]))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, targets[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    logger.info("tiny reward model: final training loss %.4f after %d steps", loss.item(), steps)
    return model.eval()


def reward_model_fn(model: TinyShapesRewardModel):
    """``model`` as a reward function ``fn(prompts, images, **kwargs) -> list[float | None]`` (the colour each prompt
    names; ``None`` where it names none)."""

    @torch.no_grad()
    def fn(prompts: Sequence[str], images: Any, **kwargs: Any) -> list[float | None]:
        x = as_image_array(images)
        named = _per_prompt(prompts, x.shape[0])
        param = next(model.parameters())
        scores = model.all_scores(x.permute(0, 3, 1, 2).to(param.device, param.dtype)).float().cpu()
        return [None if p["color"] is None else float(scores[i, COLOR_NAMES.index(p["color"])])
                for i, p in enumerate(named)]

    return fn


def save_tiny_reward_model(model: TinyShapesRewardModel, out_dir: str) -> str:
    """``config.json`` and ``model.safetensors`` in ``out_dir`` (what :func:`load_tiny_reward_model` reads)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model.config, f)
    return out_dir


def load_tiny_reward_model(path: str) -> TinyShapesRewardModel:
    """The model :func:`save_tiny_reward_model` wrote at ``path`` (eval mode, float32, CPU)."""
    from safetensors.torch import load_file

    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a tiny reward model folder "
                                "(write one with save_tiny_reward_model).")
    with open(config_path, encoding="utf-8") as f:
        model = TinyShapesRewardModel(**json.load(f))
    model.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    return model.eval()

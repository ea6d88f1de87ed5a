"""ControlNet: conditioning images for the shapes data, the ControlNet built from the tiny unet, and the
objective's loss and gradients equal to a hand-written train_controlnet.py step on the same draws."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from multiengine.pipelines.diffusion.controlnet import (
    conditioning_embedding_channels,
    controlnet_factory,
    controlnet_from_unet,
)
from multiengine.pipelines.diffusion.data import (
    _shapes_rows,
    conditioning_pixels,
    make_shapes_dataset,
    shapes_conditioning_image,
    tokenize_captions,
)
from multiengine.pipelines.diffusion.tiny import build_tiny_sd
from PIL import Image


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory) -> str:
    return build_tiny_sd(str(tmp_path_factory.mktemp("cn") / "sd"), seed=0, resolution=32)


# --- conditioning images ----------------------------------------------------------------------------
def test_conditioning_images_follow_the_shape(tmp_path):
    rows = _shapes_rows(12, 32, seed=0)
    for row in rows:
        mask = np.asarray(shapes_conditioning_image(row, 32, "mask"))[..., 0] > 0
        edge = np.asarray(shapes_conditioning_image(row, 32, "edge"))[..., 0] > 0
        left, top, size = row["_box"]
        ys, xs = np.nonzero(mask)
        # the mask spans exactly the shape's box; the edge lies on the mask and is much thinner
        assert (ys.min(), xs.min()) == (top, left) and ys.max() == top + size - 1
        assert edge.sum() > 0 and not (edge & ~mask).any() and edge.sum() < mask.sum()
        if row["shape"] == "square":  # a filled square is its box; its outline 4 (size - 1) pixels
            assert mask.sum() == size * size and edge.sum() == 4 * (size - 1)
    assert np.array_equal(np.asarray(shapes_conditioning_image(rows[0], 32)),
                          np.asarray(shapes_conditioning_image(rows[0], 32)))
    with pytest.raises(ValueError, match="kind='depth'"):
        shapes_conditioning_image(rows[0], 32, "depth")


def test_controlnet_dataset_loads_with_datasets(tmp_path):
    import datasets

    out = make_shapes_dataset(str(tmp_path / "cn"), 9, 32, seed=0, conditioning="mask")
    plain = make_shapes_dataset(str(tmp_path / "plain"), 9, 32, seed=0)
    ds = datasets.load_dataset("imagefolder", data_dir=out, split="train")
    assert len(ds) == 9 and {"image", "conditioning_image", "text"} <= set(ds.column_names)
    for i in range(9):
        with Image.open(os.path.join(plain, f"{i:05d}.png")) as im:
            assert np.array_equal(np.asarray(ds[i]["image"]), np.asarray(im))  # the same images as the plain set
    cond = conditioning_pixels(ds[0]["conditioning_image"], 32)
    assert cond.shape == (3, 32, 32) and cond.min() == 0.0 and cond.max() == 1.0
    stamp = os.stat(os.path.join(out, "metadata.jsonl")).st_mtime_ns
    assert make_shapes_dataset(out, 9, 32, seed=0, conditioning="mask") == out
    assert os.stat(os.path.join(out, "metadata.jsonl")).st_mtime_ns == stamp  # idempotent


# --- the ControlNet ---------------------------------------------------------------------------------
def test_controlnet_from_the_tiny_unet(sd_dir):
    from diffusers import UNet2DConditionModel

    assert conditioning_embedding_channels(8) == (16, 32, 96, 256) and conditioning_embedding_channels(2) == (16, 32)
    with pytest.raises(ValueError, match="power of two"):
        conditioning_embedding_channels(6)
    unet = UNet2DConditionModel.from_pretrained(sd_dir, subfolder="unet")
    state = torch.random.get_rng_state()
    a = controlnet_from_unet(unet, 2, seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    b = controlnet_factory(sd_dir, seed=1)()
    c = controlnet_from_unet(unet, 2, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.controlnet_cond_embedding.conv_in.weight, c.controlnet_cond_embedding.conv_in.weight)
    assert torch.equal(a.conv_in.weight, unet.conv_in.weight)  # the encoder starts as the unet's
    assert all((z.weight == 0).all() for z in a.controlnet_down_blocks) and (a.controlnet_mid_block.weight == 0).all()
    # untrained, it changes nothing: the unet with its residuals predicts what the unet alone predicts
    x, t = torch.randn(2, 4, 16, 16), torch.tensor([10, 500])
    hidden = torch.randn(2, 77, 32)
    with torch.no_grad():
        down, mid = a(x, t, hidden, controlnet_cond=torch.rand(2, 3, 32, 32), return_dict=False)
        with_res = unet(x, t, hidden, down_block_additional_residuals=down, mid_block_additional_residual=mid).sample
        torch.testing.assert_close(with_res, unet(x, t, hidden).sample)


# --- the objective -----------------------------------------------------------------------------------
def _registry(sd_dir, seed):
    from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
    from multiengine.pipelines.diffusion.models import load_component

    registry = EngineRegistry(backend="torch")
    registry.add(RoleSpec("controlnet", controlnet_factory(sd_dir, seed=seed),
                          train_ds_config(stage=0, dtype="fp32", micro_batch_size=2),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0)))
    for name in ("unet", "vae", "text_encoder"):
        registry.add(RoleSpec(name, lambda name=name: load_component(sd_dir, name), eval_ds_config(dtype="fp32")))
    return registry.build()


def _batch(tokenizer):
    rows = _shapes_rows(2, 32, seed=3)
    from multiengine.pipelines.diffusion.data import ImageTransform, _draw_shape

    transform = ImageTransform(32)
    return {
        "pixel_values": torch.stack([transform(_draw_shape(r, 32)) for r in rows]),
        "conditioning_pixel_values": torch.stack([conditioning_pixels(shapes_conditioning_image(r, 32), 32)
                                                  for r in rows]),
        "input_ids": tokenize_captions(tokenizer, [r["text"] for r in rows]),
    }


def test_objective_equals_a_hand_written_train_controlnet_step(sd_dir):
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from multiengine.pipelines.diffusion.training import ControlNetObjective, heldout_loss, step_generator
    from transformers import CLIPTextModel, CLIPTokenizer

    registry = _registry(sd_dir, seed=4)
    scheduler = DDPMScheduler.from_pretrained(sd_dir, subfolder="scheduler")
    objective = ControlNetObjective(registry, ["text_encoder"], scheduler)
    tokenizer = CLIPTokenizer.from_pretrained(sd_dir, subfolder="tokenizer")
    batch = _batch(tokenizer)
    # An untrained ControlNet adds zeros: give its zero convolutions weights so that the test sees them.
    with torch.no_grad():
        for p in registry["controlnet"].module.parameters():
            if (p == 0).all():
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    ref_cn = controlnet_from_unet(UNet2DConditionModel.from_pretrained(sd_dir, subfolder="unet"), 2, seed=4)
    ref_cn.load_state_dict(registry["controlnet"].module.state_dict())

    out = objective.loss(batch, step_generator(0, 0, 0, 0))
    registry["controlnet"].backward(out.loss)
    grads = {n: p.grad.clone() for n, p in registry["controlnet"].module.named_parameters()}

    # diffusers' examples/controlnet/train_controlnet.py, written out on the same generator
    vae = AutoencoderKL.from_pretrained(sd_dir, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(sd_dir, subfolder="unet").requires_grad_(False)
    text_encoder = CLIPTextModel.from_pretrained(sd_dir, subfolder="text_encoder")
    g = step_generator(0, 0, 0, 0)
    with torch.no_grad():
        latents = vae.encode(batch["pixel_values"]).latent_dist.sample(generator=g) * vae.config.scaling_factor
        noise = torch.randn(latents.shape, generator=g)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (2,), generator=g).long()
        noisy_latents = scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
    down, mid = ref_cn(noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                       controlnet_cond=batch["conditioning_pixel_values"], return_dict=False)
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states=encoder_hidden_states,
                      down_block_additional_residuals=list(down), mid_block_additional_residual=mid,
                      return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(model_pred.float(), noise.float(), reduction="mean")
    loss.backward()

    assert torch.equal(out.timesteps, timesteps)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    ref_grads = dict(ref_cn.named_parameters())
    assert grads.keys() == ref_grads.keys()
    worst = max((grads[n] - ref_grads[n].grad).abs().max().item() for n in grads)
    assert worst < 1e-5 and max(g.abs().max().item() for g in grads.values()) > 1e-4
    # the frozen unet passes the gradient on but takes none, and its weights stay
    assert all(p.grad is None for p in registry.role("unet").module.parameters())
    before = {n: p.detach().clone() for n, p in registry.role("unet").module.named_parameters()}
    registry["controlnet"].step()
    assert all(torch.equal(before[n], p) for n, p in registry.role("unet").module.named_parameters())

    # the held-out loss runs the same objective with fixed timesteps and noise
    a = heldout_loss(objective, [batch], objective.heldout_points(2), seed=9)
    assert a == heldout_loss(objective, [batch], objective.heldout_points(2), seed=9) and 0 < a < 10


def test_objective_needs_conditioning_and_a_frozen_unet(sd_dir):
    from diffusers import DDPMScheduler
    from multiengine.pipelines.diffusion.training import ControlNetObjective, step_generator
    from transformers import CLIPTokenizer

    registry = _registry(sd_dir, seed=0)
    scheduler = DDPMScheduler.from_pretrained(sd_dir, subfolder="scheduler")
    objective = ControlNetObjective(registry, ["text_encoder"], scheduler)
    batch = _batch(CLIPTokenizer.from_pretrained(sd_dir, subfolder="tokenizer"))
    del batch["conditioning_pixel_values"]
    with pytest.raises(KeyError, match="conditioning_pixel_values"):
        objective.loss(batch, step_generator(0, 0, 0, 0))
    with pytest.raises(ValueError, match="'controlnet' is trainable"):
        ControlNetObjective(registry, ["text_encoder"], scheduler, unet_role="controlnet")

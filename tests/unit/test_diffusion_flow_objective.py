"""The flow-matching objective on a registry (one process, torch backend) against diffusers written out:
the pipelines' own encode_prompt, and the SD3 / FLUX training scripts' step on the same draws."""

from __future__ import annotations

import pytest
import torch
from multiengine.pipelines.diffusion.data import shapes_captions
from multiengine.pipelines.diffusion.families import family_roles
from multiengine.pipelines.diffusion.tiny import build_tiny

T5_LEN = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("flow")
    return {f: build_tiny(f, str(root / f), seed=0, resolution=32) for f in ("sd3", "flux")}


def _registry(path, family):
    from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
    from multiengine.pipelines.diffusion.models import load_component

    roles = family_roles(family)
    registry = EngineRegistry(backend="torch")
    registry.add(RoleSpec("transformer", lambda: load_component(path, "transformer"),
                          train_ds_config(stage=0, dtype="fp32", micro_batch_size=2),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    for name in roles.frozen:
        registry.add(RoleSpec(name, lambda name=name: load_component(path, name), eval_ds_config(dtype="fp32")))
    return registry.build()


def _batch(pipe, family, captions):
    from multiengine.pipelines.diffusion.training import prompt_input_ids

    tokenizers = [getattr(pipe, t) for t in family_roles(family).tokenizers]
    lengths = [None] * (len(tokenizers) - 1) + [T5_LEN]  # the T5 tokenizer last, at the pipeline's max_sequence_length
    pixels = torch.rand(len(captions), 3, 32, 32, generator=torch.Generator().manual_seed(11)) * 2 - 1
    return {"pixel_values": pixels, **prompt_input_ids(tokenizers, captions, lengths)}


def _script_sigmas(scheduler, timesteps):
    # get_sigmas() of diffusers' train_dreambooth_sd3.py / train_dreambooth_flux.py
    idx = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    return scheduler.sigmas[idx].flatten().reshape(-1, 1, 1, 1)


CASES = [("sd3", "logit_normal", True), ("sd3", "sigma_sqrt", False), ("sd3", "mode", False),
         ("flux", "none", False), ("flux", "cosmap", False), ("flux", "logit_normal", False)]


@pytest.mark.parametrize("family,scheme,precondition", CASES)
def test_loss_and_gradients_equal_the_training_script(folders, family, scheme, precondition):
    import diffusers
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
    from multiengine.pipelines.diffusion.training import DiffusionSettings, FlowMatchingObjective, step_generator

    path = folders[family]
    registry = _registry(path, family)
    pipe = getattr(diffusers, family_roles(family).pipeline).from_pretrained(path)
    captions = shapes_captions()[:2]
    batch = _batch(pipe, family, captions)
    settings = DiffusionSettings(weighting_scheme=scheme, logit_mean=0.2, logit_std=0.8,
                                 precondition_outputs=precondition)
    objective = FlowMatchingObjective(registry, family, pipe.scheduler.config, settings)
    out = objective.loss(batch, step_generator(0, 5, 1, 0))
    registry["transformer"].backward(out.loss)
    grads = {n: p.grad.clone() for n, p in registry["transformer"].module.named_parameters() if p.grad is not None}

    # --- the script, on the pipeline's own modules and encode_prompt -------------------------------
    sched, vae, transformer = pipe.scheduler, pipe.vae, pipe.transformer
    g = step_generator(0, 5, 1, 0)
    with torch.no_grad():
        if family == "sd3":
            prompt_embeds, _, pooled, _ = pipe.encode_prompt(captions, captions, captions,
                                                             do_classifier_free_guidance=False,
                                                             max_sequence_length=T5_LEN)
        else:
            prompt_embeds, pooled, text_ids = pipe.encode_prompt(captions, captions, max_sequence_length=T5_LEN)
        model_input = vae.encode(batch["pixel_values"]).latent_dist.sample(generator=g)
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
    noise = torch.randn(model_input.shape, generator=g)
    u = compute_density_for_timestep_sampling(scheme, 2, logit_mean=0.2, logit_std=0.8, mode_scale=1.29,
                                              generator=g)
    timesteps = sched.timesteps[(u * sched.config.num_train_timesteps).long()]
    sigmas = _script_sigmas(sched, timesteps)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    if family == "sd3":
        pred = transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                           pooled_projections=pooled, return_dict=False)[0]
    else:
        b, c, h, w = model_input.shape
        packed = diffusers.FluxPipeline._pack_latents(noisy, b, c, h, w)
        img_ids = diffusers.FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
        guidance = torch.tensor([3.5]).expand(b) if transformer.config.guidance_embeds else None
        pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                           pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=text_ids,
                           img_ids=img_ids, return_dict=False)[0]
        pred = diffusers.FluxPipeline._unpack_latents(pred, h * pipe.vae_scale_factor, w * pipe.vae_scale_factor,
                                                      pipe.vae_scale_factor)
    if precondition:
        pred = pred * (-sigmas) + noisy
    target = model_input if precondition else noise - model_input
    weighting = compute_loss_weighting_for_sd3(scheme, sigmas)
    loss = torch.mean((weighting.float() * (pred.float() - target.float()) ** 2).reshape(2, -1), 1).mean()
    loss.backward()

    assert torch.equal(out.timesteps, timesteps) and torch.equal(out.sigmas, sigmas.flatten())
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-5)
    theirs = {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}
    assert grads.keys() == theirs.keys() and len(grads) > 10
    scale = max(t.abs().max().item() for t in theirs.values())
    assert scale > 0 and max((grads[n] - theirs[n]).abs().max().item() for n in grads) < 1e-5 * max(1.0, scale)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_prompt_embeddings_equal_the_pipelines(folders, family):
    import diffusers
    from multiengine.pipelines.diffusion.training import FlowMatchingObjective

    path = folders[family]
    registry = _registry(path, family)
    pipe = getattr(diffusers, family_roles(family).pipeline).from_pretrained(path)
    captions = shapes_captions()[3:6]
    batch = _batch(pipe, family, captions)
    objective = FlowMatchingObjective(registry, family, pipe.scheduler.config)
    ids = [batch["input_ids"]] + [batch[f"input_ids_{i}"] for i in range(2, len(objective.text_encoders) + 1)]
    embeds, pooled = objective.encode_prompts(ids)
    with torch.no_grad():
        if family == "sd3":
            ref_embeds, _, ref_pooled, _ = pipe.encode_prompt(captions, None, None, do_classifier_free_guidance=False,
                                                              max_sequence_length=T5_LEN)
            assert embeds.shape == (3, 77 + T5_LEN, 64) and pooled.shape == (3, 64)
        else:
            ref_embeds, ref_pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=T5_LEN)
            assert embeds.shape == (3, T5_LEN, 64) and pooled.shape == (3, 32)
    torch.testing.assert_close(embeds, ref_embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-6)


def test_heldout_and_determinism(folders):
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from multiengine.pipelines.diffusion.training import (
        DiffusionSettings,
        FlowMatchingObjective,
        heldout_loss,
        step_generator,
    )

    path = folders["sd3"]
    registry = _registry(path, "sd3")
    config = FlowMatchEulerDiscreteScheduler.load_config(path, subfolder="scheduler")
    objective = FlowMatchingObjective(registry, "sd3", config)
    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    batch = _batch(pipe, "sd3", shapes_captions()[:2])
    a = objective.loss(batch, step_generator(1, 2, 0, 0)).loss.item()
    assert a == objective.loss(batch, step_generator(1, 2, 0, 0)).loss.item()
    assert a != objective.loss(batch, step_generator(1, 3, 0, 0)).loss.item()
    points = objective.heldout_points(4)
    assert points == [125, 375, 625, 875]
    fixed = objective.loss(batch, step_generator(0, 0, 0, 0), indices=torch.tensor([125, 125]))
    assert fixed.sigmas.tolist() == [objective.sigmas[125].item()] * 2
    h1 = heldout_loss(objective, [batch], points, seed=3)
    assert h1 == heldout_loss(objective, [batch], points, seed=3) and 0 < h1 < 100
    assert registry.role("transformer").module.training  # eval() only for the duration
    with pytest.raises(ValueError, match="DiffusionObjective"):
        FlowMatchingObjective(registry, "sdxl", config)
    with pytest.raises(ValueError, match="weighting_scheme='logitnormal'"):
        FlowMatchingObjective(registry, "sd3", config, DiffusionSettings(weighting_scheme="logitnormal"))
    with pytest.raises(ValueError, match="3 text encoders"):
        FlowMatchingObjective(registry, "sd3", config, text_encoders=["text_encoder"])

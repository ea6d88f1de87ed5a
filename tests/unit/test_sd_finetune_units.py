"""Single-process pieces of the diffusion fine-tune: configs, model-folder discovery, the step's
randomness, grids, the tiny vae pretraining. The distributed behaviour is in
tests/distributed/test_sd_finetune.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from multiengine.pipelines.diffusion.models import MODES, read_model_index, text_encoder_names, tokenizer_name
from multiengine.pipelines.diffusion.training import step_generator
from multiengine.pipelines.diffusion.validation import _cast_floating, image_grid
from multiengine.recipes.language.config import (
    ConfigKeyError,
    RecipeConfigError,
    list_recipes,
    load_config,
    validate_config,
)
from multiengine.recipes.sd_finetune import SDFinetune
from PIL import Image


@pytest.mark.parametrize("name", ["tiny", "sd15_full", "sd15_lora", "sdxl_full", "sd3_medium_full", "flux_dev_lora"])
def test_shipped_configs_load(name):
    assert name in list_recipes()["sd_finetune"]
    cfg = load_config("sd_finetune", name)
    assert cfg.mode in MODES
    if name.startswith("sd15"):
        assert cfg.data.resolution == 512 and cfg.roles.unet.dtype == "bf16"
        assert cfg.roles.unet.lr == (1e-4 if name == "sd15_lora" else 1e-5)
        assert (cfg.roles.unet.lora.r > 0) == (name == "sd15_lora") and cfg.ema.enabled == (name == "sd15_full")
    for role in ("unet", "vae", "text_encoder"):
        assert cfg.roles[role].stage == 3


# (config, family, denoiser, its text encoders) of the GPU configs of the larger families
LARGE_FAMILY_CONFIGS = [
    ("sdxl_full", "sdxl", "unet", ("text_encoder", "text_encoder_2")),
    ("sd3_medium_full", "sd3", "transformer", ("text_encoder", "text_encoder_2", "text_encoder_3")),
    ("flux_dev_lora", "flux", "transformer", ("text_encoder", "text_encoder_2")),
]


@pytest.mark.parametrize("name,family,denoiser,encoders", LARGE_FAMILY_CONFIGS)
def test_large_family_configs_match_their_model(name, family, denoiser, encoders):
    """The hub model's family (from the built-in architectures, no download) is the one the config is written
    for: its family options pass the recipe's own check, every role it has is ZeRO-3 bf16, the side fits."""
    from multiengine.engines.known_models import is_known, known_pipeline_info
    from multiengine.pipelines.diffusion.planning import pipeline_family

    cfg = load_config("sd_finetune", name)
    assert is_known(str(cfg.model.pretrained))
    parts = known_pipeline_info(str(cfg.model.pretrained))
    assert pipeline_family(parts) == family
    assert sorted(n for n in parts if n.startswith("text_encoder")) == sorted(encoders)
    SDFinetune.check_family(cfg, family)  # raises on an option of the other objective, a role it has not
    specs = {s.name: s for s in SDFinetune.role_specs(cfg, family, "/no/such/folder")}  # nothing is loaded
    assert sorted(specs) == sorted([denoiser, "vae", *encoders, *(["ema"] if cfg.ema.enabled else [])])
    for role in (denoiser, "vae", *encoders):  # text_encoder_2 follows text_encoder unless it says otherwise
        p = specs[role].placement
        assert p.stage == 3 and p.dtype == "bf16", role
    assert cfg.data.resolution == 1024 and cfg.roles[denoiser].gradient_checkpointing
    if family == "sdxl":
        assert cfg.ema.enabled and cfg.roles.ema.dtype == "fp32" and list(cfg.export.roles) == ["unet"]
        assert specs["ema"].placement.stage == 3 and specs["ema"].placement.dtype == "fp32"
        assert cfg.roles.unet.lr == 1e-6
    else:
        assert cfg.data.resolution % 16 == 0 and not cfg.ema.enabled
        # the T5 (SD3's third, FLUX's second encoder) is never gathered whole: a 4.7 B transient per call
        assert cfg.roles[encoders[-1]].gather_forward is False
        assert [cfg.roles[e].gather_forward for e in encoders[:-1]] == [True] * (len(encoders) - 1)
    if family == "sd3":
        assert (cfg.diffusion.weighting_scheme, cfg.diffusion.precondition_outputs,
                cfg.diffusion.max_sequence_length) == \
            ("logit_normal", True, 77)
    if family == "flux":
        assert (cfg.diffusion.weighting_scheme, cfg.diffusion.guidance_scale,
                cfg.diffusion.max_sequence_length) == \
            ("none", 3.5, 512)
        lora = cfg.roles.transformer.lora
        assert lora.r == 16 and list(lora.target_modules) == [] and cfg.roles.transformer.lr == 1e-4


def test_family_options_of_the_other_objective_are_refused_on_the_shipped_configs():
    def check(config, family, *overrides):
        SDFinetune.check_family(load_config("sd_finetune", config, list(overrides)), family)

    with pytest.raises(RecipeConfigError, match="diffusion.weighting_scheme"):
        check("sdxl_full", "sdxl", "diffusion.weighting_scheme=logit_normal")
    with pytest.raises(RecipeConfigError, match="diffusion.snr_gamma"):
        check("sd3_medium_full", "sd3", "diffusion.snr_gamma=5.0")
    # the flow options a family has no use for: FLUX's guidance input on SD3, the density of another scheme
    with pytest.raises(RecipeConfigError, match="diffusion.guidance_scale.*FLUX's guidance input"):
        check("sd3_medium_full", "sd3", "diffusion.guidance_scale=2.0")
    with pytest.raises(RecipeConfigError, match="diffusion.logit_std.*the scheme is none"):
        check("flux_dev_lora", "flux", "diffusion.logit_std=2.0")
    # the denoiser the family does not have: its keys are refused, naming the one it has
    with pytest.raises(RecipeConfigError, match=r"roles.unet.lr.*no unet.*set roles.transformer.lr"):
        check("sd3_medium_full", "sd3", "roles.unet.lr=1.0e-4")
    with pytest.raises(RecipeConfigError, match=r"roles.transformer.lora.r.*set roles.unet.lora.r"):
        check("tiny", "sd", "roles.transformer.lora.r=4")
    # and the text encoders it does not have
    with pytest.raises(RecipeConfigError, match=r"roles.text_encoder_3.stage.*sdxl model has no text_encoder_3"):
        check("sdxl_full", "sdxl", "roles.text_encoder_3.stage=2")


@pytest.mark.parametrize("old,new", [("train.lr=1.0e-4", "roles.unet.lr"), ("lora.enabled=true", "roles.unet.lora.r"),
                                     ("flow.logit_std=2.0", "diffusion.logit_std"),
                                     ("train.snr_gamma=5.0", "diffusion.snr_gamma"),
                                     ("ema.dtype=bf16", "roles.ema.dtype"),
                                     ("ema.offload_params=true", "roles.ema.offload_params")])
def test_old_keys_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ConfigKeyError, match=f"is now '{new}'"):
        load_config("sd_finetune", "tiny", [old])


@pytest.mark.parametrize("overrides, key, words", [
    # the EMA is built at the unet's stage: parameter offload needs it at ZeRO-3
    (["roles.unet.stage=2", "roles.ema.offload_params=true"], "roles.ema.offload_params", "roles.unet's stage 2"),
    (["mode=seed_baseline", "roles.ema.offload_params=true"], "roles.ema.offload_params", "seed_baseline"),
    # seed_baseline decides where every frozen role lives: their placement keys would be ignored
    (["mode=seed_baseline", "roles.vae.stage=2"], "roles.vae.stage", "whole at stage 0"),
    (["mode=seed_baseline", "roles.text_encoder.gather_forward=false"], "roles.text_encoder.gather_forward",
     "whole at stage 0"),
    (["ema.enabled=false", "roles.ema.dtype=bf16"], "roles.ema.dtype", "builds no EMA role"),
    (["ema.enabled=false", "validation.use_ema=false"], "validation.use_ema", "applies only with an EMA"),
    (["export.roles=[transformer]"], "export.roles", "not among the roles"),
    (["data.max_train_samples=4"], "data.max_train_samples", "fewer than roles.unet.micro_batch_size=8"),
])
def test_keys_the_run_could_not_honour_are_refused(tmp_path, overrides, key, words):
    cfg = load_config("sd_finetune", "tiny", [f"output_dir={tmp_path}", *overrides])
    with pytest.raises(RecipeConfigError) as info:
        validate_config("sd_finetune", cfg, world_size=2)
    assert key in str(info.value) and words in str(info.value), str(info.value)


@pytest.mark.parametrize("override, words", [("roles.vae.model=/x", "not accepted"),
                                             ("roles.unet.tokenizer=/x", "not accepted"),
                                             ("roles.ema.stage=2", "not accepted"),
                                             ("ema.inv_gamma=2.0", "use_ema_warmup"),
                                             ("validation.enabled=false", None)])
def test_keys_a_section_does_not_have(override, words):
    if words is None:  # validation.* only with validation.enabled
        with pytest.raises(RecipeConfigError, match="validation.every.*applies only when validation.enabled"):
            load_config("sd_finetune", "tiny", [override, "validation.every=5"])
        return
    with pytest.raises(RecipeConfigError, match=words):
        load_config("sd_finetune", "tiny", [override])


def test_text_encoders_from_model_index(tmp_path):
    index = {"_class_name": "StableDiffusionXLPipeline", "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "unet": ["diffusers", "X"],
             "text_encoder_3": [None, None], "tokenizer": ["transformers", "CLIPTokenizer"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert text_encoder_names(str(tmp_path)) == ["text_encoder", "text_encoder_2"]
    assert tokenizer_name("text_encoder_2") == "tokenizer_2" and tokenizer_name("text_encoder") == "tokenizer"
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        read_model_index(str(tmp_path / "missing"))


def test_seed_baseline_builds_frozen_roles_unsharded(tmp_path):
    cfg = load_config("sd_finetune", "tiny", ["mode=seed_baseline", "roles.unet.dtype=bf16"])
    specs = {s.name: s for s in SDFinetune.role_specs(cfg, "sd", str(tmp_path))}
    assert list(specs) == ["unet", "vae", "text_encoder", "ema"]
    stage = {n: s.ds_config["zero_optimization"]["stage"] for n, s in specs.items()}
    assert stage == {"unet": 3, "vae": 0, "text_encoder": 0, "ema": 0}
    assert specs["unet"].trainable and not specs["vae"].trainable and specs["ema"].stateful
    assert specs["ema"].ds_config["bf16"]["enabled"] is False  # the EMA keeps fp32 (roles.ema.dtype)
    zero3 = {s.name: s for s in SDFinetune.role_specs(load_config("sd_finetune", "tiny", ["roles.unet.stage=2"]),
                                                       "sd", str(tmp_path))}
    assert zero3["ema"].ds_config["zero_optimization"]["stage"] == 2  # the unet's stage
    assert zero3["vae"].ds_config["zero_optimization"]["stage"] == 3 and zero3["vae"].gather_forward


def test_step_generator_is_a_function_of_its_arguments():
    def draw(*args):
        return torch.randn(4, generator=step_generator(*args))

    assert torch.equal(draw(0, 3, 1, 0), draw(0, 3, 1, 0))
    for other in ((1, 3, 1, 0), (0, 4, 1, 0), (0, 3, 0, 0), (0, 3, 1, 1)):
        assert not torch.equal(draw(0, 3, 1, 0), draw(*other))


def test_image_grid_layout():
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    grid = image_grid([Image.new("RGB", (8, 8), c) for c in colours], min_size=8)
    assert grid.size == (16, 16)  # 2 x 2, the last cell left white
    assert [grid.getpixel(p) for p in ((0, 0), (8, 0), (0, 8), (8, 8))] == [*colours, (255, 255, 255)]
    with pytest.raises(ValueError):
        image_grid([])


def test_cast_floating_keeps_integers():
    out = _cast_floating({"a": torch.ones(2), "b": [torch.arange(3)], "c": 1.5}, torch.bfloat16)
    assert out["a"].dtype == torch.bfloat16 and out["b"][0].dtype == torch.long and out["c"] == 1.5


def test_pretrain_tiny_vae(tmp_path):
    from diffusers import AutoencoderKL
    from multiengine.pipelines.diffusion.data import make_shapes_dataset
    from multiengine.pipelines.diffusion.tiny import build_tiny_sd, pretrain_tiny_vae

    model = build_tiny_sd(str(tmp_path / "sd"), resolution=16)
    images = make_shapes_dataset(str(tmp_path / "shapes"), 8, resolution=16)
    before = AutoencoderKL.from_pretrained(model, subfolder="vae")
    state = torch.random.get_rng_state()
    result = pretrain_tiny_vae(model, images, steps=3, batch_size=4, resolution=16)
    assert torch.equal(state, torch.random.get_rng_state())
    after = AutoencoderKL.from_pretrained(model, subfolder="vae")
    assert after.config.scaling_factor == pytest.approx(result["scaling_factor"])
    assert after.config.scaling_factor != before.config.scaling_factor
    w = "encoder.conv_in.weight"
    assert not torch.equal(before.state_dict()[w], after.state_dict()[w])
    mtime = os.stat(os.path.join(model, "vae", "pretrained.json")).st_mtime_ns
    assert pretrain_tiny_vae(model, images, steps=3, batch_size=4, resolution=16) == result  # idempotent
    assert os.stat(os.path.join(model, "vae", "pretrained.json")).st_mtime_ns == mtime

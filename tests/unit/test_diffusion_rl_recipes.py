"""diffusion_grpo and diffusion_dpo without ranks: their keys and roles, the checks before any rank starts, the
tiny shapes prompts and preference pairs, reward mixing, and the planner's roles."""

from __future__ import annotations

import json

import pytest
import torch
from multiengine.engines.settings import SettingsError
from multiengine.pipelines.diffusion.rewards import color_reward
from multiengine.pipelines.diffusion.rl_runs import (
    load_preference_rows,
    make_shapes_preference_pairs,
    preference_pixels,
    preference_split,
    read_prompts,
    reward_functions,
    score_images,
    shapes_prompt_split,
)
from multiengine.recipes.language.config import (
    RecipeConfigError,
    describe_keys,
    load_config,
    load_recipe,
    validate_config,
)
from multiengine.recipes.language.plans import recipe_plans


def _grpo(*overrides):
    return load_config("diffusion_grpo", "tiny", list(overrides))


@pytest.mark.parametrize("overrides, key, words", [
    (["roles.policy.micro_batch_size=12"], "roles.policy.micro_batch_size", "multiple of diffusion.group_size=8"),
    (["reward.weights=[1.0]"], "reward.weights", "1 weights for 2 functions"),
    (["reward.functions=[no_such_module:fn]", "reward.weights=[]"], "reward.functions", "cannot be loaded"),
    (["reward.functions=[color]", "reward.weights=[]", "eval.reward=reward_model"], "eval.reward", "reward role"),
    (["model.tiny_family=sdxl"], "model.tiny_unet_steps", "tiny SD unet only"),
    (["eval.size=9"], "eval.size", "cannot split the shapes captions"),
    (["diffusion.num_inference_steps=1"], "diffusion.train_timestep_fraction", "trains on no step"),
    (["diffusion.kl_coef=0", "roles.ref.dtype=bf16"], "roles.ref.dtype", "builds no ref role"),
    (["reward.functions=[color]", "reward.weights=[]", "roles.reward.stage=2"], "roles.reward.stage",
     "no reward role is built"),
    (["roles.policy.lora.alpha=8"], "roles.policy.lora.alpha", "applies only when roles.policy.lora.r is set"),
    (["diffusion.noise_level=0.5"], "diffusion.noise_level", "samples with DDIM"),
])
def test_grpo_refuses_bad_settings_naming_the_key(overrides, key, words):
    with pytest.raises(RecipeConfigError) as info:
        validate_config("diffusion_grpo", _grpo(*overrides), world_size=2)
    assert key in str(info.value) and words in str(info.value), str(info.value)


@pytest.mark.parametrize("override, key", [("roles.vae.model=/somewhere", "roles.vae.model"),
                                           ("roles.policy.tokenizer=/t", "roles.policy.tokenizer")])
def test_keys_a_role_does_not_have_are_refused_naming_why(override, key):
    with pytest.raises(RecipeConfigError, match=f"'{key}'.*not accepted.*model.pretrained"):
        _grpo(override)


def test_grpo_keys_and_roles():
    help_ = {row["key"]: row["meaning"] for row in describe_keys(load_recipe("diffusion_grpo"))}
    for key in ("diffusion.kl_coef", "diffusion.group_size", "diffusion.eta", "diffusion.noise_level",
                "reward.functions", "roles.policy.lora.r", "roles.ref.stage", "roles.reward.stage"):
        assert help_[key], key
    cfg = _grpo()
    assert cfg.roles.policy.micro_batch_size % cfg.diffusion.group_size == 0
    ref = cfg.roles.ref.placement()
    assert (ref.stage, ref.dtype, ref.gather_forward) == (3, "fp32", True)  # ZeRO-3, the policy's dtype
    assert _grpo("roles.policy.dtype=bf16").roles.ref.placement().dtype == "bf16"  # follows
    assert cfg.roles.reward.placement().stage == 3
    # what a run builds: the accumulation counts every trained step of every rollout
    roles = load_recipe("diffusion_grpo").describe(cfg)["roles"]
    assert roles["policy"]["ds_config"]["gradient_accumulation_steps"] == cfg.diffusion.trained_steps
    assert set(roles) == {"policy", "ref", "reward", "vae", "text_encoder"}


def test_dpo_refuses_bad_data(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "a", "good": "x.png", "rejected": "y.png"}) + "\n")
    cfg = load_config("diffusion_dpo", "tiny", [f"data.source={rows}"])
    with pytest.raises(RecipeConfigError, match="data.source.*no chosen \\(column 'chosen'\\).*data.columns"):
        validate_config("diffusion_dpo", cfg)
    cfg = load_config("diffusion_dpo", "tiny", ["eval.size=256"])
    with pytest.raises(RecipeConfigError, match="eval.size.*every one of the 256 pairs"):
        validate_config("diffusion_dpo", cfg)
    assert load_config("diffusion_dpo", "tiny").roles.ref.stage == 3


def test_shapes_prompts_split_by_colour():
    train, held = shapes_prompt_split(3, seed=0, colors=["red"])
    assert len(train) == 6 and len(held) == 3 and not set(train) & set(held)
    assert all(p.split()[1] == "red" for p in train + held)
    train, held = shapes_prompt_split(12, seed=0)
    assert len(train) + len(held) == 54
    with pytest.raises(ValueError, match="not shapes colours"):
        shapes_prompt_split(1, 0, ["pink"])


def test_shapes_preference_pairs_prefer_the_prompt_colour(tmp_path):
    path = make_shapes_preference_pairs(str(tmp_path / "pairs"), 12, resolution=16, seed=0)
    rows = load_preference_rows(path, {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"})
    prompts, chosen, rejected = preference_pixels(rows, str(tmp_path / "pairs"), 16)
    assert chosen.shape == rejected.shape == (12, 3, 16, 16) and float(chosen.min()) >= -1
    good = color_reward(prompts, (chosen + 1) / 2)
    bad = color_reward(prompts, (rejected + 1) / 2)
    assert min(good) > 0.9 and max(bad) < 0.1, (good, bad)
    assert make_shapes_preference_pairs(str(tmp_path / "pairs"), 12, resolution=16, seed=0) == path  # idempotent
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}
    train, held = preference_split(path, "", 4, 16, columns=columns)  # the last 4 rows held out
    assert train[0] == prompts[:8] and held[0] == prompts[8:] and torch.equal(held[1], chosen[8:])
    train, held = preference_split(path, path, 4, 16, columns=columns)  # a separate held-out source
    assert train[0] == held[0] == prompts


def test_prompt_files_and_reward_mixing(tmp_path):
    (tmp_path / "p.txt").write_text("a red square\n\n a blue circle \n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n')
    assert read_prompts(str(tmp_path / "p.txt")) == ["a red square", "a blue circle"]
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["x", "y"]
    images = torch.zeros(2, 3, 4, 4)
    fns = [("a", lambda p, i: [1.0, None], 0.5), ("b", lambda p, i: [0.2, 0.4], 2.0)]
    total, means = score_images(fns, ["p", "q"], images)
    assert torch.allclose(total, torch.tensor([0.5 + 0.4, 0.0 + 0.8])) and means == pytest.approx({"a": 0.5, "b": 0.3})
    (name, fn, weight), = reward_functions(["color"], [], registry=None)  # weights [] = 1 each
    assert (name, fn, weight) == ("color", color_reward, 1.0)
    model = reward_functions(["color", "reward_model"], [0.8, 0.2], registry="reg")[1]
    assert model[0] == "reward_model" and model[1].args == ("reg",) and model[2] == 0.2


def test_planner_lays_out_the_built_roles():
    (plan,) = recipe_plans(load_recipe("diffusion_grpo"), _grpo())
    roles = {r.name: r for r in plan.roles}
    assert set(roles) == {"policy", "ref", "reward", "vae", "text_encoder"}
    assert roles["policy"].trainable_params == roles["ref"].params and roles["ref"].trainable_params == 0
    # frozen roles gathered per forward (the default) are planned whole while they run; the encoder's forward
    # is one of its phases
    assert roles["ref"].full_gather == ("forward",) and roles["vae"].full_gather == ("decode / encode",)
    assert roles["text_encoder"].full_gather == ("encode",) and dict(roles["text_encoder"].phases)["encode"] > 0
    (plan,) = recipe_plans(load_recipe("diffusion_grpo"), _grpo("roles.ref.gather_forward=false"))
    assert {r.name: r for r in plan.roles}["ref"].full_gather == ()
    (plan,) = recipe_plans(load_recipe("diffusion_grpo"), _grpo("diffusion.kl_coef=0", "reward.functions=[color]",
                                                                "reward.weights=[]", "roles.policy.lora.r=4"))
    roles = {r.name: r for r in plan.roles}
    assert "ref" not in roles and "reward" not in roles
    assert roles["policy"].lora and 0 < roles["policy"].trainable_params < roles["policy"].params
    (plan,) = recipe_plans(load_recipe("diffusion_dpo"), load_config("diffusion_dpo", "tiny"))
    assert {r.name for r in plan.roles} == {"policy", "ref", "vae", "text_encoder"}


@pytest.mark.parametrize("recipe", ["diffusion_grpo", "diffusion_dpo"])
def test_planner_refuses_a_pipeline_without_a_denoiser(tmp_path, recipe):
    # a folder whose model_index.json names no component with weights: a clear error, not a KeyError
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    cfg = load_config(recipe, "tiny", [f"model.pretrained={tmp_path}"])
    with pytest.raises(SettingsError, match=r"trains a unet or a transformer beside a vae; .* components \[\]"):
        recipe_plans(load_recipe(recipe), cfg)

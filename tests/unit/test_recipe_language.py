"""One recipe language: every role of every recipe has the same keys, declared once, and old keys are refused."""

from __future__ import annotations

import pytest
from multiengine.engines import role_schema as schema
from multiengine.engines.recipe_config import (
    ConfigKeyError,
    Key,
    RecipeConfigError,
    describe_keys,
    list_recipes,
    load_config,
    load_recipe,
    split_keys,
    validate_config,
)
from multiengine.engines.role_schema import ROLE_KEYS, TRAINABLE_KEYS, Role, role_keys

RECIPES = sorted(list_recipes())
RUNS_OF_RUNS = {"rlhf_e2e"}  # its roles are its steps' (each step's recipe declares them)
WITH_ROLES = [r for r in RECIPES if r not in RUNS_OF_RUNS]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_declares_its_roles(recipe):
    roles = load_recipe(recipe).ROLES
    assert all(isinstance(r, Role) for r in roles)
    assert bool(roles) == (recipe not in RUNS_OF_RUNS)


@pytest.mark.parametrize("recipe", WITH_ROLES)
def test_every_role_has_the_common_keys_and_nothing_else(recipe):
    module = load_recipe(recipe)
    declared = [r.name for r in module.ROLES]
    assert list(module.DEFAULTS["roles"]) == declared
    for role in module.ROLES:
        keys = set(module.DEFAULTS["roles"][role.name])
        expected = set(ROLE_KEYS) | (set(TRAINABLE_KEYS) if role.trainable else set())
        assert keys == expected, (role.name, keys ^ expected)
        if role.trainable:
            assert set(module.DEFAULTS["roles"][role.name]["lora"]) == {"r", "alpha", "dropout", "target_modules"}
        for name in (role.follows, role.weights, role.tokenizer_of):
            assert not name or name in declared  # a declaration names only roles of its recipe


@pytest.mark.parametrize("recipe", WITH_ROLES)
def test_the_same_override_works_in_every_recipe_that_has_the_role(recipe):
    module = load_recipe(recipe)
    trainable = [r.name for r in module.ROLES if r.trainable]
    assert trainable, "every recipe trains something"
    configs = list_recipes()[recipe]
    config = "tiny" if "tiny" in configs else configs[0]
    overrides = [f"roles.{name}.micro_batch_size=2" for name in trainable]
    if "actor" in trainable:
        overrides.append("roles.actor.lr=1e-5")
    cfg = load_config(recipe, config, overrides)
    for name in trainable:
        assert cfg.roles[name].micro_batch_size == 2
    if "actor" in trainable:
        assert cfg.roles.actor.lr == 1e-5


# the recipes that existed before every role had the same keys (newer ones never spoke the old dialect)
OLD_DIALECT = ["controlnet", "distill", "registry_demo", "rlhf_dpo", "rlhf_grpo", "rlhf_ppo", "rlhf_reward", "rlhf_sft",
               "sd_finetune"]


@pytest.mark.parametrize("recipe", OLD_DIALECT)
def test_an_old_key_is_refused_naming_the_new_one(recipe):
    module = load_recipe(recipe)
    renamed = getattr(module, "RENAMED", {})
    assert renamed, f"{recipe} names the new key of each key it used before"
    old, new = next((o, n) for o, n in renamed.items() if not o.endswith(".*"))
    with pytest.raises(ConfigKeyError) as info:
        load_config(recipe, None, [f"{old}=1"])
    assert f"is now '{new.split()[0]}'" in str(info.value) and info.value.suggestion == new.split()[0]


@pytest.mark.parametrize("recipe, old, new", [
    ("rlhf_sft", "train.lr", "roles.actor.lr"),
    ("rlhf_sft", "lora.enabled", "roles.actor.lora.r"),
    ("rlhf_sft", "model.pretrained", "roles.actor.model"),
    ("rlhf_sft", "model.tiny_hidden", "tiny.hidden"),
    ("rlhf_reward", "model.pretrained", "roles.reward.model"),
    ("rlhf_reward", "train.micro_batch_size", "roles.reward.micro_batch_size"),
    ("rlhf_dpo", "model.actor", "roles.actor.model"),
    ("rlhf_dpo", "lora.actor.enabled", "roles.actor.lora.r"),
    ("rlhf_dpo", "lora.actor.rank", "roles.actor.lora.r"),
    ("distill", "model.tokenizer", "roles.teacher.tokenizer"),
    ("distill", "model.student_hidden", "tiny.student_hidden"),
    ("distill", "train.lr", "roles.student.lr"),
])
def test_old_dialect_examples(recipe, old, new):
    with pytest.raises(ConfigKeyError, match=f"'{old}' .* is now '{new}'"):
        load_config(recipe, "tiny", [f"{old}=1"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_config_validates_and_every_key_has_help(recipe):
    module = load_recipe(recipe)
    assert [r["key"] for r in describe_keys(module) if not r["meaning"]] == []
    for config in list_recipes()[recipe]:
        cfg = load_config(recipe, config)
        # the other configs name hub models this machine cannot reach; rlhf_ppo's tiny reads the exports of the
        # tiny rlhf_sft and rlhf_reward runs, which do not exist here
        if config.startswith("tiny") and recipe != "rlhf_ppo":
            validate_config(recipe, cfg)


def test_role_keys_state_only_differences():
    roles = (Role("actor", "the policy", trainable=True, keys={"lr": 1e-3, "lora": {"r": 8}}),
             Role("ref", "the frozen copy", follows="actor", weights="actor"))
    defaults, meanings = split_keys({"roles": role_keys(roles)})
    actor, ref = defaults["roles"]["actor"], defaults["roles"]["ref"]
    assert actor["lr"] == 1e-3 and actor["lora"]["r"] == 8 and actor["lora"]["target_modules"] == schema.LORA_TARGETS
    assert actor["stage"] == 3 and actor["scheduler"] == "constant"  # the shared defaults
    assert ref["stage"] == -1 and ref["dtype"] == "" and "lr" not in ref
    assert meanings["roles.actor.lr"] == TRAINABLE_KEYS["lr"].help  # a changed default keeps the shared help
    assert "roles.actor" in meanings["roles.ref.model"]
    with pytest.raises(KeyError, match="'learning_rate' is not a role key"):
        role_keys((Role("actor", "x", trainable=True, keys={"learning_rate": 1.0}),))
    assert isinstance(role_keys(roles), Key)


def _cfg(**roles):
    from omegaconf import OmegaConf

    base, _ = split_keys({"roles": role_keys(ROLES)})
    for name, values in roles.items():
        base["roles"][name].update(values)
    return OmegaConf.create(base)


ROLES = (Role("actor", "policy", trainable=True, keys={"stage": 2, "dtype": "fp32", "model": "/m/actor"}),
         Role("critic", "value", trainable=True, weights="reward", keys={"stage": 2}),
         Role("reward", "scorer", follows="critic", keys={"stage": -1, "dtype": "", "model": "/m/reward"}),
         Role("ref", "frozen policy", follows="actor", weights="actor", tokenizer_of="actor"))


def test_follow_and_weights_are_resolved_once():
    cfg = _cfg(actor={"tokenizer": "/t/actor"})
    ref = schema.placement(cfg, ROLES, "ref")
    assert (ref.stage, ref.dtype) == (2, "fp32")  # follows the actor
    reward = schema.placement(cfg, ROLES, "reward")
    assert (reward.stage, reward.dtype) == (2, "bf16")  # follows the critic, whose dtype is the shared default
    assert schema.model_path(cfg, ROLES, "ref") == "/m/actor"
    assert schema.model_path(cfg, ROLES, "critic") == "/m/reward"  # critic weights from the reward model
    assert schema.tokenizer_path(cfg, ROLES, "ref") == "/t/actor"
    cfg = _cfg(critic={"model": "/m/critic"}, ref={"stage": 3})
    assert schema.model_path(cfg, ROLES, "critic") == "/m/critic"
    assert schema.placement(cfg, ROLES, "ref").stage == 3


@pytest.mark.parametrize("changes, key, message", [
    ({"actor": {"stage": -1}}, "roles.actor.stage", "follows no other role"),
    ({"ref": {"offload_optimizer": True}}, "roles.ref.offload_optimizer", "frozen: it has no optimizer"),
    ({"actor": {"gather_forward": True}}, "roles.actor.gather_forward", "frozen roles only"),
    ({"ref": {"offload_params": True}}, "roles.ref.offload_params", "needs ZeRO-3 .*stage 2"),
])
def test_role_section_rules_name_the_key(changes, key, message):
    with pytest.raises(RecipeConfigError, match=message) as info:
        schema.check_role_sections(_cfg(**changes), ROLES)
    assert key in str(info.value)


def test_lora_and_optimizer_specs_from_a_role():
    cfg = _cfg(actor={"lora": {"r": 8, "alpha": 0.0, "dropout": 0.1, "target_modules": ["q_proj"]},
                      "lr": 2e-4, "betas": [0.9, 0.95], "max_grad_norm": 0.0})
    lora = schema.lora_spec(cfg, "actor")
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, None, 0.1, ("q_proj",))
    assert schema.lora_spec(cfg, "critic") is None  # r: 0 = full fine-tuning
    # given targets win over the defaults; an empty list takes them (the diffusion families' targets)
    assert schema.lora_spec(cfg, "actor", ("to_q",)).target_modules == ("q_proj",)
    cfg.roles.actor.lora.target_modules = []
    assert schema.lora_spec(cfg, "actor", ("to_q", "to_v")).target_modules == ("to_q", "to_v")
    optim = schema.optim_spec(cfg, "actor", 100)
    assert (optim.lr, optim.betas, optim.clip, optim.total_steps) == (2e-4, (0.9, 0.95), None, 100)


@pytest.mark.parametrize("recipe, key", [("rlhf_ppo", "ppo.kl_coef"), ("rlhf_grpo", "grpo.kl_coef"),
                                         ("diffusion_grpo", "diffusion.kl_coef"), ("rlhf_ppo", "ppo.epochs"),
                                         ("rlhf_grpo", "grpo.epochs")])
def test_a_shared_name_is_checked_alike_in_every_recipe(recipe, key):
    # kl_coef and epochs mean the same in every algorithm section: one check by name, the same message
    value = 0 if key.endswith("epochs") else -0.5
    with pytest.raises(RecipeConfigError) as info:
        load_config(recipe, None, [f"{key}={value}"])
    assert f"{key}" in str(info.value) and (">= 1" if key.endswith("epochs") else ">= 0") in str(info.value)


def test_a_key_carries_its_own_check_and_checks_override_it():
    from multiengine.engines.recipe_config import Choice, Range, declared_checks

    keys = {"a": Key({"n": Key(3, "a count", Range(2)), "kind": Key("x", "x | y", Choice("x", "y"))}, "a section"),
            "lr": Key(0.1, "by name")}
    checks = declared_checks(keys)
    assert set(checks) == {"a.n", "a.kind"}  # only the Keys that carry a check
    shared = schema.shared_checks(keys, {"a.n": Range(5)})
    assert shared["a.n"].describe() == Range(5).describe()  # CHECKS wins over the Key's own check
    assert shared["a.kind"].describe() == Choice("x", "y").describe()
    assert shared["lr"].describe() == Range(0, min_exclusive=True).describe()  # by name
    # a recipe's own check is applied at load time, naming the key and the value
    with pytest.raises(RecipeConfigError, match=r"grpo\.max_turns.*0"):
        load_config("rlhf_grpo", None, ["grpo.max_turns=0"])

"""One recipe language: every role of every recipe has the same keys, declared once; a role config resolves "follow
another role" and "weights from another role" itself and turns into what the registry builds (.spec) and what the
planner sizes (.request); old keys are refused naming the new ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiengine.engines import planner as P
from multiengine.engines.settings import SettingsError
from multiengine.recipes.language.config import (
    ConfigKeyError,
    ConfigValueError,
    describe_keys,
    list_recipes,
    load_config,
    load_recipe,
    recipe_schema,
    validate_config,
)
from multiengine.recipes.language.lifecycle import Recipe
from multiengine.recipes.language.plans import module_info, role_request
from multiengine.recipes.language.roles import FrozenRole, Role, RolloutRole, TrainableRole
from toys import toy_package

RUNS_OF_RUNS = {"rlhf_e2e"}  # its roles are its steps' (each step's recipe declares them)

FOUR_ROLES = '''
from multiengine.recipes.language.config import Key
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


class FourRoles(Recipe):
    name = "four_roles"
    roles = (Role("actor", "policy", trainable=True,
                  defaults={"stage": 2, "dtype": "fp32", "model": "/m/actor", "lr": Key(1e-3, "the actor's rate")}),
             Role("critic", "value", trainable=True, weights="reward", defaults={"stage": 2}),
             Role("reward", "scorer", follows="critic", defaults={"model": "/m/reward"}),
             Role("ref", "frozen policy", follows="actor", weights="actor", tokenizer_of="actor"),
             Role("net", "a plain network", trainable=True, omit=("lora", "tokenizer"),
                  why="a plain MLP has no adapters or tokenizer", defaults={"stage": 0, "dtype": "fp32"}))
    Config = RunConfig


RECIPE = FourRoles
'''


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    with toy_package(tmp_path_factory.mktemp("roles"), "me_role_recipes", {"four_roles": FOUR_ROLES}) as where:
        yield where


def load(toy, *overrides):
    return load_config("four_roles", None, list(overrides), package=toy["package"], configs_dir=toy["configs_dir"])


# --- a declaration becomes the roles section --------------------------------------------------------
def test_a_declaration_states_only_what_differs_from_the_shared_role_keys(toy):
    r = load(toy).roles
    assert isinstance(r.actor, TrainableRole) and isinstance(r.ref, FrozenRole) and r.trainable() == [
        "actor", "critic", "net"]
    assert r.actor.lr == 1e-3 and r.actor.stage == 2 and r.actor.scheduler == "constant"  # the rest: shared defaults
    assert r.actor.lora.r == 0 and r.actor.lora.target_modules == []  # []: DECODER_LORA_TARGETS at build
    assert (r.ref.stage, r.ref.dtype, r.reward.stage, r.reward.dtype) == (-1, "", -1, "")  # followers follow
    assert set(r.ref.to_dict()) == {f.name for f in dataclasses.fields(FrozenRole)}
    assert set(r.actor.to_dict()) == {f.name for f in dataclasses.fields(TrainableRole)}
    rows = {row["key"]: row["meaning"] for row in describe_keys(load_recipe("four_roles", toy["package"]))}
    assert "roles.net.lora.r" not in rows and "roles.net.tokenizer" not in rows and "roles.net.lr" in rows  # omitted
    assert rows["roles.actor.lr"] == "the actor's rate" and rows["roles.critic.lr"] == "peak learning rate"
    assert "-1 = the stage of roles.actor" in rows["roles.ref.stage"]
    assert "roles.actor's model" in rows["roles.ref.model"]
    assert rows["roles.ref"] == "frozen policy"


def test_follow_weights_and_tokenizer_are_resolved_by_the_role_config(toy):
    r = load(toy, "roles.actor.tokenizer=/t/actor").roles
    assert (r.ref.placement().stage, r.ref.placement().dtype) == (2, "fp32")  # the actor's
    assert (r.reward.placement().stage, r.reward.placement().dtype) == (2, "bf16")  # the critic's (its dtype: shared)
    assert r.ref.model_path() == "/m/actor" and r.critic.model_path() == "/m/reward"
    assert r.ref.tokenizer_path() == "/t/actor" and r.actor.tokenizer_path() == "/t/actor"
    assert r.net.model_path({"net": "/built/net"}) == "/built/net"  # an empty model: what the recipe built for it
    r = load(toy, "roles.critic.model=/m/critic", "roles.ref.stage=3", "roles.reward.dtype=fp32").roles
    assert r.critic.model_path() == "/m/critic" and r.ref.placement().stage == 3
    assert r.reward.placement().dtype == "fp32"


@pytest.mark.parametrize("override, error, words", [
    ("roles.actor.stage=-1", ConfigValueError, r"roles\.actor\.stage' .* must be in \[0, 3\]"),  # follows none
    ("roles.actor.dtype=", ConfigValueError, r"roles\.actor\.dtype' .* must be one of fp32, bf16, fp16"),
    ("roles.ref.offload_params=true", SettingsError, r"roles\.ref\.offload_params' needs ZeRO-3 \(roles\.ref "
                                                     r"runs at stage 2\).*roles\.ref\.stage=3"),
    ("roles.ref.offload_optimizer=true", ConfigKeyError, "roles.ref is frozen: it has no offload_optimizer"),
    ("roles.reward.lr=0.1", ConfigKeyError, "roles.reward is frozen: it has no lr"),
    ("roles.actor.gather_forward=true", ConfigKeyError, r"unknown config key 'roles\.actor\.gather_forward'"),
    ("roles.net.lora.r=4", ConfigKeyError, r"'roles\.net\.lora' .*not accepted.*a plain MLP has no adapters"),
    ("roles.net.tokenizer=/t", ConfigKeyError, "a plain MLP has no adapters or tokenizer"),
    ("roles.actor.lora.dropout=0.1", ConfigValueError, "applies only when roles.actor.lora.r is set"),
])
def test_role_rules_name_the_key(toy, override, error, words):
    with pytest.raises(error, match=words):
        load(toy, override)


def test_a_circle_of_followers_is_the_declarations_bug():
    class Circle(Recipe):
        roles = (Role("a", "x", follows="b"), Role("b", "y", follows="a"))

    from multiengine.recipes.language.roles import Roles

    configs = {name: FrozenRole(stage=-1, dtype="") for name in ("a", "b")}
    with pytest.raises(ValueError, match="roles follow each other in a circle: a -> b -> a"):
        Roles(Circle.roles, configs)


# --- .spec(): what the registry builds ----------------------------------------------------------------
def test_a_trainable_role_config_is_the_registrys_role_spec(toy):
    r = load(toy, "roles.actor.lora={r: 8, alpha: 0, dropout: 0.1, target_modules: [q_proj]}", "roles.actor.lr=2e-4",
             "roles.actor.betas=[0.9, 0.95]", "roles.actor.max_grad_norm=0", "roles.actor.micro_batch_size=3",
             "roles.actor.grad_accum=2", "roles.actor.gradient_checkpointing=true",
             "roles.actor.scheduler=cosine", "roles.actor.warmup_steps=5").roles
    spec = r.actor.spec(torch.nn.Identity, total_steps=100, rows=2, accum=3, seed=5, eps=1e-6)
    assert spec.name == "actor" and spec.trainable and spec.gradient_checkpointing
    assert spec.ds_config["train_micro_batch_size_per_gpu"] == 6 and spec.ds_config["gradient_accumulation_steps"] == 6
    assert spec.ds_config["zero_optimization"]["stage"] == 2 and spec.ds_config["bf16"] == {"enabled": False}
    assert spec.ds_config["gradient_clipping"] == 0.0
    o = spec.optim
    assert (o.lr, o.betas, o.eps, o.total_steps, o.scheduler, o.warmup_steps) == (2e-4, (0.9, 0.95), 1e-6, 100,
                                                                                  "cosine", 5)
    assert (spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.target_modules) == (8, None, 0.1, ("q_proj",))
    # empty target_modules take the family's targets; lora.r 0 is full fine-tuning
    r = load(toy, "roles.actor.lora={r: 4, target_modules: []}").roles
    assert r.actor.spec(torch.nn.Identity, lora_targets=("to_q", "to_v")).lora.target_modules == ("to_q", "to_v")
    assert r.critic.spec(torch.nn.Identity).lora is None and not r.critic.spec(torch.nn.Identity).gradient_checkpointing
    # target_modules [] (its default) = the targets given at build time; set without lora.r it is refused
    assert load(toy, "roles.critic.lora.r=2").roles.critic.spec(torch.nn.Identity, lora_targets=("fc",)).lora.rank == 2
    assert load(toy, "roles.critic.lora.r=2").roles.critic.lora.target_modules == []
    with pytest.raises(ConfigValueError, match=r"roles\.critic\.lora\.target_modules' .* applies only when"):
        load(toy, "roles.critic.lora.target_modules=[fc]")


def test_a_declaration_cannot_change_the_default_of_a_key_that_applies_only_with_another():
    from multiengine.recipes.language.config import RecipeDefinitionError, settings_node
    from multiengine.recipes.language.roles import TrainableRole

    with pytest.raises(RecipeDefinitionError, match="target_modules applies only with r"):
        settings_node(TrainableRole, "x", {"lora": {"target_modules": ["fc"]}})


def test_a_frozen_role_config_is_the_registrys_role_spec(toy):
    r = load(toy, "roles.actor.stage=3", "roles.ref.gather_forward=true", "roles.ref.offload_params=true").roles
    spec = r.ref.spec(torch.nn.Identity)
    assert not spec.trainable and spec.gather_forward and spec.optim is None
    assert spec.ds_config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert (spec.placement.stage, spec.placement.dtype) == (3, "fp32")  # followed
    ema = r.reward.spec(torch.nn.Identity, name="ema", stage=0, stateful=True)  # a role whose stage the recipe sets
    assert ema.name == "ema" and ema.stateful and ema.placement.stage == 0 and not ema.gather_forward


def test_describe_is_what_a_run_builds(toy):
    cls = load_recipe("four_roles", toy["package"])
    base = cls.describe(load(toy))
    assert base["roles"]["ref"]["model"] == "/m/actor" and base["roles"]["actor"]["ds_config"]["zero_optimization"]
    assert cls.describe(load(toy, "roles.ref.stage=3"))["roles"]["ref"] != base["roles"]["ref"]
    assert cls.describe(load(toy, "seed=3"))["seed"] == 3


# --- role_request(): what the planner sizes ------------------------------------------------------------
class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.fc = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)


def test_a_role_config_is_the_planners_request(toy):
    info = module_info("tiny", _Attention())
    params = info.params
    r = load(toy, "roles.actor.lora={r: 2, target_modules: [q_proj]}", "roles.actor.offload_optimizer=true").roles
    actor = role_request(r.actor, info, [("train step", 1000)])
    assert actor.name == "actor" and actor.dtype == "fp32" and actor.lora and actor.phases == (("train step", 1000),)
    assert actor.trainable_params == 2 * (16 + 16) and actor.params == params + 64  # only the adapters train
    assert actor.current == P.Choice(2, offload_optimizer=True) and actor.choices == P.trainable_choices()
    ref = role_request(r.ref, info)
    assert ref.trainable_params == 0 and not ref.lora and ref.current == P.Choice(0)  # frozen at 2: built at 0
    assert ref.choices == P.frozen_choices() and ref.params == params
    critic = role_request(r.critic, info, note="from the reward model")
    assert critic.trainable_params == params and critic.note == "from the reward model"


# --- every recipe ----------------------------------------------------------------------------------------
def _config(recipe: str) -> str:
    configs = list_recipes()[recipe]
    return "tiny" if "tiny" in configs else configs[0]


@pytest.mark.parametrize("recipe", sorted(list_recipes()))
def test_every_recipe_declares_its_roles(recipe):
    cls = load_recipe(recipe)
    assert issubclass(cls, Recipe) and cls.name == recipe
    assert all(isinstance(r, Role) for r in cls.roles) and bool(cls.roles) == (recipe not in RUNS_OF_RUNS)
    declared = [r.name for r in cls.roles]
    cfg = load_config(recipe, _config(recipe))
    assert list(cfg.roles or ()) == declared
    keys = recipe_schema(cls).children["roles"].children if cls.roles else {}
    for role in cls.roles:
        kind = RolloutRole if role.rollout else TrainableRole if role.trainable else FrozenRole
        fields = {f.name for f in dataclasses.fields(kind)} - {o for o in role.omit if "." not in o}
        if not role.sequences:  # packing keys only for roles whose passes run over token sequences
            fields -= {"packing", "token_budget"}
        if not role.routed:  # the router's auxiliary loss only where a policy loss takes it
            fields -= {"router_aux_loss_coef"}
        assert set(keys[role.name].children) == fields, role.name
        for name in (role.follows, role.weights, role.tokenizer_of):
            assert not name or name in declared  # a declaration names only roles of its recipe


@pytest.mark.parametrize("recipe", sorted(set(list_recipes()) - RUNS_OF_RUNS))
def test_the_same_override_works_in_every_recipe_that_has_the_role(recipe):
    trainable = [r.name for r in load_recipe(recipe).roles if r.trainable]
    assert trainable, "every recipe trains something"
    overrides = [f"roles.{name}.micro_batch_size=2" for name in trainable]
    cfg = load_config(recipe, _config(recipe), overrides)
    assert all(cfg.roles[name].micro_batch_size == 2 for name in trainable)


@pytest.mark.parametrize("recipe", sorted(list_recipes()))
def test_every_shipped_config_loads_and_every_key_has_help(recipe, tmp_path):
    assert [r["key"] for r in describe_keys(load_recipe(recipe)) if not r["meaning"]] == []
    for config in list_recipes()[recipe]:
        cfg = load_config(recipe, config, [f"output_dir={tmp_path / config}"])
        # the other configs name hub models this machine cannot reach; rlhf_ppo's tiny reads the exports of the
        # tiny rlhf_sft and rlhf_reward runs, which do not exist here
        if config.startswith("tiny") and recipe != "rlhf_ppo":
            validate_config(recipe, cfg)


# the recipes that existed before every role had the same keys (newer ones never spoke the old dialect)
OLD_DIALECT = ["controlnet", "distill", "registry_demo", "rlhf_dpo", "rlhf_grpo", "rlhf_ppo", "rlhf_reward", "rlhf_sft",
               "sd_finetune"]


@pytest.mark.parametrize("recipe", OLD_DIALECT)
def test_an_old_key_is_refused_naming_the_new_one(recipe):
    renamed = load_recipe(recipe).renamed
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
    ("registry_demo", "micro_batch_size", "roles.actor.micro_batch_size"),
    ("registry_demo", "dtype", "roles.actor.dtype"),
])
def test_old_dialect_examples(recipe, old, new):
    with pytest.raises(ConfigKeyError, match=f"'{old}' .* is now '{new}'"):
        load_config(recipe, "tiny", [f"{old}=1"])

"""The RLHF recipes' config layer in one process: the reward section (reward-model roles and reward functions), each
recipe's checks (its settings' and validate(cfg)) run before any rank starts, the shipped configs, old keys refused
naming the new ones, and the rlhf_e2e step-3 switch feeding valid keys to each recipe. The runs themselves are in
tests/distributed/test_rlhf_recipes_cli.py."""

from __future__ import annotations

import pytest
from multiengine.engines import Placement
from multiengine.engines.settings import SettingsError
from multiengine.pipelines.rlhf.reward_sources import RewardSettings
from multiengine.pipelines.rlhf.rewards import judge_reward
from multiengine.recipes.language.config import RecipeConfigError, checked_config, list_recipes, load_config

BASE = Placement(stage=3, dtype="fp32", offload_params=True)


def reward_config(settings, default_path, base):
    return settings.sources(default_path, base)


@pytest.mark.parametrize("recipe", ["rlhf_sft", "rlhf_reward", "rlhf_dpo", "distill", "rlhf_e2e", "rlhf_grpo"])
def test_shipped_configs_load_with_a_header(recipe):
    names = list_recipes()[recipe]
    assert "tiny" in names
    for name in names:
        cfg = load_config(recipe, name)
        assert cfg.output_dir and cfg.max_steps >= (recipe != "rlhf_e2e")
    from multiengine.recipes.language.config import config_header, config_path

    assert config_header(config_path(recipe, "tiny"))


def test_reward_models_and_functions_with_weights_and_placements(tmp_path):
    fn_file = tmp_path / "rewards.py"
    fn_file.write_text("def length(prompts, responses):\n    return [len(r) for r in responses]\n"
                       "def judge(prompts, responses):\n    return [0.0 for r in responses]\n")
    s = RewardSettings(models=[{"role": "reward", "weight": 0.5},
                        {"role": "reward_safety", "model": "/models/safety", "weight": 2, "stage": 2, "dtype": "bf16",
                         "offload_params": False}],
                functions=["builtin:judge", {"fn": f"{fn_file}:length", "weight": 0.1},
                           {"fn": f"{fn_file}:judge", "weight": -1.0}])
    roles, sources = reward_config(s, "/models/rm", BASE)
    assert [(r.role, r.path, r.weight) for r in roles] == [("reward", "/models/rm", 0.5),
                                                           ("reward_safety", "/models/safety", 2.0)]
    assert roles[0].placement == BASE  # follows roles.reward's placement
    assert (roles[1].placement.stage, roles[1].placement.dtype, roles[1].placement.offload_params) == (2, "bf16", False)
    assert [(x.name, x.weight, x.role) for x in sources[:2]] == [("reward", 0.5, "reward"),
                                                                ("reward_safety", 2.0, "reward_safety")]
    assert sources[2].fn is judge_reward and sources[2].weight == 1.0
    assert sources[3].name == "length" and sources[3].fn([""], ["abc"]) == [3]
    # two functions called judge: both keep their whole spec as their name
    assert sources[2].name == "builtin:judge" and sources[4].name == f"{fn_file}:judge"
    assert len({x.name for x in sources}) == len(sources)


def test_a_placement_that_cannot_work_names_its_entry():
    # stage 2 with the base's parameter offload: only ZeRO-3 partitions parameters
    with pytest.raises(SettingsError, match=r"reward.models\[0\] \(role 'reward'\): offload_params=True needs"):
        reward_config(RewardSettings(models=[{"role": "reward", "stage": 2}]), "/models/rm", BASE)


def test_empty_reward_config_is_the_reward_role_or_a_named_error():
    roles, sources = reward_config(RewardSettings(), "/models/rm", BASE)
    assert [(r.role, r.path, r.weight) for r in roles] == [("reward", "/models/rm", 1.0)]
    assert [x.role for x in sources] == ["reward"]
    with pytest.raises(SettingsError, match="no reward source.*reward.functions"):
        reward_config(RewardSettings(), None, BASE)
    roles, sources = reward_config(RewardSettings(functions=["builtin:judge"]), None, BASE)
    assert roles == [] and [x.fn for x in sources] == [judge_reward]


@pytest.mark.parametrize("values, message", [
    ({"models": [{"role": "rm"}]}, r"reward.models\[0\].role='rm'.*reward_<name>"),
    ({"models": [{"role": "reward", "wieght": 1.0}]}, r"reward.models\[0\].wieght.*Did you mean 'weight'"),
    ({"models": [{"role": "reward_x"}]}, r"reward.models\[0\].model is empty"),
    ({"models": [{"role": "reward_x", "path": "/rm"}]}, r"reward.models\[0\].path.*is now 'reward.models\[0\].model'"),
    ({"models": [{"role": "reward"}, {"role": "reward"}]}, "appears twice"),
    ({"models": [{"role": "reward", "weight": "high"}]}, r"reward.models\[0\].weight='high'"),
    ({"functions": ["judge"]}, r"reward.functions\[0\].*expected 'package.module:function'"),
    ({"functions": ["builtin:jugde"]}, r"reward.functions\[0\].*no built-in 'jugde'"),
    ({"functions": ["/no/such/file.py:f"]}, r"reward.functions\[0\].*does not exist"),
    ({"functions": ["json:no_such_function"]}, r"json has no 'no_such_function'"),
    ({"functions": [{"fn": "builtin:judge", "wait": 2}]}, r"reward.functions\[0\].wait.*'weight'"),
    ({"functions": [{"fn": "builtin:judge", "weight": float("nan")}]}, "finite"),
    ({"functions": "builtin:judge"}, "expected a list"),
])
def test_bad_reward_entries_name_the_key_and_the_fix(values, message):
    with pytest.raises(SettingsError, match=message):
        RewardSettings(**values).entries()


@pytest.mark.parametrize("recipe, overrides, message", [
    ("rlhf_grpo", ["grpo.algorithm=ppo"], "'grpo.algorithm' .* must be one of grpo, dr_grpo, rloo, reinforce_pp"),
    ("rlhf_grpo", ["grpo.n_samples_per_prompt=1"], "'grpo.n_samples_per_prompt' .* gives zero advantages"),
    ("rlhf_grpo", ["grpo.algorithm=reinforce_pp", "grpo.n_samples_per_prompt=1", "grpo.rollout_batch_size=6",
                   "roles.actor.micro_batch_size=4"], "multiple of roles.actor.micro_batch_size=4"),
    ("rlhf_grpo", ["grpo.mini_batch_size=4"], "'grpo.mini_batch_size' .* is now 'roles.actor.micro_batch_size'"),
    ("rlhf_grpo", ["grpo.kl_in_reward=yes"], "'grpo.kl_in_reward' .* expects bool"),
    ("rlhf_grpo", ["roles.actor.grad_accum=3"], r"'roles.actor.grad_accum' does not divide the 2 minibatches"),
    ("rlhf_grpo", ["reward.functions=[]"], "no reward source"),
    ("rlhf_grpo", ["reward.functions=[builtin:judgee]"], "no built-in 'judgee'"),
    ("rlhf_grpo", ["generation.mode=hybrid"], "'generation.mode' .* must be one of gather, per_token, got 'hybrid'"),
    ("rlhf_dpo", ["dpo.loss=hinge"], "'dpo.loss' .* must be one of sigmoid, ipo, got 'hinge'"),
    ("rlhf_dpo", ["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "'dpo.label_smoothing' .* applies only with "
                                                              "dpo.loss=sigmoid"),
    ("rlhf_dpo", ["dpo.beta=0"], "'dpo.beta' .* must be > 0"),
    ("rlhf_dpo", ["dpo.precompute_batch_size=8"], "'dpo.precompute_batch_size' .* applies only when "
                                                  "dpo.precompute_ref is set"),
    ("rlhf_dpo", ["roles.ref.tokenizer=/t"], "'roles.ref.tokenizer' .* the ref scores the actor's tokens"),
    ("rlhf_dpo", ["roles.ref.lr=1e-3"], "'roles.ref.lr' .* roles.ref is frozen"),
    ("rlhf_dpo", ["model.actor=/a"], "'model.actor' .* is now 'roles.actor.model'"),
    ("rlhf_dpo", ["lora.actor.rank=8"], "'lora.actor.rank' .* is now 'roles.actor.lora.r'"),
    ("rlhf_sft", ["train.lr=1e-3"], "'train.lr' .* is now 'roles.actor.lr'"),
    ("rlhf_sft", ["model.tiny_hidden=32"], "'model.tiny_hidden' .* is now 'tiny.hidden'"),
    ("rlhf_sft", ["generation.mode=hybrid"], "'generation.mode' .* must be one of gather, per_token"),
    ("rlhf_reward", ["lora.enabled=true"], "'lora.enabled' .* is now 'roles.reward.lora.r'"),
    ("rlhf_reward", ["eval.size=8"], "unknown config key 'eval.size'"),
    ("distill", ["distill.jsd_beta=0.3"], "'distill.jsd_beta' .* is now 'distill.beta'"),
    ("distill", ["distill.beta=0.3"], "'distill.beta' .* applies only with distill.loss=jsd"),
    ("distill", ["distill.loss=jsd", "distill.beta=1"], "'distill.beta' .* must be in \\(0, 1\\)"),
    ("distill", ["distill.temperature=0"], "'distill.temperature' .* must be > 0"),
    ("distill", ["model.student_hidden=8"], "'model.student_hidden' .* is now 'tiny.student_hidden'"),
    ("distill", ["teacher_sft.config=nope"], "teacher_sft.config='nope' .* has no shipped config 'nope'"),
    ("rlhf_dpo", ["actor_sft.overrides=[max_step=3]"], "actor_sft.overrides=.*unknown config key 'max_step'"),
    ("rlhf_e2e", ["resume_from=latest"], "unknown config key 'resume_from'"),
    ("rlhf_e2e", ["max_steps=-1"], "'max_steps' .* must be >= 0"),
    ("rlhf_ppo", ["reward.models=[{role: critic}]"], "reward.models.0..role='critic'|reward.models\\[0\\].role"),
    ("rlhf_ppo", ["ppo.rollout_batch_size=6", "roles.actor.micro_batch_size=4"],
     r"'ppo.rollout_batch_size' .* multiple of roles.actor.micro_batch_size=4"),
    ("rlhf_ppo", ["ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=8", "roles.critic.micro_batch_size=3"],
     r"'ppo.rollout_batch_size' .* multiple of roles.critic.micro_batch_size=3"),
    ("rlhf_ppo", ["ppo.mini_batch_size=4"], "'ppo.mini_batch_size' .* is now 'roles.actor.micro_batch_size'"),
    ("rlhf_ppo", ["ppo.ppo_epochs=2"], "'ppo.ppo_epochs' .* is now 'ppo.epochs'"),
    ("rlhf_ppo", ["model.critic=/c"], "'model.critic' .* is now 'roles.critic.model'"),
    ("rlhf_ppo", ["lora.critic.enabled=true"], "'lora.critic.enabled' .* is now 'roles.critic.lora.r'"),
    ("rlhf_e2e", ["algorithm=rloo"], "'algorithm' .* must be one of ppo, grpo, dpo, got 'rloo'"),
])
def test_recipe_checks_run_before_any_rank_starts(recipe, overrides, message):
    with pytest.raises(RecipeConfigError, match=message):
        checked_config(recipe, "tiny", overrides)  # CHECKS (load_config) and validate(cfg)


def test_ppo_takes_the_same_reward_config():
    cfg = load_config("rlhf_ppo", "tiny", ["reward.functions=[builtin:judge]", "reward.models=[{role: reward, "
                                           "weight: 0.5}]", "reward.normalize=true"])
    roles, sources = reward_config(cfg.reward, cfg.roles.reward.model, BASE)
    assert [(x.name, x.weight) for x in sources] == [("reward", 0.5), ("judge", 1.0)]
    assert roles[0].path == cfg.roles.reward.model and cfg.reward.normalize


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "dpo"])
def test_e2e_feeds_each_final_recipe_valid_keys(algorithm):
    from multiengine.recipes.rlhf_e2e import FINAL_STEP

    recipe, needs_rm, feed = FINAL_STEP[algorithm]
    assert needs_rm == (algorithm != "dpo")
    cfg = load_config(recipe, "tiny", feed("/sft/export/actor", "/rm/export/reward"))
    assert cfg.roles.actor.model == "/sft/export/actor"
    if algorithm == "grpo":  # GRPO inside e2e optimises the learned reward model, like PPO
        roles, sources = reward_config(cfg.reward, cfg.roles.reward.model or None, BASE)
        assert [(r.role, r.path) for r in roles] == [("reward", "/rm/export/reward")]
        assert [x.role for x in sources] == ["reward"]
    assert load_config("rlhf_e2e", "tiny", [f"algorithm={algorithm}"]).algorithm == algorithm


def test_ppo_recipe_with_reward_functions_only_on_the_torch_backend(tmp_path):
    """No reward model at all: no `reward` role, the critic starts from the actor's folder (fresh head), and
    the reward is the judge itself (so the logged reward equals the logged judge score)."""
    import json

    from multiengine.pipelines.rlhf import tiny
    from multiengine.recipes import rlhf_ppo

    assets = tiny.prepare_builtin(tmp_path / "assets", hidden=32, layers=1, n_sft=16, n_reward=16, n_ppo=32,
                                  n_eval=8)
    cfg = load_config("rlhf_ppo", "tiny", [
        f"output_dir={tmp_path / 'run'}", "backend=torch", f"roles.actor.model={assets['model']}",
        "roles.reward.model=",
        f"data.source={assets['data']}", "reward.functions=[builtin:judge]", "max_steps=2", "eval.every=0",
        "eval.size=8", "eval.batch_size=4", "eval.greedy=false", "ppo.rollout_batch_size=4",
        "roles.actor.micro_batch_size=2", "roles.critic.micro_batch_size=2", "checkpoint.every=0",
        "export.critic=false", "plot=false", "tensorboard=false"])
    rlhf_ppo.RECIPE.main(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert set(summary["roles"]) == {"actor", "ref", "critic"}
    assert summary["paths"]["critic"] == summary["paths"]["actor"] == str(assets["model"])
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in steps if "train/reward/mean" in x]
    assert len(train) == 2
    for x in train:
        assert x["train/reward/mean"] == pytest.approx(x["train/judge/mean"], abs=1e-6)
        assert x["train/reward/judge"] == pytest.approx(x["train/judge/mean"], abs=1e-6)
    # the held-out reward is the reward functions' too (no reward model is needed for it)
    m = summary["metrics"]
    for tag in ("before", "after"):
        assert m[f"eval/{tag}/reward"] == pytest.approx(m[f"eval/{tag}/judge"], abs=1e-6)
        assert m[f"eval/{tag}/reward/judge"] == pytest.approx(m[f"eval/{tag}/judge"], abs=1e-6)

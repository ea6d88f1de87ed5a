"""`multiengine plan`: every shipped config answers without loading weights, --write round-trips through
the config loader, and bad input fails with exit 2 and a message naming the fix."""

from __future__ import annotations

import json

import pytest
from multiengine.engines import known_models
from multiengine.engines import planner as P
from multiengine.pipelines.rlhf.tiny import tiny_model_info
from multiengine.recipes.language import cli, plans
from multiengine.recipes.language.config import list_recipes, load_config, load_recipe
from multiengine.recipes.language.lifecycle import Recipe

PLANNED = list_recipes()
GPU_CONFIGS = [(r, n) for r, names in PLANNED.items() for n in names if not n.startswith("tiny")]
ALL_CONFIGS = [(r, n) for r, names in PLANNED.items() for n in names]


@pytest.mark.parametrize("recipe", sorted(PLANNED))
def test_every_recipe_has_a_planner(recipe):
    cls = load_recipe(recipe)
    assert cls.plan.__func__ is not Recipe.plan.__func__, f"{recipe} defines no plan(cfg, assume): add one to its class"


def _plan(capsys, *args: str) -> tuple[int, list[dict], str]:
    code = cli.main(["plan", *args, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out.strip() else []), out.err


@pytest.mark.parametrize("recipe,name", ALL_CONFIGS)
def test_every_shipped_config_gets_a_plan(capsys, tmp_path, recipe, name):
    code, result, err = _plan(capsys, recipe, "--config", name, f"output_dir={tmp_path}", "--gpus", "8",
                              "--gpu-mem", "80GiB", "--cpu-mem", "1TiB")
    assert code in (0, 1), err
    assert result and all(step["roles"] for step in result)
    for step in result:
        for role, data in step["roles"].items():
            assert data["params"] > 0 and data["chosen"]["param_bytes"] > 0, (role, data)


@pytest.mark.parametrize("recipe,name", GPU_CONFIGS)
def test_shipped_gpu_configs_fit_as_written_on_8_x_80gb(capsys, recipe, name):
    code, result, err = _plan(capsys, recipe, "--config", name, "--gpus", "8", "--gpu-mem", "80GiB")
    assert code == 0, err
    for step in result:
        assert step["current"]["fits"], (step["title"], step["current"])


def test_export_folders_of_other_configs_are_resolved(capsys):
    _, result, _ = _plan(capsys, "rlhf_ppo", "--config", "opt1.3b_opt350m", "--gpus", "8", "--gpu-mem", "80GiB")
    roles = result[0]["roles"]
    assert "rlhf_sft/opt1.3b exports there, starting from facebook/opt-1.3b" in roles["actor"]["source"]
    assert roles["actor"]["params"] == roles["ref"]["params"] == roles["ema"]["params"] == 1_315_758_080
    # critic and reward: OPT-350m's body (the tied LM head is the embedding) + a value head of its width
    assert roles["critic"]["params"] == roles["reward"]["params"] == 331_196_416 + 1024
    # ref follows the actor's stage 2 -> a frozen role is built at stage 0
    assert roles["ref"]["current"]["stage"] == 0


def test_scalar_model_count_equals_the_loaded_model(tmp_path):
    from multiengine.engines import planner as P
    from multiengine.pipelines.rlhf.models import ScalarHeadModel
    from transformers import OPTConfig, OPTForCausalLM

    OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                             word_embed_proj_dim=32)).save_pretrained(tmp_path / "lm")
    model = ScalarHeadModel.from_pretrained(tmp_path / "lm")
    assert plans.scalar_info(P.model_info(tmp_path / "lm")).params == sum(p.numel() for p in model.parameters())


def test_write_round_trips(capsys, tmp_path):
    dest = tmp_path / "ppo.yaml"
    code, result, _ = _plan(capsys, "rlhf_ppo", "--config", "opt1.3b_opt350m", "--gpus", "8", "--gpu-mem", "40GiB",
                            "--assume", "actor=facebook/opt-13b", "--write", str(dest))
    assert code == 0
    chosen = {role: d["chosen"] for role, d in result[0]["roles"].items()}
    assert chosen["actor"]["stage"] == 3  # 13B parameters do not fit 40 GiB below stage 3
    text = dest.read_text()
    assert text.startswith("# Placements chosen by `multiengine plan rlhf_ppo --config opt1.3b_opt350m")
    cfg = load_config("rlhf_ppo", str(dest))
    for role in ("actor", "critic", "ref", "reward"):
        section = cfg.roles[role]
        assert section.stage == chosen[role]["stage"], role
        assert section.offload_params == chosen[role]["offload_params"], role
    assert cfg.roles.actor.offload_optimizer == chosen["actor"]["offload_optimizer"]
    assert cfg.roles.ema.offload_params == chosen["ema"]["offload_params"]
    assert cfg.roles.actor.lr == 9.65e-6  # everything else is the shipped config
    # the written file plans to the same placements and fits as written
    code, again, _ = _plan(capsys, "rlhf_ppo", "--config", str(dest), "--gpus", "8", "--gpu-mem", "40GiB",
                           "--assume", "actor=facebook/opt-13b")
    assert code == 0 and again[0]["current"]["fits"]


def test_write_for_e2e_appends_step_overrides(capsys, tmp_path):
    dest = tmp_path / "e2e.yaml"
    code, result, _ = _plan(capsys, "rlhf_e2e", "--config", "opt1.3b_opt350m", "--gpus", "1", "--gpu-mem", "24GiB",
                            "--write", str(dest))
    assert code == 0 and len(result) == 3
    cfg = load_config("rlhf_e2e", str(dest))
    sft_stage = result[0]["roles"]["actor"]["chosen"]["stage"]
    assert f"roles.actor.stage={sft_stage}" in cfg.sft.overrides
    assert any(o.startswith("roles.critic.stage=") for o in cfg.ppo.overrides)


def test_does_not_fit(capsys, tmp_path):
    dest = tmp_path / "never.yaml"
    code = cli.main(["plan", "sd_finetune", "--config", "sd15_full", "--gpus", "1", "--gpu-mem", "8GiB",
                     "roles.unet.micro_batch_size=8", "roles.unet.gradient_checkpointing=false", "--write", str(dest)])
    out = capsys.readouterr()
    assert code == cli.EXIT_DOES_NOT_FIT
    assert "does not fit" in out.out and "biggest role is 'unet'" in out.out
    assert "Activations dominate" in out.out
    assert "not writing" in out.err and not dest.exists()


@pytest.mark.parametrize("args,message", [
    (["--gpus", "8", "--gpu-mem", "80"], "give a number and a unit"),
    (["--gpus", "6", "--nodes", "4", "--gpu-mem", "80GiB"], "not a multiple of --nodes 4"),
    (["--gpus", "8", "--gpu-mem", "80GiB", "--assume", "actor"], "expected ROLE=MODEL"),
    (["--gpus", "8", "--gpu-mem", "80GiB", "roles.actor.model=/no/such/model"], "--assume actor=<folder"),
    (["--gpus", "8", "--gpu-mem", "80GiB", "roles.actor.micro_batch=2"], "Did you mean 'roles.actor.micro_batch_size'"),
])
def test_bad_input_is_a_usage_error(capsys, args, message):
    code = cli.main(["plan", "rlhf_sft", "--config", "tiny", *args])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and message in err and "Traceback" not in err


def test_offload_needs_host_memory_per_node(capsys):
    # 8 GPUs on 2 nodes: 4 ranks share each node's host memory
    # no evaluation (its generation would gather the whole 13B actor); its other keys back to their defaults
    args = ["rlhf_sft", "--config", "opt1.3b", "--assume", "actor=facebook/opt-13b", "eval.size=0",
            "eval.batch_size=32", "eval.judge=true", "roles.actor.gradient_checkpointing=true", "--gpus", "8",
            "--nodes", "2", "--gpu-mem", "24GiB"]
    code, result, _ = _plan(capsys, *args, "--cpu-mem", "512GiB")
    assert code == 0
    step = result[0]
    assert step["gpus_per_node"] == 4
    chosen = step["roles"]["actor"]["chosen"]
    assert chosen["offload_optimizer"]
    assert step["host_per_node"] == 4 * chosen["host_bytes"]
    code, result, _ = _plan(capsys, *args, "--cpu-mem", "64GiB")
    assert code == cli.EXIT_DOES_NOT_FIT and "host memory" in result[0]["message"]


def test_a_whole_model_gather_is_named_with_its_fix(capsys):
    code = cli.main(["plan", "rlhf_sft", "--config", "opt1.3b", "--assume", "actor=facebook/opt-13b", "--gpus", "8",
                     "--gpu-mem", "24GiB", "roles.actor.gradient_checkpointing=true"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_DOES_NOT_FIT
    assert "Its generation gathers the whole role on every GPU (23.94 GiB)" in out


def test_a_saved_reward_model_keeps_its_own_head(tmp_path):
    """A *ForSequenceClassification export (ScalarHeadModel.save_pretrained) has `score.weight`: no second head."""
    from multiengine.engines import planner as P
    from multiengine.pipelines.rlhf.models import ScalarHeadModel
    from transformers import OPTConfig, OPTForCausalLM

    OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                             word_embed_proj_dim=32, pad_token_id=1)).save_pretrained(tmp_path / "lm")
    ScalarHeadModel.from_pretrained(tmp_path / "lm").save_pretrained(tmp_path / "rm")
    loaded = ScalarHeadModel.from_pretrained(tmp_path / "rm")
    assert plans.scalar_info(P.model_info(tmp_path / "rm")).params == sum(p.numel() for p in loaded.parameters())


def _roles(recipe: str, *overrides: str, config: str = "tiny") -> dict[str, object]:
    items = plans.recipe_plans(load_recipe(recipe), load_config(recipe, config, list(overrides)))
    assert len(items) == 1
    return {r.name: r for r in items[0].roles}


def test_grpo_roles_follow_the_recipe():
    # tiny: a reward function only -> actor + ref (ref follows the actor's stage 3), no reward-model role
    roles = _roles("rlhf_grpo")
    assert list(roles) == ["actor", "ref"]
    assert roles["ref"].current.stage == 3 and roles["ref"].params == roles["actor"].params
    gen = dict(roles["actor"].phases)["generation"]
    assert roles["actor"].full_gather == ("generation",)
    # rows = 8 prompts x 8 samples; kl_coef 0 -> no ref
    assert list(_roles("rlhf_grpo", "grpo.kl_coef=0")) == ["actor"]
    # per_token generation does not gather the actor whole
    assert _roles("rlhf_grpo", "generation.mode=per_token")["actor"].full_gather == ()
    # twice the rows generate more KV cache
    assert dict(_roles("rlhf_grpo", "grpo.n_samples_per_prompt=16")["actor"].phases)["generation"] > gen
    # two reward models: the first takes roles.reward's keys (following the actor's stage 2 -> a frozen stage 0),
    # the second follows it; an entry with its own stage is planned as written
    roles = _roles("rlhf_grpo", "roles.actor.stage=2",
                   "reward.models=[{role: reward, weight: 1.0}, "
                   "{role: reward_b, model: facebook/opt-350m, weight: 0.5}, "
                   "{role: reward_c, model: facebook/opt-350m, weight: 0.1, stage: 3}]")
    assert [r for r in roles if r.startswith("reward")] == ["reward", "reward_b", "reward_c"]
    assert roles["reward"].current == P.Choice(0) and roles["reward"].follows is None
    assert roles["reward_b"].follows == "reward" and roles["reward_b"].follows_all
    assert roles["reward_c"].choices == (P.Choice(3),) and "reward.models[2]" in roles["reward_c"].note
    item = plans.recipe_plans(load_recipe("rlhf_grpo"), load_config("rlhf_grpo", "tiny", [
        "reward.models=[{role: reward, weight: 1.0}, {role: reward_b, model: facebook/opt-350m, weight: 0.5}]"]))[0]
    assert set(item.keys) == {"actor", "ref", "reward"}


def test_ppo_critic_and_rewards_from_the_reward_section():
    # reward functions only: the critic starts from the actor's folder with a fresh head, no reward role
    roles = _roles("rlhf_ppo", "reward.functions=[builtin:judge]", "roles.actor.model=", "roles.reward.model=")
    assert list(roles) == ["actor", "critic", "ref"]
    assert roles["critic"].params == plans.scalar_info(tiny_model_info(64, 2, 0)).params
    assert roles["critic"].trainable_params == roles["critic"].params
    # roles.critic.model is planned from its own folder; reward roles from reward.models, placed like the critic
    roles = _roles("rlhf_ppo", "roles.actor.model=", "roles.critic.model=facebook/opt-350m", "roles.critic.stage=3",
                   "roles.reward.model=", "reward.models=[{role: reward_x, model: facebook/opt-350m, weight: 1.0}]")
    assert list(roles) == ["actor", "critic", "ref", "reward_x"]
    assert roles["critic"].params == roles["reward_x"].params == 331_196_416 + 1024
    assert roles["reward_x"].current == P.Choice(3)


def test_dpo_roles():
    roles = _roles("rlhf_dpo")
    assert list(roles) == ["actor", "ref"]
    assert roles["actor"].current == roles["ref"].current == P.Choice(3)
    assert dict(roles["ref"].phases).keys() == {"reference forward"}
    pre = _roles("rlhf_dpo", "dpo.precompute_ref=true", "dpo.precompute_batch_size=256")["ref"]
    assert dict(pre.phases)["precompute"] > dict(roles["ref"].phases)["reference forward"]
    assert _roles("rlhf_dpo", "roles.ref.stage=0")["ref"].current == P.Choice(0)


@pytest.mark.parametrize("algorithm,steps", [("ppo", ["rlhf_sft", "rlhf_reward", "rlhf_ppo"]),
                                             ("grpo", ["rlhf_sft", "rlhf_reward", "rlhf_grpo"]),
                                             ("dpo", ["rlhf_sft", "rlhf_dpo"])])
def test_e2e_plans_the_algorithm_it_runs(algorithm, steps):
    items = plans.recipe_plans(load_recipe("rlhf_e2e"), load_config("rlhf_e2e", "tiny", [f"algorithm={algorithm}"]))
    assert [i.title.split()[2] for i in items] == steps
    assert items[-1].overrides_key == f"{algorithm}.overrides"


def test_planned_vs_measured_report(tmp_path):
    cfg = load_config("registry_demo", "tiny", [f"output_dir={tmp_path}"])
    planned = plans.configured_states(load_recipe("registry_demo"), cfg, 2)

    def row(role: str, extra: int = 0) -> dict:
        p = planned[role]
        return {"role": role, "stage": p["stage"], "params_total": p["params_total"],
                "params_persistent": p["params_persistent"], "param_bytes": p["param_bytes"] + extra,
                "grad_bytes": p["grad_bytes"], "optimizer_bytes": p["optimizer_bytes"]}

    total = sum(planned["actor"][k] for k in plans.STATE_KEYS)
    off = int(0.2 * total)  # 20% more than planned on rank 1: out of tolerance
    per_rank = [{"roles": [row("actor"), row("reward"), row("encoder"), row("encoder") | {"role": "extra"}]},
                {"roles": [row("actor", off), row("reward"), row("encoder")]}]
    report = plans.planned_vs_measured(load_recipe("registry_demo"), cfg, per_rank)
    actor = report["roles"]["actor"]
    assert actor["stage"] == 3 and actor["planned"]["total"] == total
    assert actor["measured"]["total"] == total + off  # the rank holding the most
    assert actor["difference_bytes"] == off and actor["relative_difference"] == pytest.approx(off / total)
    assert actor["tolerance_bytes"] == int(0.05 * total) + 4 * actor["params_persistent"] > 0
    assert actor["within_tolerance"] is False and report["all_within_tolerance"] is False
    assert report["roles"]["reward"]["within_tolerance"] and report["roles"]["reward"]["difference_bytes"] == 0
    assert report["roles"]["extra"]["planned"] is None  # built by the run, unknown to the planner
    assert report["total"]["difference_bytes"] == off
    json.dumps(report)


def _train_and_experience(recipe: str, role: str, *overrides: str, assume: dict | None = None) -> tuple[int, int]:
    item = plans.recipe_plans(load_recipe(recipe), load_config(recipe, "tiny", list(overrides)), assume)[0]
    phases = dict(next(r for r in item.roles if r.name == role).phases)
    return phases["train step"], phases["experience forward"]


def test_a_token_budget_sizes_the_update_micro_batch():
    """rlhf_grpo tiny: 64 rows of 16 + 8 = 24 tokens, 32 rows per micro-batch. A packing family (Llama) plans a
    token-budget micro-batch as the budget's tokens in packed rows of 24 (at most an optimizer step's rows); a
    padded one (the tiny OPT) as up to a step's whole rows. The experience passes keep their padded size."""
    llama = {"actor": "meta-llama/Llama-3.1-8B"}
    dims = P.transformer_dims(known_models.known_model_info(llama["actor"]).config)

    def train(rows: int) -> int:
        return P.transformer_activation_bytes(dims, batch=rows, seq=24, dtype="fp32", trainable=True, logits=True)

    full, forward = _train_and_experience("rlhf_grpo", "actor", assume=llama)
    assert full == train(32)
    budget, packed_forward = _train_and_experience("rlhf_grpo", "actor", "roles.actor.token_budget=100", assume=llama)
    assert budget == train(5) and budget * 768 == full * 120  # ceil(100 / 24) = 5 rows: 120 tokens, not 32 x 24
    assert packed_forward == forward  # packed experience passes are planned at their padded size (a bound)
    # a budget above the step's tokens: the step's rows (32); with grad_accum 2 a step has 64 rows, 42 packed rows
    assert _train_and_experience("rlhf_grpo", "actor", "roles.actor.token_budget=1000", assume=llama)[0] == full
    assert _train_and_experience("rlhf_grpo", "actor", "roles.actor.token_budget=1000", "roles.actor.grad_accum=2",
                                 assume=llama)[0] == train(42)
    # padded (asked for, or the tiny OPT's family): short rows fill a budget, so up to a step's whole rows
    assert _train_and_experience("rlhf_grpo", "actor", "roles.actor.token_budget=100", "roles.actor.packing=padded",
                                 "roles.actor.grad_accum=2", assume=llama)[0] == train(64)
    opt_full = _train_and_experience("rlhf_grpo", "actor")[0]
    opt_budget = _train_and_experience("rlhf_grpo", "actor", "roles.actor.token_budget=100", "roles.actor.grad_accum=2")
    assert opt_budget[0] == 2 * opt_full  # 64 padded rows instead of 32


def test_ppo_plans_each_roles_budget_and_notes_the_packed_roles():
    llama = {"actor": "meta-llama/Llama-3.1-8B"}
    cfg = load_config("rlhf_ppo", "tiny", ["roles.actor.token_budget=48", "roles.critic.token_budget=48"])
    item = plans.recipe_plans(load_recipe("rlhf_ppo"), cfg, llama)[0]
    base = plans.recipe_plans(load_recipe("rlhf_ppo"), load_config("rlhf_ppo", "tiny"), llama)[0]
    train = {r.name: dict(r.phases).get("train step") for r in item.roles}
    before = {r.name: dict(r.phases).get("train step") for r in base.roles}
    assert train["actor"] * 16 == before["actor"] * 2  # Llama packs: 2 rows of 24 tokens instead of 16
    assert train["critic"] == before["critic"]  # the tiny OPT critic runs padded: a step's 16 rows, as before
    assert item.packed == base.packed == ["actor", "ref"]  # the tiny OPT critic and reward run padded
    assert [n for n in item.notes if n.startswith("token budget")] == [
        "token budget: roles.actor updates on at most 48 tokens per micro-batch, planned as 2 rows of 24 tokens, "
        "packed; micro_batch_size 16 rows without it",
        "token budget: roles.critic updates on at most 48 tokens per micro-batch, planned as 16 rows of 24 tokens, "
        "padded (up to an optimizer step's rows: short rows fill a budget); micro_batch_size 16 rows without it"]
    results = plans.plan_recipe(load_recipe("rlhf_ppo"), cfg, P.Budget(world_size=2, gpu_bytes=80 << 30), llama)[1]
    assert any(n.startswith("packed passes (actor, ref)") for n in results[0].notes)

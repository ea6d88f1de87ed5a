"""rlhf_grpo, rlhf_dpo and rlhf_e2e from the CLI on 2 ranks (DeepSpeed CPU accelerator, gloo), shortened: the tiny
configs with overrides, their summaries and outputs, a resumed rlhf_grpo run continuing bit for bit, rlhf_dpo with
precomputed reference log-probs on the SFT actor it trains first, and rlhf_e2e with DPO as step 3."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import assert_keys_read, subprocess_env

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.language.cli", "run"]
# timings differ between runs; everything else a step logs must be equal after a resume
TIMING = ("train/time/", "train/gen/", "train/step_time_s")


def cli(*args: str, timeout: int = 600) -> None:
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-6000:]


def train_lines(path) -> list[dict]:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    return [x for x in lines if any(k.startswith("train/") for k in x)]


# a user's reward function in TRL's form: the rows' `answer` column arrives by name, one value per row after the
# sharding and the repetition of each prompt (a row with another prompt's answer stops the run)
COUNT_REWARD = """
from multiengine.pipelines.rlhf.tiny import parse_prompt


def count_reward(prompts, completions, answer, **kwargs):
    wrong = [(p, a) for p, a in zip(prompts, answer) if str(parse_prompt(p)[0]) != a]
    if wrong or len(kwargs["id"]) != len(prompts) or len(kwargs["completion_ids"]) != len(prompts):
        raise ValueError(f"rows with another row's answer: {wrong[:3]}; arguments {sorted(kwargs)}")
    return [1.0 - min(abs(len(c.split()) - int(a)), 6) / 6.0 for c, a in zip(completions, answer)]
"""


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    """GRPO at ZeRO-3 (actor, ref and a reward model), the reward = 0.1 x a reward model + the built-in judge
    + 0.5 x a function from a file + 0.25 x a function reading the `answer` column of the user's prompt rows;
    the SFT actor trained first (shortened); a checkpoint at step 2 of 4."""
    root = tmp_path_factory.mktemp("rlhf_grpo")
    fn_file = root / "my_rewards.py"
    # dense: a 5-step SFT model's answers score ~0 under the judge, which would leave the advantages at 0
    fn_file.write_text("def distinct_words(prompts, responses):\n"
                       "    return [len(set(r.split())) / 6.0 for r in responses]\n" + COUNT_REWARD)
    out = root / "run"
    # the run's own embedded assets, built ahead so that the reward model's folder exists when the launch
    # checks its paths (the run finds them complete and reuses them)
    from multiengine.pipelines.rlhf import tiny

    tiny.prepare_builtin(out / "tiny", seed=0, hidden=64, layers=2, n_reward=30000, n_eval=512)
    (out / "tiny" / ".complete").write_text("ok\n")
    # the user's data: the same rows, the prompt files with an `answer` (the count each prompt asks for) and an id
    data = root / "data"
    data.mkdir()
    for src in (out / "tiny" / "data").iterdir():
        lines = src.read_text().splitlines()
        if src.name in ("ppo.jsonl", "eval.jsonl"):
            rows = [json.loads(x) for x in lines]
            lines = [json.dumps({**r, "answer": str(tiny.parse_prompt(r["prompt"])[0]), "id": i})
                     for i, r in enumerate(rows)]
        (data / src.name).write_text("".join(x + "\n" for x in lines))
    common = ["grpo.rollout_batch_size=2", "grpo.n_samples_per_prompt=4", "roles.actor.micro_batch_size=4",
              "grpo.epochs=2",
              "eval.size=16", "eval.batch_size=8", "eval.every=2", "reward.normalize=true", "max_steps=4",
              "generation.max_new_tokens=6", f"data.source={data}",
              f"reward.functions=[builtin:judge, {{fn: '{fn_file}:distinct_words', weight: 0.5}}, "
              f"{{fn: '{fn_file}:count_reward', weight: 0.25}}]",
              f"reward.models=[{{role: reward_tiny, model: '{out}/tiny/model', weight: 0.1, stage: 3}}]"]
    cli("rlhf_grpo", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "checkpoint.every=2",
        "checkpoint.keep_last=2", "actor_sft.overrides=[max_steps=5,eval.size=16,eval.greedy=false]", *common)
    resumed = root / "resumed"
    cli("rlhf_grpo", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={resumed}", "checkpoint.every=0",
        "checkpoint.keep_last=2",
        f"roles.actor.model={out}/sft/export/actor", f"resume_from={out}/checkpoints/step_00000002", *common)
    return {"root": root, "out": out, "resumed": resumed}


def test_grpo_cli_summary_outputs_and_reward_sum(grpo):
    out = grpo["out"]
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    for key in ("eval/before/judge", "eval/after/judge", "eval/before/kl", "eval/after/kl", "eval/after/reward",
                "time/step_s_mean", "gen/tokens_per_s_mean"):
        assert m.get(key) is not None, key
    assert (m["algorithm"], m["loss_agg"], m["kl_in_reward"], m["steps"]) == ("grpo", "seq_mean_token_mean", False, 4)
    assert m["eval/before/kl"] == pytest.approx(0.0, abs=1e-6) and m["eval/after/kl"] > 0  # the actor moved
    roles = summary["roles"]
    assert (roles["actor"]["stage"], roles["ref"]["stage"], roles["reward_tiny"]["stage"]) == (3, 3, 3)
    assert roles["actor"]["trainable"] and not roles["ref"]["trainable"] and not roles["reward_tiny"]["trainable"]
    assert "critic" not in roles
    assert [(r["name"], r["weight"], r["kind"]) for r in summary["rewards"]] == [
        ("reward_tiny", 0.1, "model"), ("judge", 1.0, "function"), ("distinct_words", 0.5, "function"),
        ("count_reward", 0.25, "function")]
    weights = {"reward_tiny": 0.1, "judge": 1.0, "distinct_words": 0.5, "count_reward": 0.25}
    for tag in ("before", "after"):  # the held-out reward: each source's mean, and their weighted sum
        parts = {name: m[f"eval/{tag}/reward/{name}"] for name in weights}
        assert m[f"eval/{tag}/reward"] == pytest.approx(sum(w * parts[n] for n, w in weights.items()), abs=1e-5)
        assert 0.0 <= parts["count_reward"] <= 1.0 and parts["judge"] == pytest.approx(m[f"eval/{tag}/judge"])
    assert [e["tag"] for e in summary["evaluations"]] == ["before", "step_2", "after"]
    train = train_lines(out / "metrics.jsonl")
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    for x in train:
        for key in ("train/policy_loss", "train/kl_loss", "train/clip_frac", "train/entropy", "train/reward/group_std"):
            assert key in x, key
        # the rollout's score is the weighted sum of its sources (means are linear); normalisation comes after
        parts = (0.1 * x["train/reward/reward_tiny"] + x["train/reward/judge"] + 0.5 * x["train/reward/distinct_words"]
                 + 0.25 * x["train/reward/count_reward"])
        assert x["train/reward/mean"] == pytest.approx(parts, abs=1e-5)
        assert 0.0 <= x["train/reward/count_reward"] <= 1.0
    assert train[-1]["train/kl"] != 0.0
    assert (out / "sft" / "export" / "actor" / "config.json").is_file()  # the SFT actor was trained first
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    assert (out / "export" / "actor" / "config.json").is_file() and (out / "curves.png").is_file()


def test_grpo_runs_read_every_key(grpo):
    assert_keys_read(grpo["out"], "rlhf_grpo")
    # the resumed run is given the first run's SFT actor and the user's data: no tiny model is built or trained
    assert_keys_read(grpo["resumed"], "rlhf_grpo", ("tiny.hidden", "tiny.layers", "tiny.heads", "actor_sft.config",
                                                    "actor_sft.overrides"))


def test_grpo_resume_continues_bit_for_bit(grpo):
    full = train_lines(grpo["out"] / "metrics.jsonl")
    resumed = train_lines(grpo["resumed"] / "metrics.jsonl")
    assert [x["step"] for x in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        keep = {k: v for k, v in a.items() if not k.startswith(TIMING)}
        assert keep == {k: v for k, v in b.items() if not k.startswith(TIMING)}
    s_full = json.loads((grpo["out"] / "summary.json").read_text())
    s_res = json.loads((grpo["resumed"] / "summary.json").read_text())
    assert s_res["metrics"]["eval/after/judge"] == s_full["metrics"]["eval/after/judge"]
    assert s_res["metrics"]["eval/after/kl"] == s_full["metrics"]["eval/after/kl"]


def test_dpo_cli_with_precomputed_ref_on_the_sft_actor_it_trains_first(tmp_path):
    from multiengine.pipelines.rlhf import tiny

    out, data = tmp_path / "dpo", tmp_path / "pairs"
    tiny.write_builtin_dataset(data, seed=1, n_sft=2000, n_reward=320, n_ppo=16, n_eval=32)  # few pairs to precompute
    cli("rlhf_dpo", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "max_steps=6",
        f"data.source={data}", "roles.actor.stage=2", "roles.ref.stage=3", "dpo.precompute_ref=true",
        "roles.actor.micro_batch_size=8", "roles.actor.grad_accum=2", "roles.actor.lr=1e-3", "data.heldout_size=64",
        "eval.size=16", "eval.batch_size=8", "eval.every=3", "checkpoint.every=3",
        "actor_sft.overrides=[max_steps=5,eval.size=16,eval.greedy=false]")
    # no LoRA adapters (lora.r=0; LoraSettings' other keys have no `when` yet, recipes/language/roles.py)
    assert_keys_read(out, "rlhf_dpo", tuple(f"roles.actor.lora.{k}" for k in ("alpha", "dropout", "target_modules")))
    summary = json.loads((out / "summary.json").read_text())
    m = summary["metrics"]
    for key in ("eval/before/accuracy", "eval/after/accuracy", "eval/after/margin", "eval/after/chosen_reward",
                "eval/after/rejected_reward", "eval/before/judge", "eval/after/judge", "eval/after/kl"):
        assert m.get(key) is not None, key
    assert m["precompute_ref"] and m["precompute_s"] > 0 and m["loss_type"] == "sigmoid"
    # before any step the policy is the ref (at another stage: equal up to rounding): implicit rewards 0, loss ln 2
    assert m["eval/before/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert m["eval/before/margin"] == pytest.approx(0.0, abs=1e-6)
    assert m["eval/after/loss"] < m["eval/before/loss"] and m["eval/after/margin"] > 0
    assert (summary["roles"]["actor"]["stage"], summary["roles"]["ref"]["stage"]) == (2, 3)
    train = train_lines(out / "metrics.jsonl")
    assert [x["step"] for x in train] == list(range(1, 7))
    assert {"train/loss", "train/accuracy", "train/margin", "train/rewards/chosen", "train/lr"} <= set(train[0])
    assert (out / "sft" / "export" / "actor" / "config.json").is_file()  # the SFT actor was trained first
    assert summary["paths"]["actor"] == summary["paths"]["ref"] == str(out / "sft" / "export" / "actor")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert (out / "export" / "actor" / "config.json").is_file() and (out / "curves.png").is_file()


def test_e2e_with_dpo_as_step_3(tmp_path):
    out = tmp_path / "e2e"
    cli("rlhf_e2e", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "algorithm=dpo", "max_steps=2",
        "sft.overrides=[max_steps=3,eval.size=16,eval.every=0,eval.greedy=false,data.heldout_size=16]",
        "dpo.overrides=[eval.size=16,eval.batch_size=8,eval.every=0,data.heldout_size=32]")
    # DPO trains on the pairs directly: no reward-model step, and neither PPO's nor GRPO's step
    assert_keys_read(out, "rlhf_e2e", ("reward.config", "reward.overrides", "reward.init_from_sft",
                                       "model.reward_pretrained", "ppo.config", "ppo.overrides", "grpo.config",
                                       "grpo.overrides"))
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["step_runs"]) == ["rlhf_dpo", "rlhf_sft"] and summary["algorithm"] == "dpo"
    f = summary["figures"]
    assert f["sft/heldout_loss"] is not None and f["dpo/judge_before"] is not None and f["dpo/kl_after"] > 0
    dpo = json.loads((out / "dpo" / "summary.json").read_text())
    assert dpo["metrics"]["steps"] == 2 and dpo["paths"]["actor"] == str(out / "sft" / "export" / "actor")
    assert summary["export"]["actor"]["model"] == str(out / "dpo" / "export" / "actor")
    assert (out / "curves.png").is_file()

"""Llama and Qwen2 through every RLHF recipe (sft, reward, ppo, grpo, dpo, distill) at the tiny configs'
default ZeRO stages on 2 ranks, in one launch; GRPO and DPO learn."""

from __future__ import annotations

import json

import pytest
from conftest import PPO_PLAIN, assert_keys_read, launch

pytestmark = pytest.mark.distributed
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("family_recipes")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok", chat_template=True)
    folders = {f: {"base": str(tiny.build_tiny_causal_lm(root / f, root / "tok", family=f)),
                   "student": str(tiny.build_tiny_causal_lm(root / f"{f}_small", root / "tok", hidden=32, layers=1,
                                                            family=f, seed=1))}
               for f in FAMILIES}
    (root / "folders.json").write_text(json.dumps(folders))
    ranks = launch("family_recipes", root / "out", str(root / "folders.json"))
    return {**ranks[0], "out": root / "out"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rlhf_recipe_runs_at_default_stages(runs, family):
    r = runs[family]
    assert r["sft"]["stages"] == {"actor": 2}
    assert r["reward"]["stages"] == {"reward": 2}
    assert r["ppo"]["stages"] == {"actor": 2, "critic": 2, "ref": 0, "reward": 0}  # frozen at 2 -> built at 0
    assert r["grpo"]["stages"] == {"actor": 3, "ref": 3}
    assert r["dpo"]["stages"] == {"actor": 3, "ref": 3}
    assert r["distill"]["stages"] == {"teacher": 3, "student": 2}
    name = FAMILIES[family]
    assert r["classes"] == {"sft/actor": f"{name}ForCausalLM", "reward/reward": f"{name}ForSequenceClassification",
                            "ppo/critic": f"{name}ForSequenceClassification", "grpo/actor": f"{name}ForCausalLM",
                            "dpo/actor": f"{name}ForCausalLM", "distill/student": f"{name}ForCausalLM"}
    sft, rm = r["sft"]["metrics"], r["reward"]["metrics"]
    assert sft["eval/after/heldout_loss"] < sft["eval/before/heldout_loss"] - 1.0
    assert sft["eval/after/judge"] > sft["eval/before/judge"] + 0.2
    assert rm["heldout_accuracy"] > rm["heldout_accuracy_before"]
    assert r["ppo"]["metrics"]["eval/after/kl"] > 0  # the actor moved
    distill = r["distill"]["metrics"]
    assert distill["eval/after/loss"] < distill["eval/before/loss"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_run_reads_its_keys(runs, family):
    # the SFT actor (the teacher) is given: none is trained first; distill's student too; PPO runs without an EMA or
    # pretraining rows
    sft = ("actor_sft.config", "actor_sft.overrides")
    unread = {"ppo": PPO_PLAIN, "grpo": sft, "dpo": sft,
              "distill": ("teacher_sft.config", "teacher_sft.overrides", "tiny.student_hidden", "tiny.student_layers",
                          "tiny.student_heads")}
    for recipe in ("sft", "reward", "ppo", "grpo", "dpo", "distill"):
        assert_keys_read(runs["out"] / family / recipe, "distill" if recipe == "distill" else f"rlhf_{recipe}",
                         unread.get(recipe, ()))


@pytest.mark.parametrize("family", FAMILIES)
def test_grpo_and_dpo_learn(runs, family):
    grpo, dpo = runs[family]["grpo"]["metrics"], runs[family]["dpo"]["metrics"]
    assert grpo["eval/after/judge"] > grpo["eval/before/judge"] + 0.03, grpo
    assert dpo["eval/before/margin"] == 0.0 and dpo["eval/after/margin"] > 0, dpo
    assert dpo["eval/after/loss"] < dpo["eval/before/loss"] == pytest.approx(0.693147, abs=1e-5), dpo
    assert dpo["eval/after/accuracy"] > 0.55, dpo

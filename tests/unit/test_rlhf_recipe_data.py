"""The RLHF recipes on a user's data, models and tokenizers, in one process: the data keys of docs/data.md
(sources, column mapping, evaluation rows that are never training rows), the checks validate(cfg) makes before
any rank starts (in seconds, no model built), every key's meaning and value checks, rlhf_e2e handing the data
keys to its steps, and conversational data with a chat template through SFT and GRPO on the torch backend."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import DataSettings
from multiengine.pipelines.sources import parse_eval_split
from multiengine.recipes.language.config import (
    RecipeConfigError,
    describe_keys,
    leaves,
    load_config,
    load_recipe,
    recipe_schema,
    validate_config,
)

RECIPES = ("rlhf_sft", "rlhf_reward", "rlhf_ppo", "rlhf_grpo", "rlhf_dpo", "distill")
QUIET = ["plot=false", "tensorboard=false", "checkpoint.every=0", "backend=torch"]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_data")
    paths = tiny.prepare_builtin(root / "tiny", hidden=32, layers=1, n_sft=64, n_reward=64, n_ppo=64, n_eval=16)
    chat_tok = tiny.train_tokenizer(tiny.task_vocabulary(), root / "chat_tok", chat_template=True)
    chat_model = tiny.build_tiny_causal_lm(root / "chat_model", root / "chat_tok", hidden=32, layers=1)
    corpus = tiny.build_corpus(0, n_sft=64, n_reward=16, n_ppo=8, n_eval=8)
    qa = _jsonl(root / "qa.jsonl", [{"question": r["prompt"], "answer": r["response"], "id": i}
                                    for i, r in enumerate(corpus["sft"])])
    chats = _jsonl(root / "chats.jsonl", [{"messages": [{"role": "user", "content": r["prompt"]},
                                                        {"role": "assistant", "content": r["response"]}]}
                                          for r in corpus["sft"]])
    pairs = _jsonl(root / "pairs.jsonl", corpus["reward"])
    return {"root": root, "model": str(paths["model"]), "data": str(paths["data"]), "chat_model": str(chat_model),
            "chat_tok": chat_tok, "qa": qa, "chats": chats, "pairs": pairs}


# --------------------------------------------------------------------------------------------------
# every key has a meaning and a value check
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [*RECIPES, "rlhf_e2e"])
def test_every_key_has_a_meaning_for_help(recipe):
    rows = describe_keys(load_recipe(recipe))
    assert [r["key"] for r in rows if not r["meaning"]] == []
    keys = {r["key"] for r in rows}
    for key in ("data.source", "data.sources", "data.columns.prompt", "data.eval_source", "data.eval_split",
                "data.train_split"):
        assert key in keys


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_number_key_is_checked(recipe):
    keys = leaves(recipe_schema(load_recipe(recipe)))
    unchecked = [k for k, leaf in keys.items() if isinstance(leaf.default, (int, float))
                 and not isinstance(leaf.default, bool) and not leaf.checks]
    assert unchecked == []
    first_role = next(k.split(".")[1] for k in keys if k.startswith("roles."))
    for key in (f"roles.{first_role}.stage", f"roles.{first_role}.dtype", "data.eval_split", "data.max_prompt_len"):
        assert keys[key].checks, key


@pytest.mark.parametrize("override, message", [
    ("data.columns.promt=question", "unknown config key 'data.columns.promt'.*Did you mean 'data.columns.prompt'"),
    ("data.eval_split=-0.1", "'data.eval_split' .* must be auto, none, a fraction in \\(0, 1\\)"),
    ("data.eval_split=1.5", "'data.eval_split' .* must be auto, none, a fraction"),
    ("data.max_prompt_len=0", "'data.max_prompt_len' .* must be >= 1"),
    ("roles.actor.stage=4", "'roles.actor.stage' .* must be in \\[0, 3\\]"),
    ("roles.actor.dtype=fp8", "'roles.actor.dtype' .* must be one of fp32, bf16, fp16"),
    ("roles.actor.scheduler=cosinus", "'roles.actor.scheduler' .* must be a transformers scheduler name"),
    ("roles.actor.lora.dropout=1", "'roles.actor.lora.dropout' .* must be in \\[0, 1\\)"),
])
def test_values_are_checked_when_the_config_loads(override, message):
    with pytest.raises(RecipeConfigError, match=message):
        load_config("rlhf_sft", "tiny", [override])


def test_eval_split_forms():
    def spec(value):
        return parse_eval_split(load_config("rlhf_sft", "tiny", [f"data.eval_split={value}"]).data.eval_split)

    assert (spec("auto"), spec("none"), spec(0.05), spec(200), spec("test")) == ("auto", None, 0.05, 200, "test")


# --------------------------------------------------------------------------------------------------
# validate(cfg): before any rank starts, in seconds
# --------------------------------------------------------------------------------------------------


def _validate(recipe, *overrides):
    validate_config(recipe, load_config(recipe, "tiny", list(overrides)))


VALIDATED = {  # a user's models and data, for each recipe
    "rlhf_sft": ["roles.actor.model={model}", "data.source={qa}", "data.columns.prompt=question",
                 "data.columns.response=answer"],
    "rlhf_dpo": ["roles.actor.model={model}", "data.source={data}", "dpo.precompute_ref=true"],
    "rlhf_ppo": ["roles.actor.model={model}", "roles.reward.model={model}", "data.source={data}", "ppo.ptx_coef=0.1"],
    "distill": ["roles.teacher.model={model}", "roles.student.model={model}", "data.source={data}"],
}


@pytest.mark.parametrize("recipe", list(VALIDATED))
def test_validate_builds_no_model(assets, monkeypatch, recipe):
    import transformers
    from multiengine.pipelines.rlhf.models import ScalarHeadModel

    def refuse(*args, **kwargs):
        raise AssertionError("validate(cfg) built a model")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel,
                transformers.AutoModelForSequenceClassification, ScalarHeadModel):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    values = {k: v for k, v in assets.items() if isinstance(v, str)}
    _validate(recipe, *[o.format(**values) for o in VALIDATED[recipe]])


@pytest.mark.parametrize("recipe, overrides, message", [
    ("rlhf_sft", ["roles.actor.model=./models/my-gpt2"], r"no such folder: ./models/my-gpt2 \(roles.actor.model\)"),
    ("rlhf_ppo", ["roles.actor.model=/nowhere/sft/export/actor"],
     r"no such folder: /nowhere/sft/export/actor \(roles.actor.model\)"),
    ("rlhf_sft", ["data.source={qa}"], r"data.source=.*qa.jsonl.*has columns \['answer', 'id', 'question'\].*"
                                       r"data.columns.prompt=question"),
    ("rlhf_sft", ["data.source={qa}", "data.columns.prompt=quest"], r"column\(s\) \['quest'\].*not in"),
    ("rlhf_reward", ["data.source={qa}", "data.columns.prompt=question"], r"\(reward stage\).*missing"),
    ("rlhf_sft", ["data.source={qa}", "data.columns.prompt=question", "data.columns.response=answer",
                  "data.eval_split=test"], r"single file with no 'test' split; use data.eval_split=0.05"),
    ("rlhf_sft", ["data.source={qa}", "data.columns.prompt=question", "data.columns.response=answer",
                  "data.eval_source={qa}"], r"data.eval_source=.* is also a training source"),
    ("rlhf_sft", ["data.source={missing}"], r"no such file or folder: .*missing.jsonl \(data.source\)"),
    ("rlhf_sft", ["roles.actor.model={model}", "data.source={chats}"],
     r"data.source is conversational .* tokenizer of roles.actor.model .* has no chat template"),
    ("rlhf_sft", ["roles.actor.model={model}", "roles.actor.tokenizer={chat_model}"],
     r"has ids up to .* but the model of roles.actor.model .* embeds only"),
    ("rlhf_ppo", ["roles.actor.model={model}", "roles.reward.model={model}", "roles.reward.tokenizer={chat_model}"],
     r"embeds only"),
    ("rlhf_dpo", ["data.source={pairs}", "data.eval_split=1000"], r"holds out 1000 of .* leaves none to train on"),
])
def test_validate_names_the_key_and_the_fix(assets, recipe, overrides, message):
    values = {k: v for k, v in assets.items() if isinstance(v, str)}
    values["missing"] = str(assets["root"] / "missing.jsonl")
    with pytest.raises(RecipeConfigError, match=message):
        _validate(recipe, *[o.format(**values) for o in overrides])


def test_validate_says_how_the_evaluation_rows_are_made(assets, caplog):
    with caplog.at_level(logging.INFO):
        _validate("rlhf_sft", f"data.source={assets['qa']}", "data.columns.prompt=question",
                  "data.columns.response=answer")
    # one file, no eval source: 5% held out, and the log says so
    assert "data.eval_split=auto" in caplog.text and "3 of its 64 rows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _validate("rlhf_dpo", f"roles.actor.model={assets['model']}", f"data.source={assets['data']}")
    assert f"split 'eval' of {assets['data']}" in caplog.text  # the folder's eval.jsonl


# --------------------------------------------------------------------------------------------------
# rlhf_e2e and the SFT actor of GRPO / DPO get the same data
# --------------------------------------------------------------------------------------------------


def test_data_overrides_give_another_recipe_the_same_data(assets):
    src = load_config("rlhf_dpo", "tiny", [
        f"data.sources=[{{path: {assets['qa']}, weight: 3}}, {{path: {assets['chats']}, weight: 1}}]",
        "data.columns.prompt=question", "data.eval_split=0.1", f"data.eval_source={assets['pairs']}"])
    got = load_config("rlhf_sft", "tiny", src.data.overrides())
    shared = [f.name for f in dataclasses.fields(DataSettings)]  # the loading keys (each recipe has its lengths)
    assert [getattr(got.data, k) for k in shared] == [getattr(src.data, k) for k in shared]
    assert got.data.train_source()[0] == {"path": assets["qa"], "weight": 3}


@pytest.mark.parametrize("algorithm, recipes", [("dpo", ["rlhf_sft", "rlhf_dpo"]),
                                               ("ppo", ["rlhf_sft", "rlhf_reward", "rlhf_ppo"])])
def test_e2e_passes_the_data_keys_to_every_step(assets, tmp_path, monkeypatch, algorithm, recipes):
    from multiengine.recipes import rlhf_e2e

    calls = []

    def fake_step(recipe, config, overrides, out_dir, rerun, decisions):
        calls.append((recipe, overrides))
        return {"metrics": {}, "export": {"actor": {"model": "/sft"}, "reward": {"model": "/rm"}}}

    monkeypatch.setattr(rlhf_e2e, "run_step", fake_step)
    cfg = load_config("rlhf_e2e", "tiny", [f"output_dir={tmp_path}", "backend=torch",
                                           f"model.pretrained={assets['model']}",
                                           f"data.source={assets['qa']}", "data.columns.prompt=question",
                                           "data.columns.response=answer", "data.eval_split=0.1",
                                           f"algorithm={algorithm}"])
    rlhf_e2e.RECIPE.main(cfg)
    assert [c[0] for c in calls] == recipes
    for recipe, overrides in calls:
        assert f"data.source={assets['qa']}" in overrides
        assert "data.columns.prompt=question" in overrides and "data.eval_split=0.1" in overrides
        step = load_config(recipe, "tiny", overrides)  # valid keys for every step
        assert step.data.columns.mapping() == {"prompt": "question", "response": "answer"}


# --------------------------------------------------------------------------------------------------
# conversational data through the recipes (torch backend, one process)
# --------------------------------------------------------------------------------------------------


def test_conversations_through_sft_and_grpo(assets, tmp_path):
    from multiengine.recipes import rlhf_grpo, rlhf_sft

    sft_cfg = load_config("rlhf_sft", "tiny", [
        f"output_dir={tmp_path / 'sft'}", f"roles.actor.model={assets['chat_model']}", f"data.source={assets['chats']}",
        "data.eval_split=8", "max_steps=3", "roles.actor.micro_batch_size=4", "eval.size=8", "eval.batch_size=4",
        "eval.every=0", "eval.greedy=false", "data.max_prompt_len=24", *QUIET])
    validate_config("rlhf_sft", sft_cfg)
    out = rlhf_sft.RECIPE.main(sft_cfg)
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    after = next(e for e in summary["evaluations"] if e["tag"] == "after")
    assert out["metrics"]["eval/after/heldout_loss"] > 0
    # the evaluation prompts are those of the 8 held-out conversations (their last user message, for the judge),
    # and the judge applies: they are the built-in task's prompts
    assert after["samples"] and all(tiny.parse_prompt(p) for p, _ in after["samples"])
    assert out["metrics"]["eval/after/judge"] is not None

    # GRPO on the chat prompts: rendered with add_generation_prompt, answers judged by a function from a file
    fn = tmp_path / "record.py"
    fn.write_text("SEEN = []\n"
                  "def length(prompts, responses):\n"
                  "    SEEN.extend(prompts)\n"
                  "    return [float(len(r.split())) for r in responses]\n")
    grpo_cfg = load_config("rlhf_grpo", "tiny", [
        f"output_dir={tmp_path / 'grpo'}", f"roles.actor.model={out['export']['actor']['model']}",
        f"data.source={assets['chats']}", "data.eval_split=8", f"reward.functions=[{fn}:length]", "max_steps=2",
        "grpo.n_samples_per_prompt=2", "grpo.rollout_batch_size=2", "roles.actor.micro_batch_size=4", "eval.size=4",
        "eval.batch_size=4", "eval.every=0", "roles.actor.dtype=fp32", "data.max_prompt_len=24",
        "checkpoint.keep_last=2", *QUIET])
    validate_config("rlhf_grpo", grpo_cfg)
    run = rlhf_grpo.RLHFGRPO(grpo_cfg)
    run.setup()
    batch = next(run.prompts)
    tok = run.tokenizer
    # the prompt ids end with the chat template's generation prompt, so the actor answers as the assistant
    assert "prompt_messages" in batch
    assert tok.convert_ids_to_tokens(int(batch["input_ids"][0, -1])) == "<|assistant|>"
    assert tok.bos_token_id in batch["input_ids"][0].tolist()
    run.train()
    run.close()
    assert len(run.step_metrics) == 2 and all(m["reward/mean"] >= 0 for m in run.step_metrics)

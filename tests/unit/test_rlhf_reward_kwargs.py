"""Reward functions as TRL users write them (the rows' other columns as keyword arguments, through the sharded
sampler and the n_samples_per_prompt repetition), old positional functions, None for rows a function does not
apply to, the held-out reward per source, and the flat-group warning."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from multiengine.engines import EngineRegistry, OptimSpec, Placement, ShardedBatches, frozen_role, trainable_role
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import PromptCollator, load_rlhf_dataset
from multiengine.pipelines.rlhf.evaluation import PolicyAnswers
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.grpo import FlatGroupWatch, GRPOSettings, GRPOTrainer
from multiengine.pipelines.rlhf.rewards import (
    RewardCall,
    RewardFunctionError,
    call_reward_function,
    check_reward_columns,
    check_sources,
    compute_scores,
    reward_function,
)
from multiengine.pipelines.rlhf.roles import causal_lm
from multiengine.pipelines.rlhf.rollout import RolloutSpec, StepStats, expand_prompts
from multiengine.recipes.language.config import RecipeConfigError, checked_config

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path_factory.mktemp("kwargs_tok"))


def _rows(n: int) -> list[dict]:
    """Task prompts with the count they ask for as an ``answer`` column (a string, as JSONL would give it) and a
    row id; the count also sits in the prompt, so a function can tell whether it got its own row's answer."""
    topics = sorted(tiny.TOPICS)
    return [{"prompt": tiny.make_prompt("list", 1 + i % 5, topics[i % len(topics)]), "answer": str(1 + i % 5),
             "id": i} for i in range(n)]


def _scores(sources, batch, completions, columns=None):
    """compute_scores on texts only (reward functions need no registry): responses of 2 tokens + EOS + pad."""
    B = len(batch["prompts"])
    C = batch["input_ids"].shape[1]
    response = torch.tensor([[5, 6, EOS, PAD]] * B)
    sequences = torch.cat([batch["input_ids"], response], 1)
    attention = torch.cat([batch["attention_mask"], torch.tensor([[1, 1, 1, 0]] * B)], 1)
    return compute_scores(None, sources, sequences, attention, batch["prompts"], completions, context_length=C,
                          columns=batch.get("columns") if columns is None else columns)


def test_answer_column_reaches_each_row_after_sharding_and_repetition(tok):
    rows = _rows(12)
    seen: list[dict] = []

    def count_match(prompts, completions, answer, **kwargs):  # TRL's form
        seen.append({"prompts": prompts, "answer": answer, "kwargs": sorted(kwargs), **kwargs})
        return [float(a) for a in answer]

    src = reward_function(count_match)
    assert src.call == RewardCall(positional=False, names=("prompts", "completions", "answer"),
                                  required=("prompts", "completions", "answer"), var_keyword=True)
    collate = PromptCollator(tok, 16)
    got: dict[int, list[int]] = {}
    for rank in (0, 1):  # two ranks' shards of one sampler, 2 batches of 3 prompts each, 4 answers per prompt
        stream = ShardedBatches(rows, collate, 3, world_size=2, rank=rank, seed=7)
        for _ in range(2):
            batch = expand_prompts(next(stream), 4)
            assert len(batch["columns"]["answer"]) == len(batch["prompts"]) == 12
            total, parts = _scores([src], batch, ["a b"] * 12)
            call = seen[-1]
            # each row's answer is its own prompt's count, in consecutive groups of 4 copies
            assert [tiny.parse_prompt(p)[0] for p in call["prompts"]] == [int(a) for a in call["answer"]]
            assert total.tolist() == [float(a) for a in call["answer"]] == parts["count_match"].tolist()
            assert all(len(set(call["id"][g:g + 4])) == 1 for g in range(0, 12, 4))
            assert call["completion_ids"] == [[5, 6, EOS]] * 12  # up to and including the first EOS
            assert call["kwargs"] == ["completion_ids", "id"]  # every other column, and the ids
            got.setdefault(rank, []).extend(call["id"][::4])
    assert not set(got[0]) & set(got[1]) and len(got[0]) == len(got[1]) == 6  # disjoint shards


def test_a_function_without_kwargs_gets_only_what_it_names(tok):
    calls: list[dict] = []

    def exact(completions, answer, scale=2.0):
        calls.append({"completions": completions, "answer": answer, "scale": scale})
        return [scale * (c == a) for c, a in zip(completions, answer)]

    def texts_only(prompts, responses):  # the project's original form, called by name
        calls.append({"prompts": prompts, "responses": responses})
        return [0.5] * len(prompts)

    batch = PromptCollator(tok, 16)(_rows(3))
    total, parts = _scores([reward_function(exact), reward_function(texts_only, weight=2.0)], batch, ["1", "x", "3"])
    assert calls[0] == {"completions": ["1", "x", "3"], "answer": ["1", "2", "3"], "scale": 2.0}
    assert calls[1] == {"prompts": batch["prompts"], "responses": ["1", "x", "3"]}
    assert parts["exact"].tolist() == [2.0, 0.0, 2.0] and total.tolist() == [3.0, 1.0, 3.0]


def test_positional_functions_still_work(tok):
    batch = PromptCollator(tok, 16)(_rows(2))
    calls: list[tuple] = []

    def old(p, r, answer):  # positional texts, a column by name
        calls.append((p, r, answer))
        return [len(x) for x in r]

    lam = reward_function(lambda ps, rs: [1.0] * len(ps), name="lam")
    assert lam.call.positional and not reward_function(old).call.var_keyword
    total, parts = _scores([lam, reward_function(old)], batch, ["ab", "abc"])
    assert calls == [(batch["prompts"], ["ab", "abc"], ["1", "2"])]
    assert parts["lam"].tolist() == [1.0, 1.0] and total.tolist() == [3.0, 4.0]
    # the built-in judge keeps its (prompts, responses) form
    judged, _ = _scores([reward_function("builtin:judge")], batch, ["apple", "x"])
    assert judged.tolist() == [tiny.judge(p, a) for p, a in zip(batch["prompts"], ["apple", "x"])]


def test_none_means_does_not_apply(tok):
    batch = PromptCollator(tok, 16)(_rows(4))
    src = reward_function(lambda prompts, completions, answer: [None if a == "2" else 1.0 for a in answer],
                          name="some")
    total, parts = _scores([src], batch, ["a"] * 4)
    assert total.tolist() == [1.0, 0.0, 1.0, 1.0] and math.isnan(parts["some"][1])
    stats = StepStats()
    stats.nanmean("m", torch.tensor([1.0, float("nan"), 3.0]))
    stats.nanmean("none", torch.tensor([float("nan")]))
    out = stats.reduce()
    assert out["m"] == 2.0 and math.isnan(out["none"])
    with pytest.raises(ValueError, match="non-finite rewards"):
        _scores([reward_function(lambda prompts, completions: [float("inf")] * 4, name="inf")], batch, ["a"] * 4)


def test_missing_or_clashing_columns_and_bad_signatures_are_named():
    def needs_answer(completions, answer):
        return [0.0] * len(completions)

    sources = [reward_function(needs_answer)]
    check_reward_columns(sources, ["prompt", "answer", "extra"])
    with pytest.raises(ValueError, match=r"'needs_answer' needs \['answer'\].*data.jsonl.*\['solution'\]"):
        check_reward_columns(sources, ["prompt", "solution"], "data.jsonl")
    with pytest.raises(ValueError, match=r"columns \['completions'\], named like reward-function arguments"):
        check_reward_columns(sources, ["prompt", "completions"])
    with pytest.raises(ValueError, match=r"needs \['answer'\], which the rows do not have"):
        call_reward_function(needs_answer, sources[0].call, ["p"], ["c"], {"solution": ["1"]})
    with pytest.raises(ValueError, match=r"cannot take the rows: write it as fn\(prompts, completions, \*\*kwargs\)"):
        reward_function(lambda x: [0.0], name="one_arg")
    with pytest.raises(ValueError, match="returned 1 values for 2 rows"):
        call_reward_function(lambda p, r: [0.0], RewardCall(positional=True), ["a", "b"], ["c", "d"])
    with pytest.raises(ValueError, match="would overwrite the metrics reward/mean"):
        check_sources([reward_function(needs_answer, name="mean")], EngineRegistry(backend="torch"))


def test_validate_refuses_a_function_whose_column_the_data_lacks(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "solution": r["answer"]}) + "\n" for r in _rows(40)))
    (tmp_path / "rw.py").write_text("def exact(completions, answer):\n    return [0.0] * len(completions)\n")
    message = r"'exact' needs \['answer'\].*data.source \(the training rows\).*\['solution'\]"
    with pytest.raises(RecipeConfigError, match=message):
        checked_config("rlhf_grpo", "tiny", [f"data.source={data}", f"reward.functions=[{tmp_path}/rw.py:exact]"])


@pytest.mark.parametrize("overrides, message", [
    (["grpo.flat_warn_share=1.5"], "grpo.flat_warn_share"),
    (["grpo.flat_warn_steps=0"], "grpo.flat_warn_steps"),
])
def test_flat_warning_keys_are_range_checked(overrides, message):
    with pytest.raises(RecipeConfigError, match=message):
        checked_config("rlhf_grpo", "tiny", overrides)


def test_flat_group_watch_warns_once_per_streak():
    watch = FlatGroupWatch(share=0.5, steps=3)
    got = [watch.update(x, n_samples=4, temperature=0.7) for x in (0.9, 0.6, 0.5, 0.9, 0.6, 1.0, 1.0, 1.0)]
    # 0.5 is not more than the share: it ends the first streak; the second reaches 3 at the 6th step
    assert [g is not None for g in got] == [False, False, False, False, False, True, False, False]
    text = got[5]
    for part in ("100% of the prompt groups", "more than 50% for 3 steps", "nothing is learned",
                 "n_samples_per_prompt, now 4", "temperature, now 0.7", "denser reward"):
        assert part in text, part
    assert watch.update(float("nan")) is None and watch.streak == 0  # a NaN share breaks a streak
    watch.load_state_dict({"streak": 2})
    assert watch.update(0.9) is not None  # a resumed streak continues
    assert FlatGroupWatch(share=1.0, steps=1).update(1.0) is None  # share 1: never
    for share, steps in ((-0.1, 3), (1.1, 3), (0.5, 0)):
        with pytest.raises(ValueError, match="flat_warn"):
            GRPOSettings(flat_warn_share=share, flat_warn_steps=steps)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("kwargs_assets")
    paths = tiny.prepare_builtin(root, hidden=32, layers=1, n_sft=8, n_reward=8, n_ppo=16, n_eval=8)
    from transformers import AutoTokenizer

    return {**paths, "tok": AutoTokenizer.from_pretrained(str(paths["tokenizer"]))}


def _registry(assets) -> EngineRegistry:
    registry = EngineRegistry(backend="torch")
    model = str(assets["model"])
    registry.add(trainable_role("actor", causal_lm(model), Placement(0, "fp32"), OptimSpec(lr=1e-2, total_steps=4),
                                micro_batch_size=4))
    registry.add(frozen_role("ref", causal_lm(model), Placement(0, "fp32")))
    return registry.build()


def test_grpo_warns_when_every_group_is_flat_and_evaluation_reports_each_source(assets, caplog):
    tok = assets["tok"]
    registry = _registry(assets)
    decode = lambda ids: tok.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
    constant = reward_function(lambda prompts, completions, **kw: [1.0] * len(prompts), name="constant")
    answer = reward_function(lambda completions, answer: [float(a) for a in answer], name="answer", weight=0.5)
    trainer = GRPOTrainer(registry, GRPOSettings(n_samples_per_prompt=2, rollout_batch_size=2, flat_warn_share=0.5,
                                                 flat_warn_steps=2),
                          RolloutSpec(GenerationSettings(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id,
                                      [constant], decode), 4)
    batch = PromptCollator(tok, 16)(_rows(2))
    def warnings() -> list[logging.LogRecord]:  # other tests may have switched the project's INFO logs on
        return [r for r in caplog.records if r.name.endswith("rlhf.grpo") and r.levelno >= logging.WARNING]

    with caplog.at_level(logging.WARNING, logger="multiengine.pipelines.rlhf.grpo"):
        first = trainer.step(batch, 0)
        assert first["reward/flat_groups"] == 1.0 and first["reward/constant"] == 1.0 and not warnings()
        trainer.step(batch, 1)
    assert len(warnings()) == 1 and "nothing is learned" in warnings()[0].getMessage()
    assert trainer.state_dict()["flat_watch"] == {"streak": 2}

    # held-out reward: the weighted sum and each source's mean, the column read per evaluation row
    rows = _rows(6)
    batches = [PromptCollator(tok, 16)(rows[:4]), PromptCollator(tok, 16)(rows[4:])]
    out = PolicyAnswers(registry, batches, tok, GenerationSettings(max_new_tokens=4))(rewards=[constant, answer])
    counts = [float(r["answer"]) for r in rows]
    assert out["reward/constant"] == 1.0 and out["reward/answer"] == pytest.approx(sum(counts) / 6)
    assert out["reward"] == pytest.approx(1.0 + 0.5 * sum(counts) / 6)


def test_prompt_rows_from_a_file_carry_their_columns(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    ds = load_rlhf_dataset(path, "ppo")
    batch = PromptCollator(tok, 16)([ds[i] for i in range(3)])
    assert batch["columns"] == {"answer": ["1", "2", "3"], "id": [0, 1, 2]}
    assert "columns" not in PromptCollator(tok, 16)([{"prompt": "list 3 fruits :"}])


def test_the_docs_example_reads_the_answer_column(tok):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "rlhf.md").read_text(encoding="utf-8")
    code = re.search(r"<!-- reward-function example -->\n```python\n(.*?)```", doc, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/rlhf.md reward-function example", "exec"), namespace)  # noqa: S102 - our own docs
    exact, dense = reward_function(namespace["exact_answer"]), reward_function(namespace["ends_with_number"])
    assert exact.call.var_keyword and dense.call.names == ("completions",)
    batch = PromptCollator(tok, 16)(_rows(3))  # answers "1", "2", "3"
    total, parts = _scores([exact, reward_function(namespace["ends_with_number"], weight=0.2)], batch,
                           ["so 1", "it is 3", "no number"])
    assert parts["exact_answer"].tolist() == [1.0, 0.0, 0.0]
    assert parts["ends_with_number"].tolist() == [0.5, 0.5, 0.0]
    assert total.tolist() == pytest.approx([1.1, 0.1, 0.0])


def test_a_reward_function_that_raises_or_returns_junk_is_one_user_error_naming_it():
    """Reported by the CLI as one `error:` line with exit 2 (a ConfigError), naming the function and what it
    raised; the rank's traceback keeps the function's own frames."""
    from multiengine.engines import ConfigError

    def parse(prompts, completions, **kwargs):
        raise KeyError("answer")

    src = reward_function(parse)
    with pytest.raises(RewardFunctionError, match=r"reward function 'parse' raised KeyError: 'answer'") as info:
        call_reward_function(parse, src.call, ["p"], ["c"])
    assert isinstance(info.value, ConfigError) and isinstance(info.value.__cause__, KeyError)
    assert "fix the reward function" in RewardFunctionError.fix
    for junk, fragment in ((["x"], "not a number"), ([1.0, 2.0], "returned 2 values for 1 rows"), (3.0, "float")):
        with pytest.raises(RewardFunctionError, match=fragment):
            call_reward_function(lambda prompts, completions, j=junk: j, RewardCall.of(lambda prompts, completions: 0,
                                                                                      "j"), ["p"], ["c"])

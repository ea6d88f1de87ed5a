"""The registry on 2 real ranks: DeepSpeed's CPU accelerator, gloo, no mocks. Partitioning, stages, several
trainable roles, checkpoints; whole-parameter access with coalesced collectives (workers/coalesced_gather.py); every
setting the project means written into the engine config, read back from built engines on both backends at ZeRO
0/1/2/3, and one SGD step with clipping off / at 0.5 equal to plain PyTorch; backward through a trainable role
without updating it (a GAN's generator step), and one loss over both roles, at every mix of ZeRO stages 0/2/3 and
on the torch backend: every step equals plain PyTorch."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import launch, launch_jobs

pytestmark = pytest.mark.distributed
MIXES = [("deepspeed", g, d) for g in (0, 2, 3) for d in (0, 2, 3)] + [("torch", 0, 0)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, tiny_models):
    """The workers that need no fresh process, in one launch."""
    return launch_jobs(tmp_path_factory.mktemp("registry"), {
        "zero3_roles": ("zero3_roles",), "mixed_stages": ("mixed_stages", json.dumps(tiny_models)),
        "stage_equivalence": ("stage_equivalence",), "two_trainables_deepspeed": ("two_trainables", "deepspeed"),
        "two_trainables_torch": ("two_trainables", "torch"), "coalesced_gather": ("coalesced_gather",),
        "explicit_settings": ("explicit_settings",), "gan_through": ("gan_through",)})


@pytest.fixture(scope="module")
def explicit(jobs):
    return jobs["explicit_settings"]


@pytest.fixture(scope="module")
def gan(jobs):
    return jobs["gan_through"]


def test_stage3_trainable_and_frozen_roles_are_partitioned(jobs):
    ranks = jobs["zero3_roles"]
    for r in ranks:
        for name in ("policy", "frozen"):
            role = r["per_role"][name]
            # Each rank holds its half (DeepSpeed pads each tensor's partition to a multiple of N).
            assert role["total"] == 64 * 64 * 3 + 64 * 3 + 64 + 1
            assert abs(role["local"] - role["total"] / 2) <= 8, role
            assert r["partitioned_at_build"][name] is True  # zero.Init was active inside model()
            assert role["shapes_inside_gather"][0] == [64, 64]
            assert all(0 in shape for shape in map(tuple, role["shapes_outside_gather"]))
        assert r["policy_changed"] > 1e-3
        assert r["ema_error"] < 1e-6  # updated on local partitions, no full copy
        assert r["gathered_error"] == 0.0 and r["gathered_released"] is True  # gather_forward: same output, 1/N after
        assert r["ema_local"] == r["per_role"]["policy"]["local"]
        assert r["frozen_changed"] == 0.0
        assert r["frozen_output_requires_grad"] is False
        assert r["frozen_requires_grad"] is False
        assert r["frozen_training_mode"] is False
        assert r["frozen_optimizer"] != "AdamW"
        rows = {row["role"]: row for row in r["report"]}
        assert rows["policy"]["trainable"] and not rows["frozen"]["trainable"]
        assert rows["frozen"]["grad_bytes"] == 0 and rows["frozen"]["optimizer_bytes"] == 0
        assert rows["policy"]["optimizer_bytes"] > 0
        assert 0.45 < rows["frozen"]["local_fraction"] < 0.55
        assert "policy" in r["report_text"] and "frozen" in r["report_text"]
    # The same loss on both ranks would mean the data were not per rank.
    assert ranks[0]["losses"] != ranks[1]["losses"]


def test_mixed_stages_from_pretrained(jobs, tiny_models):
    ranks = jobs["mixed_stages"]
    for r in ranks:
        assert r["partitioned"] == {"actor": True, "reward": False, "encoder": False, "unet": True}
        assert r["stages"] == {"actor": 3, "reward": 0, "encoder": 0, "unet": 3}
        assert "stage 2 requested" in r["notes"]["reward"]
        # HfDeepSpeedConfig lives only while a stage-3 role builds.
        assert r["zero3_flag_during_build"] == {"actor": True, "reward": False, "encoder": False, "unet": True}
        assert r["zero3_flag_after_build"] is False
        assert 0.45 < r["local_fraction"]["actor"] < 0.55
        assert 0.45 < r["local_fraction"]["unet"] < 0.55
        assert r["local_fraction"]["reward"] == 1.0
        for name, err in r["errors"].items():
            assert err < 1e-4, (name, err)
    # Exports after ZeRO-3 hold full tensors (not the empty shards) and load with the real clients.
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import AutoModelForCausalLM

    for cls, role, source in ((AutoModelForCausalLM, "actor", "opt"), (UNet2DConditionModel, "unet", "unet")):
        exported = cls.from_pretrained(ranks[0]["exported"][role])
        original = cls.from_pretrained(tiny_models[source])
        for (name, a), b in zip(exported.named_parameters(), original.parameters()):
            assert a.shape == b.shape and torch.equal(a, b), name


def test_losses_match_across_zero_stages(jobs):
    ranks = jobs["stage_equivalence"]
    losses = ranks[0]["losses"]
    assert losses["s0"][-1] < losses["s0"][0]  # it learns
    for stage in ("s2", "s3"):
        for a, b in zip(losses["s0"], losses[stage]):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6), (stage, losses)
    assert ranks[0]["train_batch_size"] == {"s0": 16, "s2": 16, "s3": 16}


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_several_trainable_roles(jobs, backend):
    ranks = jobs[f"two_trainables_{backend}"]
    for r in ranks:
        assert r["backend"] == backend
        assert r["a_after_one_micro"] == 0.0  # accumulation 2: no update after one micro batch
        assert r["a_after_boundary"] > 1e-4
        assert r["b_phase1"] == 0.0 and r["z_phase1"] == 0.0  # a's step touches only a
        assert r["a_phase2"] == 0.0
        assert r["b_phase2"] > 0.0
        assert r["z_phase2"] == 0.0  # lr 0 stays unchanged
        assert r["b_update_norm"] <= 2 * 0.5 * 0.01 * 1.001  # two clipped SGD steps
        assert r["lr_a"] == pytest.approx([0.005, 0.0025])
        assert r["train_batch_size"] == {"a": 8, "b": 8, "z": 6}
        assert r["gas"] == {"a": 2, "b": 1, "z": 1}
    # Data-parallel replicas stay identical although each rank saw different data.
    assert ranks[0]["a_param_sum"] == pytest.approx(ranks[1]["a_param_sum"], abs=1e-5)


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_resume_continues_identically(tmp_path, backend):
    ckpt = tmp_path / "ckpt"
    full = launch("ckpt", tmp_path / "full", "full", str(ckpt), backend)  # saves after step 3 and goes on
    assert (ckpt / "latest").read_text() == "step_00000003"
    manifest = json.loads((ckpt / "step_00000003" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and set(manifest["roles"]) == {"actor", "critic"}
    assert manifest["frozen_roles"] == ["ref", "ema"] and manifest["stateful_roles"] == ["ema"]
    assert not (ckpt / "step_00000003" / "ref").exists()  # frozen roles are rebuilt from source
    resumed = launch("ckpt", tmp_path / "p2", "part2", str(ckpt), backend)
    for r_full, r_res in zip(full, resumed):
        assert r_full["save_changed"] == []  # the run that saved went on as if it had not
        assert r_res["client_state"] == {"step": 3, "data_position": 3}
        assert r_res["losses"] == pytest.approx(r_full["losses"][6:], rel=1e-5)
        for name in ("actor", "critic", "ema"):
            assert r_res["params"][name] == pytest.approx(r_full["params"][name], rel=1e-5, abs=1e-6)


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch("ckpt", tmp_path / "crash", "crash", str(ckpt), "deepspeed", expect_fail=True)
    before = json.loads((tmp_path / "crash" / "rank0.json").read_text())
    assert (ckpt / "latest").read_text() == "step_00000002"
    assert (ckpt / ".tmp-step_00000003").is_dir()  # the half-written save, never pointed to
    ranks = launch("ckpt", tmp_path / "verify", "verify", str(ckpt), "deepspeed")
    for r in ranks:
        assert r["client_state"]["step"] == 2
        assert r["params"]["actor"] == pytest.approx(before["params_at_2"]["actor"], rel=1e-6)
        assert "trains ['actor']" in r["errors"]["roles"]
    world = launch("ckpt", tmp_path / "world", "world", str(ckpt), "deepspeed", nproc=1)
    assert "written by 2 ranks, this run has 1" in world[0]["error"]


# --- coalesced gathers -----------------------------------------------------------------------------------
# MLP(width 64, depth 3): weights 64x64 (x3) and 1x64, biases 64 (x3) and 1; ZeRO-3 keeps the tensors of at
# most 10 x 64 elements whole on every rank (persistent): all but the three 64x64 weights.
PERSIST = [False, True, False, True, False, True, True, True]


def test_gathers_are_coalesced_and_leave_persistent_tensors_whole(jobs):
    ranks = jobs["coalesced_gather"]
    for r in ranks:
        assert r["before"]["persist"] == PERSIST
        assert r["before"]["whole"] == PERSIST  # after optimizer steps, as ZeRO-3 leaves them
        assert r["one_role"] == {"all_gather": 1, "total": 1}  # DeepSpeed's GatheredParameters: one per tensor
        assert r["inside_whole"] and r["values_equal"]
        assert r["after"]["whole"] == PERSIST  # back to 1/N, persistent ones still whole
        assert r["two_roles"] == {"all_gather": 1, "total": 1}
        assert r["nested"] == {"total": 0, "whole_after_inner": True}
        m = r["modifier"]
        assert m["broadcast"] == 1 and m["all_equal"]
        assert m["values"] == [10.0 + k for k in range(8)]  # rank 0's, on both ranks
        assert m["state"]["whole"] == PERSIST
        assert m["forward"] == pytest.approx(m["by_hand"], abs=1e-5)
        assert r["error_released"]["whole"] == PERSIST and r["error_values_equal"]
        assert r["partitioned_tensors"] == 3
        # two 64x64 weights (+ a bias) fit, the third not; or one each
        assert r["bucket_8256"] == 2 and r["bucket_1"] == 3
        g = r["gather_forward"]
        assert g["all_gather"] == 1 and g["equal"] and g["state"]["whole"] == PERSIST
        assert r["losses"]["policy"] == r["losses"]["twin"] and r["final_equal"]
    assert ranks[0]["losses"] != ranks[1]["losses"]


# --- settings written into the engine config ---------------------------------------------------------------
def _max_diff(a, b) -> float:
    return max((torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_engine_reports_the_role_spec_and_steps_like_plain_pytorch(explicit, backend, stage, clip):
    for rank in explicit:
        r = rank[f"{backend}/s{stage}_c{int(clip * 10)}"]
        assert (r["clip"], r["config_clip"]) == (clip, clip)
        assert (r["bf16"], r["fp16"], r["accum"], r["micro"], r["lr"]) == (False, False, 1, 4, 0.1)
        assert r["optimizer"] == "SGD"
        ref = rank[f"reference/{clip}"]
        assert ref["grad_norm"] > 10  # clipping at 0.5 (or DeepSpeed's default 1.0) would change the step
        assert _max_diff(r["params"], ref["params"]) < 1e-5


@pytest.mark.parametrize("backend", ["deepspeed", "torch"])
def test_a_config_without_gradient_clipping_clips_alike_on_both_backends(explicit, backend):
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    for rank in explicit:
        r = rank[f"{backend}/own"]
        assert r["clip"] == r["config_clip"] == GRADIENT_CLIPPING_DEFAULT
        assert _max_diff(r["params"], rank[f"reference/{float(GRADIENT_CLIPPING_DEFAULT)}"]["params"]) < 1e-5


# --- backward through a role that is not stepped ---------------------------------------------------------------
@pytest.mark.parametrize("how", ["through", "by_hand", "joint"])
@pytest.mark.parametrize(("backend", "g", "d"), MIXES)
def test_gan_steps_equal_plain_pytorch(gan, backend, g, d, how):
    for rank in gan:
        r = rank[f"{backend}/g{g}/d{d}/{how}"]
        assert r["gen"] < 1e-5 and r["disc"] < 1e-5 and r["gen_grad"] < 1e-5, r
        if how == "joint":
            assert r["disc_moved_by_gen_step"] > 1e-4, r  # the discriminator learned from the same loss
        else:
            assert r["disc_moved_by_gen_step"] == 0.0, r


@pytest.mark.parametrize("key", [f"deepspeed/g2/d{d}/{how}/acc2" for d in (0, 3) for how in ("through", "by_hand")]
                         + ["torch/g0/d0/through/acc2"])
def test_a_discriminator_accumulating_two_micro_batches_passes_gradients_unscaled(gan, key):
    for rank in gan:
        r = rank[key]
        assert r["gen"] < 1e-5 and r["disc"] < 1e-5 and r["gen_grad"] < 1e-5, r
        assert r["disc_moved_by_gen_step"] == 0.0, r


def test_a_loss_through_an_unlisted_trainable_role_is_refused_with_the_fix(gan):
    errors = gan[0]["errors"]
    assert errors["engine"].startswith("JointLossError") and "through=['disc']" in errors["engine"]
    assert errors["unlisted"].startswith("JointLossError") and "through=" in errors["unlisted"]
    assert errors["both"].startswith("ConfigError") and "['disc'] are in both roles and through" in errors["both"]

"""Backward through a trainable role without updating it (a GAN's generator step), and one loss over both
roles, at every mix of ZeRO stages 0/2/3 and on the torch backend: every step equals plain PyTorch."""

from __future__ import annotations

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed
MIXES = [("deepspeed", g, d) for g in (0, 2, 3) for d in (0, 2, 3)] + [("torch", 0, 0)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("gan_through", tmp_path_factory.mktemp("gan_through"))


@pytest.mark.parametrize("how", ["through", "by_hand", "joint"])
@pytest.mark.parametrize(("backend", "g", "d"), MIXES)
def test_gan_steps_equal_plain_pytorch(ranks, backend, g, d, how):
    for rank in ranks:
        r = rank[f"{backend}/g{g}/d{d}/{how}"]
        assert r["gen"] < 1e-5 and r["disc"] < 1e-5 and r["gen_grad"] < 1e-5, r
        if how == "joint":
            assert r["disc_moved_by_gen_step"] > 1e-4, r  # the discriminator learned from the same loss
        else:
            assert r["disc_moved_by_gen_step"] == 0.0, r


@pytest.mark.parametrize("key", [f"deepspeed/g2/d{d}/{how}/acc2" for d in (0, 3) for how in ("through", "by_hand")]
                         + ["torch/g0/d0/through/acc2"])
def test_a_discriminator_accumulating_two_micro_batches_passes_gradients_unscaled(ranks, key):
    for rank in ranks:
        r = rank[key]
        assert r["gen"] < 1e-5 and r["disc"] < 1e-5 and r["gen_grad"] < 1e-5, r
        assert r["disc_moved_by_gen_step"] == 0.0, r


def test_a_loss_through_an_unlisted_trainable_role_is_refused_with_the_fix(ranks):
    errors = ranks[0]["errors"]
    assert errors["engine"].startswith("JointLossError") and "through=['disc']" in errors["engine"]
    assert errors["unlisted"].startswith("JointLossError") and "through=" in errors["unlisted"]
    assert errors["both"].startswith("ConfigError") and "['disc'] are in both roles and through" in errors["both"]

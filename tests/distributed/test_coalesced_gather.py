"""Whole-parameter access with coalesced collectives on 2 real ranks (see workers/coalesced_gather.py)."""

from __future__ import annotations

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed

# MLP(width 64, depth 3): weights 64x64 (x3) and 1x64, biases 64 (x3) and 1; ZeRO-3 keeps the tensors of at
# most 10 x 64 elements whole on every rank (persistent): all but the three 64x64 weights.
PERSIST = [False, True, False, True, False, True, True, True]


def test_gathers_are_coalesced_and_leave_persistent_tensors_whole(tmp_path):
    ranks = launch("coalesced_gather", tmp_path)
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

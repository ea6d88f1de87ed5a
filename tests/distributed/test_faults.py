"""Faults on 2 real ranks: crafted checkpoints, a kill inside a re-save, a stopped rank, stop signals,
a lost launcher, and a stale JIT build lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed

CLI = [sys.executable, "-m", "multiengine.recipes.cli"]


# --- crafted checkpoints ------------------------------------------------------------------------
def test_malicious_pickle_in_any_checkpoint_file_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    prepared = launch("faults_ckpt", tmp_path / "prepare", "prepare", str(ckpt))
    ranks = launch("faults_ckpt", tmp_path / "poison", "poison", str(ckpt))
    kinds = ranks[0]["kinds"]
    # Every file the loader reads: ours (JSON + safetensors) and each DeepSpeed file of both roles.
    expected = {
        "manifest.json",
        "client_state/rank_{r}.json", "client_state/rank_{r}.safetensors",
        "rng/rank_{r}.json", "rng/rank_{r}.safetensors",
        "ema/rank_{r}.json", "ema/rank_{r}.safetensors",
        "actor/state/zero_pp_rank_{r}_mp_rank_00_model_states.pt",  # ZeRO-3: model states per rank
        "actor/state/zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        "critic/state/mp_rank_00_model_states.pt",  # ZeRO-2 (bf16)
        "critic/state/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
    }
    assert set(kinds) == expected, kinds
    for r in ranks:
        for kind in kinds:
            refused = r["refused"][kind]
            assert refused is not None, f"{kind} with a malicious pickle was loaded"
            assert refused["type"] in ("CheckpointError", "UnsafeCheckpointError"), refused
            assert os.path.basename(kind).split("{r}")[0] in refused["message"], (kind, refused["message"])
            if kind.endswith(".pt"):
                assert refused["type"] == "UnsafeCheckpointError" and "GLOBAL exec" in refused["message"], refused
        assert "format 1" in r["old_format"] and "pickle" in r["old_format"]
        assert r["markers"] == [], "unpickling ran the attacker's code"
        # The clean checkpoint still loads: the allow-list covers what DeepSpeed really writes.
        assert r["client_state"] == {"step": 2, "note": "clean"}
    for p, q in zip(prepared, ranks):
        for role in ("actor", "critic", "ema"):
            assert q["params"][role] == pytest.approx(p["params"][role], rel=1e-6)


def test_kill_while_resaving_the_latest_tag_keeps_latest_loadable(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch("faults_ckpt", tmp_path / "resave", "resave", str(ckpt), expect_fail=True)
    before = json.loads((tmp_path / "resave" / "rank0.json").read_text())
    assert before["entries_after_resave"] == ["latest", "same"]  # a normal re-save leaves no aside copy
    # Killed after the old 'same' was removed, before the new one was renamed in: `latest` names the aside copy.
    assert (ckpt / "latest").read_text() == ".old-same"
    assert not (ckpt / "same").exists() and (ckpt / ".tmp-same").is_dir()
    ranks = launch("faults_ckpt", tmp_path / "verify", "verify", str(ckpt))
    for r in ranks:
        assert r["client_state"] == {"step": 2}
        for role in ("actor", "critic", "ema"):
            assert r["params"][role] == pytest.approx(before["params_at_2"][role], rel=1e-6)
        # The next save clears the aside copy and the stale temp folder of the same tag stays harmless.
        assert r["latest_after_next"] == "next"
        assert ".old-same" not in r["entries_after_next"]

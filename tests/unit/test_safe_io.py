"""Checkpoint state without pickle: the JSON + safetensors tree, the torch backend's files, the
restricted torch.load, and refusal of crafted files (their code must never run)."""

from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch
from multiengine.engines.checkpoint import rng_state, set_rng_state
from multiengine.engines.safe_io import (
    CheckpointError,
    UnsafeCheckpointError,
    load_tree,
    safe_torch_load,
    save_tree,
)
from multiengine.engines.torch_backend import TorchEngine


class Evil:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def _draws():
    return (random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.standard_normal()),
            torch.rand(3).tolist(), torch.randn(2).tolist())


def test_rng_states_round_trip_bit_exact(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()  # leave the generators mid-stream, with cached gaussians
    random.gauss(0, 1)
    np.random.standard_normal()
    save_tree(rng_state(), str(tmp_path / "rng"))
    expected = _draws()
    _draws()  # move on, then restore
    set_rng_state(load_tree(str(tmp_path / "rng")))
    assert _draws() == expected


def test_tree_keeps_types_and_values(tmp_path):
    w = torch.randn(4, 4)
    state = {
        "step": 7, "big": 2**70, "lr": 1e-3, "neg_zero": -0.0, "flags": [True, None, "s"],
        "nonfinite": [float("nan"), float("inf"), float("-inf")],
        "tuple": (1, (2, 3)), "int_keys": {0: "a", 5: {"x": 1}}, "tuple_keys": {(1, 2): "t"},
        "np": {"f64": np.float64(0.1), "i32": np.int32(-3), "b": np.bool_(True),
               "arr": np.arange(6, dtype=np.uint16).reshape(2, 3)},
        "tied": [w, w], "row": w[1], "transposed": w.t(), "bf16": torch.randn(3, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 2), "scalar": torch.tensor(2.5), "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
        "__me__": "a user key that looks like our tag",
    }
    save_tree(state, str(tmp_path / "s"))
    doc = json.loads((tmp_path / "s.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert doc["format"] == "multiengine-tree-1"
    back = load_tree(str(tmp_path / "s"))
    assert back["step"] == 7 and back["big"] == 2**70 and back["lr"] == 1e-3
    assert str(back["neg_zero"]) == "-0.0" and back["flags"] == [True, None, "s"]
    assert np.isnan(back["nonfinite"][0]) and back["nonfinite"][1:] == [float("inf"), float("-inf")]
    assert back["tuple"] == (1, (2, 3)) and back["int_keys"] == {0: "a", 5: {"x": 1}}
    assert back["tuple_keys"] == {(1, 2): "t"} and back["__me__"] == state["__me__"]
    assert type(back["np"]["f64"]) is np.float64 and back["np"]["f64"] == np.float64(0.1)
    assert type(back["np"]["i32"]) is np.int32 and back["np"]["i32"] == -3 and back["np"]["b"] is np.True_
    assert back["np"]["arr"].dtype == np.uint16 and (back["np"]["arr"] == state["np"]["arr"]).all()
    assert back["tied"][0] is back["tied"][1] and torch.equal(back["tied"][0], w)  # stored once
    assert torch.equal(back["row"], w[1]) and torch.equal(back["transposed"], w.t())
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], state["bf16"])
    assert back["empty"].shape == (0, 2) and back["scalar"].item() == 2.5
    assert back["size"] == torch.Size([2, 3]) and isinstance(back["size"], torch.Size)
    assert back["dtype"] is torch.bfloat16


def test_unstorable_value_is_refused_at_save_with_its_path(tmp_path):
    class Sampler:
        pass

    with pytest.raises(TypeError, match=r"client state sampler\.inner holds a .*Sampler.*state_dict"):
        save_tree({"sampler": {"inner": Sampler()}}, str(tmp_path / "c"), what="client state")
    with pytest.raises(TypeError, match="numpy array of Python objects"):
        save_tree({"a": np.array([object()])}, str(tmp_path / "c"))


@pytest.mark.parametrize("target", [".json", ".safetensors"])
def test_pickle_in_place_of_a_state_file_is_refused(tmp_path, target):
    base = str(tmp_path / "state")
    save_tree({"step": 1, "t": torch.ones(2)}, base)
    marker = tmp_path / "marker"
    with open(base + target, "wb") as f:
        pickle.dump({"step": Evil(marker)}, f)
    with pytest.raises(CheckpointError, match=rf"state\{target}"):
        load_tree(base)
    assert not marker.exists()


def test_safe_torch_load_refuses_code_and_allows_listed_classes(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"w": torch.ones(2), "x": Evil(marker)}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.pt.*GLOBAL exec"):
        safe_torch_load(str(tmp_path / "evil.pt"))
    assert not marker.exists()
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    torch.save({"scaler": LossScaler(2.0), "w": torch.ones(2)}, tmp_path / "ok.pt")
    with pytest.raises(UnsafeCheckpointError, match="LossScaler"):
        safe_torch_load(str(tmp_path / "ok.pt"))  # not listed for this call
    loaded = safe_torch_load(str(tmp_path / "ok.pt"), allow=[LossScaler])
    assert loaded["scaler"].cur_scale == 2.0
    assert LossScaler not in torch.serialization.get_safe_globals()  # scoped to the call, nothing left behind


def _engine(seed: int = 0) -> TorchEngine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    config = {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
              "gradient_clipping": 1.0}
    return TorchEngine(model, config, torch.device("cpu"), opt, sched)


def _steps(engine: TorchEngine, n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = engine(torch.randn(2, 8, generator=g)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_torch_engine_checkpoint_round_trip_continues_identically(tmp_path):
    a = _engine()
    _steps(a, 3, seed=1)
    a.save_checkpoint(str(tmp_path), "state", client_state={"k": 1})
    lr_at_save = a.get_lr()
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["torch_engine.json", "torch_engine.safetensors"]
    expected = _steps(a, 3, seed=2)
    b = _engine(seed=99)  # different initial weights: everything must come from the file
    path, client = b.load_checkpoint(str(tmp_path), "state")
    assert client == {"k": 1} and b.global_steps == 3 and b.get_lr() == lr_at_save
    assert _steps(b, 3, seed=2) == expected
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("target", ["torch_engine.json", "torch_engine.safetensors"])
def test_torch_engine_refuses_a_crafted_file(tmp_path, target):
    a = _engine()
    _steps(a, 1, seed=1)
    a.save_checkpoint(str(tmp_path), "state")
    marker = tmp_path / "marker"
    with open(tmp_path / "state" / target, "wb") as f:
        pickle.dump(Evil(marker), f)
    with pytest.raises(CheckpointError, match=target.replace(".", r"\.")):
        _engine().load_checkpoint(str(tmp_path), "state")
    assert not marker.exists()
    # A checkpoint of the old pickle format is not read either: its file is simply not ours.
    (tmp_path / "state" / target).unlink()
    torch.save({"module": Evil(marker)}, tmp_path / "state" / "torch_engine.pt")
    with pytest.raises(CheckpointError, match="missing"):
        _engine().load_checkpoint(str(tmp_path), "state")
    assert not marker.exists()


def test_no_unrestricted_unpickling_or_remote_code_in_the_library():
    """A guard for the rules: nothing in engines/, pipelines/ or recipes/ unpickles without
    restriction or turns on trust_remote_code (a switch for it, if ever added, must default to off)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("engines", "pipelines", "recipes"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            for bad in ("weights_only=False", "pickle.load(", "pickle.loads(", "trust_remote_code=True"):
                if bad in text:
                    offenders.append(f"{path.relative_to(root)}: {bad}")
    assert offenders == []

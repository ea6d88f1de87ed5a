"""EMA decay and update equal diffusers' EMAModel, step by step, for its option sets."""

from __future__ import annotations

import pytest
import torch
from multiengine.engines import ema_decay, ema_update

SETTINGS = [
    {},  # diffusers' defaults: use_ema_warmup=False -> (1 + s) / (10 + s), capped at 0.9999
    {"use_ema_warmup": True},  # 1 - (1 + s)^(-2/3)
    {"use_ema_warmup": True, "inv_gamma": 2.0, "power": 0.75, "decay": 0.9},
    {"use_ema_warmup": False, "decay": 0.5, "min_decay": 0.2, "update_after_step": 3},
    {"use_ema_warmup": True, "min_decay": 0.3, "update_after_step": 2, "inv_gamma": 0.5, "power": 1.0},
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_decay_equals_emamodel_get_decay(options):
    from diffusers.training_utils import EMAModel

    ema = EMAModel([torch.nn.Parameter(torch.zeros(1))], **options)
    for step in range(0, 60):
        assert ema_decay(step, **options) == pytest.approx(ema.get_decay(step), abs=0, rel=1e-15), step


def test_decay_hand_values():
    # Step 1 (the first optimizer step): s = 0 -> 0, the EMA copies the weights.
    assert ema_decay(1) == 0.0 and ema_decay(1, use_ema_warmup=True) == 0.0
    assert ema_decay(2) == pytest.approx(2 / 11)  # s = 1
    assert ema_decay(2, use_ema_warmup=True) == pytest.approx(1 - 2 ** (-2 / 3))
    assert ema_decay(8, use_ema_warmup=True, power=1.0) == pytest.approx(1 - 1 / 8)  # s = 7: 1 - 1/(1+7)
    assert ema_decay(10**9) == 0.9999  # capped at decay
    assert ema_decay(5, update_after_step=4) == 0.0 and ema_decay(6, update_after_step=4) == pytest.approx(2 / 11)
    assert ema_decay(2, min_decay=0.5) == 0.5


def test_decay_rejects_bad_options():
    with pytest.raises(ValueError, match="decay=1.5"):
        ema_decay(3, decay=1.5)
    with pytest.raises(ValueError, match="min_decay=0.9 is above decay=0.5"):
        ema_decay(3, decay=0.5, min_decay=0.9)
    with pytest.raises(ValueError, match="inv_gamma"):
        ema_decay(3, use_ema_warmup=True, inv_gamma=0.0)


@pytest.mark.parametrize("options", SETTINGS[:3], ids=["defaults", "warmup", "warmup_gamma_power"])
def test_ema_update_follows_emamodel_step_by_step(options):
    """The project's loop: optimizer step k, then ema_update with ema_decay(k); diffusers' loop: optimizer step,
    then EMAModel.step (which increments optimization_step first). Same shadow weights after every step."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ours = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ours.load_state_dict(model.state_dict())
    theirs = EMAModel(model.parameters(), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    changed = 0.0
    for step in range(1, 26):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        theirs.step(model.parameters())
        decay = ema_decay(step, **options)
        assert decay == theirs.cur_decay_value
        ema_update(ours, model, decay)
        for a, b in zip(ours.parameters(), theirs.shadow_params, strict=True):
            torch.testing.assert_close(a.data, b, rtol=1e-6, atol=1e-7)
        changed = max(changed, max((a - p).abs().max().item() for a, p in zip(ours.parameters(), model.parameters())))
    assert changed > 1e-3  # the EMA really lags the trained weights

"""ScalarHeadModel (reward model / critic) and the pairwise reward loss, single process."""

from __future__ import annotations

import json
import math

import pytest
import torch
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.models import VALUE_HEAD_FILE, ScalarHeadModel, last_token_index, pairwise_loss


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    tiny.train_tokenizer(tiny.task_vocabulary(), out / "tok")
    return tiny.build_tiny_causal_lm(out / "model", out / "tok", hidden=32, layers=1, seed=0)


@pytest.fixture(scope="module")
def model(lm_dir):
    m = ScalarHeadModel.from_pretrained(lm_dir, head_seed=0)
    # a larger head than the default 1/(h+1) init so score differences are far above float noise
    m.init_head(std=1.0, seed=0)
    return m.eval()


def test_last_token_index():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 3, 0]


def test_body_and_head_shapes(model):
    assert type(model.body).__name__ == "OPTModel"
    assert model.value_head.weight.shape == (1, 32) and model.value_head.bias is None
    values = model(torch.tensor([[1, 5, 6, 7]]), torch.ones(1, 4, dtype=torch.long))
    assert values.shape == (1, 4)


def test_score_is_value_at_last_real_token_with_padding(model):
    pad = 0
    seqs = [[1, 10, 11, 12, 2], [1, 20, 21, 2], [1, 30, 2]]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = (torch.arange(width) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    with torch.no_grad():
        scores = model.score(ids, mask)
        values = model(ids, mask)
        alone = torch.stack([model.score(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
                             for s in seqs])
    assert scores.shape == (3,)
    assert torch.equal(scores, values[torch.arange(3), torch.tensor([4, 3, 2])])
    # right padding does not change a sequence's score, and the last *padded* position is different
    assert torch.allclose(scores, alone, atol=1e-5)
    assert not torch.allclose(scores[1:], values[1:, -1], atol=1e-3)
    # left padding (OPT derives positions from the mask) gives the same scores
    left_ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    with torch.no_grad():
        left = model.score(left_ids, mask.flip(1))
    assert torch.allclose(left, alone, atol=1e-5)


def test_save_load_roundtrip(model, tmp_path):
    ids = torch.tensor([[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]])
    mask = (ids != 0).long()
    out = model.save_pretrained(tmp_path / "rm")
    # Hugging Face's sequence-classification form (tests/unit/test_rlhf_reward_formats.py loads it there)
    assert not (out / VALUE_HEAD_FILE).is_file() and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["OPTForSequenceClassification"]
    loaded = ScalarHeadModel.from_pretrained(out).eval()
    assert torch.equal(loaded.value_head.weight, model.value_head.weight)
    with torch.no_grad():
        assert torch.allclose(loaded.score(ids, mask), model.score(ids, mask), atol=1e-6)


def test_fresh_head_init_and_dtype(lm_dir):
    a = ScalarHeadModel.from_pretrained(lm_dir, head_seed=1)
    b = ScalarHeadModel.from_pretrained(lm_dir, head_seed=1)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    # ZeRO-3 loading without a live HfDeepSpeedConfig is refused up front
    with pytest.raises(RuntimeError, match="HfDeepSpeedConfig"):
        ScalarHeadModel.from_pretrained(lm_dir, zero3=True)
    std = a.value_head.weight.std().item()
    assert 0.3 / 33 < std < 3.0 / 33  # default std 1 / (hidden + 1)
    c = ScalarHeadModel.from_pretrained(lm_dir, dtype=torch.bfloat16)
    assert c.value_head.weight.dtype == torch.bfloat16
    assert next(c.body.parameters()).dtype == torch.bfloat16


def test_head_shape_mismatch_is_explained(model, lm_dir, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"weight": torch.zeros(1, 7)}, str(bad))
    with pytest.raises(ValueError, match=r"shape \(1, 7\)"):
        ScalarHeadModel.from_pretrained(lm_dir).load_head(bad)


def test_pairwise_loss_values():
    chosen = torch.tensor([1.0, 0.0, 2.0])
    rejected = torch.tensor([0.0, 0.0, 3.0])
    loss, acc = pairwise_loss(chosen, rejected)
    # -logsigmoid(d) = log(1 + e^-d): d = 1 -> 0.313262, d = 0 -> ln 2, d = -1 -> 1.313262
    expected = (math.log1p(math.exp(-1.0)) + math.log(2.0) + math.log1p(math.exp(1.0))) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert acc.item() == pytest.approx(1.0 / 3.0)  # ties are not correct


def test_pairwise_loss_gradient_direction():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)

"""Packed passes (engines/packing.py) against padded ones on tiny models of every family, and the token-budget split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiengine.engines.packing import PACKABLE_FAMILIES, budget_split, lm_forward, pack
from multiengine.pipelines.rlhf.models import ScalarHeadModel
from multiengine.pipelines.rlhf.tiny import TINY_FAMILIES, tiny_lm_config


def _batch(seed: int = 0, rows: int = 5, width: int = 12, vocab: int = 90) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 1..width real tokens, left padded (prompt side) in odd rows, right padded in even ones."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for b in range(rows):
        n = int(torch.randint(1, width + 1, (1,), generator=g))
        if b % 2:
            mask[b, width - n:] = 1
        else:
            mask[b, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _model(family: str, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    config = tiny_lm_config(family, 100, hidden=32)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _both(module: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module.packed_sequences = False
    padded = lm_forward(module, ids, mask)
    module.packed_sequences = True
    return padded, lm_forward(module, ids, mask)


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    real = mask.bool()
    return float((a[real] - b[real]).abs().max() / a[real].abs().max())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_packed_logits_equal_padded_for_the_families_that_pack(family):
    ids, mask = _batch()
    padded, packed = _both(_model(family), ids, mask)
    if family in PACKABLE_FAMILIES:
        assert _gap(padded, packed, mask) < 1e-5
        assert not packed[~mask.bool()].any()  # padding stays zero
    else:  # OPT derives its positions from the mask: packing it would change its numbers
        assert _gap(padded, packed, mask) > 1e-3


def test_eager_attention_packs_too_and_positions_must_restart():
    ids, mask = _batch(1)
    model = _model("llama", "eager")
    padded, packed = _both(model, ids, mask)
    assert _gap(padded, packed, mask) < 1e-5
    p = pack(ids, mask)
    wrong = dataclasses.replace(p, position_ids=torch.arange(p.input_ids.shape[1]).repeat(p.input_ids.shape[0], 1))
    with torch.no_grad():
        out = model(input_ids=wrong.input_ids, position_ids=wrong.position_ids, use_cache=False).logits
    assert _gap(padded, wrong.unpack(out), mask) > 1e-3  # one running position: sequences attend to each other


def test_gradients_and_scalar_heads_equal_padded():
    from transformers import AutoModel

    ids, mask = _batch(2)
    torch.manual_seed(0)
    model = ScalarHeadModel(AutoModel.from_config(tiny_lm_config("qwen2", 100, hidden=32)))
    grads = []
    for packed in (False, True):
        model.zero_grad()
        model.packed_sequences = packed
        values = lm_forward(model, ids, mask)
        (values * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).abs().max() / grads[0].abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_logprobs_on_packed_rows_equal_those_of_the_unpacked_logits(family):
    from multiengine.pipelines.rlhf import ppo
    from multiengine.pipelines.rlhf.scoring import lm_logprobs

    model, (ids, mask), C, temperature = _model(family), _batch(1, rows=7, width=16), 5, 0.7
    scored = mask[:, C:].bool() & mask[:, C - 1:-1].bool()  # response tokens after a real one
    figures, grads = [], []
    for packed in (False, True):
        model.packed_sequences = packed
        logits = lm_forward(model, ids, mask)
        want = ppo.response_logprobs(logits, ids, C, temperature)
        want_entropy = ppo.entropy_from_logits(logits[:, C - 1:-1].float() / temperature)
        logp, entropy = lm_logprobs(model, ids, mask, C, temperature, entropy=True)
        assert _gap(want, logp, scored) < 1e-6 and _gap(want_entropy, entropy, scored) < 1e-6
        if not packed:  # the padded path is ppo.response_logprobs itself
            assert torch.equal(logp, want) and torch.equal(entropy, want_entropy.detach())
        else:  # nothing is computed for padding
            assert not logp[~scored].any() and not entropy[~scored].any() and not entropy.requires_grad
        model.zero_grad()
        (logp * scored).sum().backward()
        figures.append(logp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert _gap(figures[0], figures[1], scored) < 1e-5
    assert float((grads[0] - grads[1]).abs().max() / grads[0].abs().max()) < 1e-5


def test_rows_are_packed_no_wider_than_the_batch():
    ids, mask = _batch(3, rows=16, width=20)
    p = pack(ids, mask)
    assert p.input_ids.shape[1] <= 20 and p.input_ids.shape[0] < 16
    assert p.index.numel() == int(mask.sum()) and torch.equal(p.input_ids.flatten()[p.slots], ids.flatten()[p.index])


def test_budget_split_is_balanced_and_within_the_budget():
    lengths = [200, 10, 12, 180, 7, 90, 60, 33]
    bins = budget_split(lengths, 256)
    assert sorted(i for b in bins for i in b) == list(range(8))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert max(loads) <= 256 and len(bins) == 3  # 592 tokens: 3 micro-batches of at most 256
    assert max(loads) - min(loads) <= 60
    assert [len(b) for b in budget_split([300, 5], 100)] == [1, 1]  # a row over the budget runs alone
    assert len(budget_split(lengths, 256, count=5)) == 5  # the count every rank agreed on
    assert len(budget_split([1, 1], 256, count=5)) == 2

"""Distillation losses against values worked out by hand (two-token vocabularies)."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.pipelines.distill import distillation_loss, divergence, next_token_mask

# teacher p = [1/4, 3/4] (logits 0, ln 3), student q = [1/2, 1/2] (logits 0, 0)
TEACHER = torch.tensor([[[0.0, math.log(3.0)]]])
STUDENT = torch.tensor([[[0.0, 0.0]]])
ONE = torch.ones(1, 1, dtype=torch.bool)
FORWARD = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)  # KL(p || q)
REVERSE = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)  # KL(q || p)
# m = (p + q) / 2 = [3/8, 5/8]
JSD = 0.5 * (0.25 * math.log(0.25 / 0.375) + 0.75 * math.log(0.75 / 0.625)) + \
    0.5 * (0.5 * math.log(0.5 / 0.375) + 0.5 * math.log(0.5 / 0.625))


@pytest.mark.parametrize("kind, expected", [("forward_kl", FORWARD), ("reverse_kl", REVERSE), ("jsd", JSD)])
def test_divergences_by_hand(kind, expected):
    assert divergence(STUDENT, TEACHER, ONE, kind).item() == pytest.approx(expected, abs=1e-6)


def test_jsd_is_symmetric_bounded_and_zero_for_equal_distributions():
    a = divergence(STUDENT, TEACHER, ONE, "jsd").item()
    b = divergence(TEACHER, STUDENT, ONE, "jsd").item()
    assert a == pytest.approx(b, abs=1e-7)
    far = divergence(torch.tensor([[[20.0, -20.0]]]), torch.tensor([[[-20.0, 20.0]]]), ONE, "jsd").item()
    assert far == pytest.approx(math.log(2.0), abs=1e-5)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert divergence(TEACHER, TEACHER, ONE, kind).item() == pytest.approx(0.0, abs=1e-7)


def test_temperature_softens_both_and_scales_by_its_square():
    # logits / 2 gives back the distributions above; the loss is multiplied by 2^2
    got = divergence(STUDENT * 2, TEACHER * 2, ONE, "forward_kl", temperature=2.0).item()
    assert got == pytest.approx(4.0 * FORWARD, abs=1e-6)


def test_mask_and_next_token_shift():
    labels = torch.tensor([[-100, -100, 1, 0]])  # prompt, prompt, response, response
    assert next_token_mask(labels).tolist() == [[False, True, True]]  # logits at 1 and 2 predict tokens 2, 3
    # position 0 disagrees wildly but is masked out; positions 1 and 2 are the hand example
    student = torch.cat([torch.tensor([[[9.0, -9.0]]]), STUDENT, STUDENT, STUDENT], dim=1)
    teacher = torch.cat([torch.tensor([[[-9.0, 9.0]]]), TEACHER, TEACHER, TEACHER], dim=1)
    loss, parts = distillation_loss(student, teacher, labels)
    assert loss.item() == pytest.approx(FORWARD, abs=1e-6)
    # hard labels 1 and 0 under q = [1/2, 1/2]: cross-entropy ln 2 each
    assert parts["ce"].item() == pytest.approx(math.log(2.0), abs=1e-6)
    mixed, _ = distillation_loss(student, teacher, labels, alpha=0.25)
    assert mixed.item() == pytest.approx(0.25 * FORWARD + 0.75 * math.log(2.0), abs=1e-6)


def test_gradients_flow_to_the_student_only_and_bad_input_is_named():
    student = STUDENT.clone().requires_grad_(True)
    loss = divergence(student, TEACHER, ONE)
    loss.backward()
    # d KL(p||q) / d student logits = q - p
    assert student.grad[0, 0].tolist() == pytest.approx([0.25, -0.25], abs=1e-6)
    with pytest.raises(ValueError, match="kind"):
        divergence(STUDENT, TEACHER, ONE, "kl")
    with pytest.raises(ValueError, match="same vocabulary"):
        divergence(STUDENT, torch.zeros(1, 1, 3), ONE)
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(STUDENT, TEACHER, torch.tensor([[1]]), alpha=1.5)

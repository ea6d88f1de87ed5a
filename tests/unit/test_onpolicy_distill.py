"""On-policy distillation pieces of pipelines/distill.py: GKD's generalised JSD (hand values and TRL's
generalized_jsd_loss re-implemented), the response-token slicing, the vocabulary check and the seeded
on-policy batch decision."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from multiengine.pipelines import distill

ATOL = 1e-6


def close(a, b, atol: float = ATOL) -> None:
    a = torch.as_tensor(a, dtype=torch.float32)
    b = torch.as_tensor(b, dtype=torch.float32)
    assert torch.allclose(a, b, atol=atol, rtol=0), f"{a} != {b}"


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels, beta, temperature):
    """TRL GKDTrainer.generalized_jsd_loss (reduction="batchmean") with F.kl_div(input, target, log_target)
    = KL(target || input)."""
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(m, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(m, s, reduction="none",
                                                                                           log_target=True)
    mask = labels != -100
    return jsd[mask].sum() / mask.sum()


def test_generalized_jsd_hand_values():
    # p_S = (1/2, 1/2), p_T = (3/4, 1/4)
    s = torch.tensor([0.0, 0.0])
    t = torch.tensor([math.log(3.0), 0.0])
    fwd = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # KL(T || S)
    rev = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(S || T)
    m = (0.625, 0.375)  # beta = 1/2
    jsd = 0.5 * (0.75 * math.log(0.75 / m[0]) + 0.25 * math.log(0.25 / m[1])) + \
        0.5 * (0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1]))
    close(distill.generalized_jsd(s, t, beta=0.0), fwd)
    close(distill.generalized_jsd(s, t, beta=1.0), rev)
    close(distill.generalized_jsd(s, t, beta=0.5), jsd)
    # temperature 2: both distributions flattened, no tau^2 factor (GKD)
    ps, pt = (0.5, 0.5), (math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1))
    close(distill.generalized_jsd(s, t, beta=0.0, temperature=2.0),
          sum(q * math.log(q / p) for p, q in zip(ps, pt)))
    assert float(distill.generalized_jsd(t, t, beta=0.3)) == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_trl_generalized_jsd_loss(beta, temperature):
    g = torch.Generator().manual_seed(int(beta * 10) + int(temperature))
    B, T, V = 3, 5, 11
    student = (2 * torch.randn(B, T, V, generator=g)).requires_grad_(True)
    teacher = 2 * torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 3:] = -100
    labels[2] = -100  # a fully masked row
    mask = labels != -100
    ours = distill.generalized_jsd_loss(student, teacher, mask, beta, temperature)
    ref = trl_generalized_jsd_loss(student, teacher, labels, beta, temperature)
    close(ours, ref)
    g_ours, g_ref = torch.autograd.grad(ours, student)[0], torch.autograd.grad(ref, student)[0]
    close(g_ours, g_ref)
    assert torch.isfinite(g_ours).all() and float(g_ours[2].abs().sum()) == 0.0  # the masked row gets nothing
    empty = distill.generalized_jsd_loss(student, teacher, torch.zeros_like(mask), beta, temperature)
    assert float(empty) == 0.0


def test_agrees_with_the_offline_divergences_at_temperature_one():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 4, 7, generator=g), torch.randn(2, 4, 7, generator=g)
    mask = torch.ones(2, 4, dtype=torch.bool)
    close(distill.generalized_jsd_loss(s, t, mask, 0.0), distill.divergence(s, t, mask, "forward_kl"))
    close(distill.generalized_jsd_loss(s, t, mask, 1.0), distill.divergence(s, t, mask, "reverse_kl"))
    close(distill.generalized_jsd_loss(s, t, mask, 0.3), distill.divergence(s, t, mask, "jsd", beta=0.3))


def test_response_distill_loss_reads_the_response_positions():
    g = torch.Generator().manual_seed(2)
    B, C, T, V = 2, 3, 4, 6
    student = torch.randn(B, C + T, V, generator=g, requires_grad=True)
    teacher = torch.randn(B, C + T, V, generator=g)
    action = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)  # row 1: an environment token at t=1
    loss = distill.response_distill_loss(student, teacher, C, action, beta=1.0)
    close(loss, distill.generalized_jsd_loss(student[:, C - 1:-1], teacher[:, C - 1:-1], action, 1.0))
    (grad,) = torch.autograd.grad(loss, student)
    # logit position C-1+t predicts response token t: only the action positions get a gradient
    got = grad.abs().sum(-1)[:, C - 1:-1] > 0
    assert got.tolist() == action.tolist()
    assert float(grad[:, :C - 1].abs().sum()) == 0.0 and float(grad[:, -1].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="prompt \\+ response"):
        distill.response_distill_loss(student, teacher, C + 1, action)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_check_vocab():
    assert distill.check_vocab(100, 100) == 100
    with pytest.raises(ValueError, match="teacher vocabulary size 128 != student vocabulary size 100") as err:
        distill.check_vocab(100, 128)
    assert "pass both tokenizers" in str(err.value)
    tok = FakeTokenizer({f"w{i}": i for i in range(90)})
    # padded embeddings of one tokenizer: the loss uses the 90 real tokens
    assert distill.check_vocab(96, 128, tok, FakeTokenizer(tok.get_vocab())) == 90
    assert distill.check_vocab(96, 96, tok, tok) == 96
    other = FakeTokenizer({**tok.get_vocab(), "w0": 89, "w89": 0})
    with pytest.raises(ValueError, match="tokenizers differ"):
        distill.check_vocab(96, 96, tok, other)
    with pytest.raises(ValueError, match="fewer logits than tokens"):
        distill.check_vocab(80, 96, tok, tok)
    s, t = torch.randn(2, 96), torch.randn(2, 128)
    n = distill.check_vocab(96, 128, tok, tok)
    assert torch.isfinite(distill.generalized_jsd(s[..., :n], t[..., :n], 0.5)).all()
    with pytest.raises(ValueError, match="differ"):
        distill.generalized_jsd(s, t, 0.5)


def test_on_policy_batch_is_seeded_and_has_the_share():
    steps = range(2000)
    picks = [distill.on_policy_batch(5, k, 0.3) for k in steps]
    assert picks == [distill.on_policy_batch(5, k, 0.3) for k in steps]  # reproducible (and rank independent)
    assert picks != [distill.on_policy_batch(6, k, 0.3) for k in steps]
    assert abs(sum(picks) / len(picks) - 0.3) < 0.04
    assert not any(distill.on_policy_batch(5, k, 0.0) for k in range(300))
    assert all(distill.on_policy_batch(5, k, 1.0) for k in range(300))
    # a larger fraction picks a superset of the steps (one draw per step)
    assert all(b or not a for a, b in zip(picks, [distill.on_policy_batch(5, k, 0.6) for k in steps]))
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="on_policy_fraction"):
            distill.on_policy_batch(0, 0, bad)
    with pytest.raises(ValueError, match="distill.beta"):
        distill.generalized_jsd(torch.zeros(3), torch.zeros(3), beta=1.2)

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


def test_the_decision_sequence_is_pinned():
    # a resumed run (and every rank) decides step k from (seed, k) alone; these values pin the generator, so a
    # change to it would change where an old run's on-policy steps fall (the 2-rank test runs this sequence)
    assert [distill.on_policy_batch(0, k, 0.4) for k in range(6)] == [False, False, True, True, False, True]


@pytest.mark.parametrize("kind", distill.DIVERGENCES)
def test_sampled_distill_loss_is_the_offline_divergence_on_the_response(kind):
    g = torch.Generator().manual_seed(3)
    B, C, T, V = 2, 3, 4, 9
    student = torch.randn(B, C + T, V, generator=g)
    teacher = torch.randn(B, C + T, V, generator=g)
    action = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)  # prefixes up to the first EOS
    for tau in (1.0, 2.0):
        got = distill.sampled_distill_loss(student, teacher, C, action, kind, tau, beta=0.3)
        # the same per-token objective as the offline batches: Hinton's tau^2 included
        close(got, distill.divergence(student[:, C - 1:-1], teacher[:, C - 1:-1], action, kind, tau, 0.3))
    assert distill.gkd_beta(kind, 0.3) == {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.3}[kind]


def trl_gkd_compute_loss(student_logits, teacher_logits, prompt_length, labels, beta):
    """TRL GKDTrainer.compute_loss: both models' logits at the completion's positions, then generalized_jsd_loss
    called without a temperature (its default 1.0; GKDConfig.temperature only sets the sampling)."""
    shifted_student = student_logits[:, prompt_length - 1:-1, :]
    shifted_teacher = teacher_logits[:, prompt_length - 1:-1, :]
    return trl_generalized_jsd_loss(shifted_student, shifted_teacher, labels[:, prompt_length:], beta, 1.0)


@pytest.mark.parametrize("kind", distill.DIVERGENCES)
def test_trls_gkd_loss_is_ours_at_temperature_one_whatever_it_samples_at(kind):
    g = torch.Generator().manual_seed(4)
    B, C, T, V = 3, 4, 5, 10
    student = (2 * torch.randn(B, C + T, V, generator=g)).requires_grad_(True)
    teacher = 2 * torch.randn(B, C + T, V, generator=g)
    ids = torch.randint(0, V, (B, C + T), generator=g)
    action = torch.arange(T)[None] < torch.tensor([5, 2, 3])[:, None]  # up to each answer's EOS
    labels = torch.cat([torch.full((B, C), -100), ids[:, C:].masked_fill(~action, -100)], dim=1)
    trl = trl_gkd_compute_loss(student, teacher, C, labels, distill.gkd_beta(kind, 0.3))
    ours = distill.sampled_distill_loss(student, teacher, C, action, kind, 1.0, beta=0.3)
    close(ours, trl)
    close(torch.autograd.grad(ours, student)[0], torch.autograd.grad(trl, student)[0])
    # at distill.temperature 2 ours softens both distributions and multiplies by 4: not TRL's loss, nor 4 x TRL's
    tau2 = distill.sampled_distill_loss(student, teacher, C, action, kind, 2.0, beta=0.3)
    assert abs(float(tau2) / 4 - float(trl)) > 1e-3 and abs(float(tau2) - float(trl)) > 1e-3


def test_prompts_of_demonstrations():
    pad = 0
    # right-padded prompt + response: labels -100 on the prompt (and padding)
    ids = torch.tensor([[5, 6, 7, 8, 2, 0], [9, 4, 3, 2, 0, 0], [7, 7, 7, 7, 7, 2]])
    mask = (ids != 0).long()
    labels = torch.tensor([[-100, -100, -100, 8, 2, -100], [-100, 4, 3, 2, -100, -100], [7, 7, 7, 7, 7, 2]])
    prompt, prompt_mask = distill.prompts_of_demonstrations(ids, mask, labels, pad)
    # row 3 is a text row (everything learned): its prompt is its first token
    assert prompt.tolist() == [[5, 6, 7], [0, 0, 9], [0, 0, 7]]
    assert prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def two_vocabularies(tmp_path_factory):
    """Tiny models on the task tokenizer (108 tokens), one of them with its embedding padded to 128 rows, and one
    on the chat tokenizer (three more tokens: 111)."""
    from multiengine.pipelines.rlhf import tiny
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("vocab")
    tiny.train_tokenizer(tiny.task_vocabulary(), d / "tok")
    tiny.train_tokenizer(tiny.task_vocabulary(), d / "chat_tok", chat_template=True)
    plain = tiny.build_tiny_causal_lm(d / "plain", d / "tok", hidden=16, layers=1)
    tiny.build_tiny_causal_lm(d / "chat", d / "chat_tok", hidden=16, layers=1)
    padded = AutoModelForCausalLM.from_pretrained(plain)
    padded.resize_token_embeddings(128)
    padded.save_pretrained(d / "padded")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (plain / name).is_file():
            (d / "padded" / name).write_bytes((plain / name).read_bytes())
    return d


def _validate(capsys, d, *args: str) -> tuple[int, str]:
    from multiengine.recipes.language import cli

    code = cli.main(["validate", "distill", "--config", "tiny", *args, f"output_dir={d / 'out'}"])
    return code, capsys.readouterr().err


def test_validate_refuses_two_vocabularies_before_any_rank(two_vocabularies, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MULTIENGINE_VALIDATED"):
        monkeypatch.delenv(name, raising=False)
    d = two_vocabularies
    code, err = _validate(capsys, d, f"roles.teacher.model={d / 'chat'}", f"roles.student.model={d / 'plain'}",
                          "distill.on_policy_fraction=0.5")
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    # both models, both sizes and the fix
    for part in (f"roles.teacher.model ({d / 'chat'}: 111 logits)", f"roles.student.model ({d / 'plain'}: 108 logits)",
                 "student 108 tokens, teacher 111", "Fix: use a teacher and a student of one model family"):
        assert part in lines[0], lines[0]
    # one tokenizer, embeddings padded to another size (a model family's sizes): accepted, teacher larger or not
    assert _validate(capsys, d, f"roles.teacher.model={d / 'padded'}", f"roles.student.model={d / 'plain'}")[0] == 0
    assert _validate(capsys, d, f"roles.teacher.model={d / 'plain'}", f"roles.student.model={d / 'padded'}")[0] == 0
    # on-policy steps need prompts to sample answers to: text rows are refused, naming the key
    (d / "text.jsonl").write_text("".join(f'{{"text": "list {i} fruits : apple pear"}}\n' for i in range(64)))
    code, err = _validate(capsys, d, f"data.source={d / 'text.jsonl'}", "distill.on_policy_fraction=0.5")
    assert code == 2 and "distill.on_policy_fraction=0.5" in err and "text rows have none" in err, err
    assert _validate(capsys, d, f"data.source={d / 'text.jsonl'}")[0] == 0  # offline distillation of text: fine
    code, err = _validate(capsys, d, "distill.loss=jsd", "distill.beta=0")
    assert code == 2 and "'distill.beta'" in err and "forward_kl (beta 0)" in err, err

"""Reward models in Hugging Face form: our export loads as AutoModelForSequenceClassification (fresh process,
no missing/unexpected weights, same scores at the same position), and *ForSequenceClassification checkpoints
(as TRL saves them) load as our reward model / critic; the older value-head form still loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.models import VALUE_HEAD_FILE, ScalarHeadModel

PAD = 0  # the tiny tokenizer: pad 0, bos 1, eos 2 (pad != eos)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    tiny.train_tokenizer(tiny.task_vocabulary(), out / "tok")
    return tiny.build_tiny_causal_lm(out / "model", out / "tok", hidden=32, layers=1, seed=0)


def _batch():
    """Right-padded rows ending in EOS, of different lengths."""
    seqs = [[1, 10, 11, 12, 2], [1, 20, 21, 2], [1, 30, 2], [1, 40, 41, 42, 43, 44, 2]]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    mask = (torch.arange(width) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


def _hf_scores_in_fresh_process(folders, ids, mask, tmp_path):
    """Load each folder with AutoModelForSequenceClassification in one new interpreter; return, per folder,
    its scores, class and loading info."""
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"ids": ids.tolist(), "mask": mask.tolist(), "folders": [str(f) for f in folders]}))
    code = (
        "import json, torch\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"x = json.load(open({str(inputs)!r}))\n"
        "out = []\n"
        "for folder in x['folders']:\n"
        "    m, info = AutoModelForSequenceClassification.from_pretrained(folder, output_loading_info=True)\n"
        "    with torch.no_grad():\n"
        "        s = m.eval()(input_ids=torch.tensor(x['ids']), attention_mask=torch.tensor(x['mask'])).logits\n"
        "    out.append({'scores': s.squeeze(-1).tolist(), 'cls': type(m).__name__, 'num_labels': m.config.num_labels,"
        " 'info': {k: sorted(map(str, v)) for k, v in info.items()}})\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _random_seq_cls(kind: str, folder, vocab: int = 120):
    from transformers import (
        GPT2Config,
        GPT2ForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
        OPTConfig,
        OPTForSequenceClassification,
    )

    torch.manual_seed(0)
    if kind == "opt":
        config = OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
                           max_position_embeddings=64, word_embed_proj_dim=32, num_labels=1, pad_token_id=PAD)
        model = OPTForSequenceClassification(config)
    elif kind == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=64, num_labels=1,
                            pad_token_id=PAD)
        model = GPT2ForSequenceClassification(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                             pad_token_id=PAD)
        model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # distinct scores
    model.save_pretrained(str(folder))
    return model.eval()


KINDS = ("opt", "gpt2", "llama")


@pytest.fixture(scope="module")
def exports(lm_dir, tmp_path_factory):
    """Our reward model saved, and three Hugging Face reward checkpoints loaded as ours and saved again; with
    the scores each must give on ``_batch()``."""
    root = tmp_path_factory.mktemp("exports")
    ids, mask = _batch()
    model = ScalarHeadModel.from_pretrained(lm_dir, head_seed=0)
    model.init_head(std=1.0, seed=0)  # scores well apart
    model.eval()
    with torch.no_grad():
        ours = model.score(ids, mask)
        last_padded = model(ids, mask)[:, -1]
    out = {"ours": (model.save_pretrained(root / "rm", pad_token_id=PAD), ours, model)}
    for kind in KINDS:
        hf = _random_seq_cls(kind, root / f"hf_{kind}")
        rm = ScalarHeadModel.from_pretrained(root / f"hf_{kind}").eval()
        with torch.no_grad():
            expected = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        out[kind] = (rm.save_pretrained(root / f"again_{kind}"), expected, rm)
    # the agreement below is about the score position: the last padded column scores differently
    assert not torch.allclose(last_padded[:3], ours[:3], atol=1e-3)
    return out


def test_export_loads_as_sequence_classification_with_the_same_scores(exports, tmp_path):
    """Fresh process: AutoModelForSequenceClassification.from_pretrained(export) has no missing, unexpected or
    mismatched weights and gives our scores (right padding, pad != eos)."""
    ids, mask = _batch()
    names = ["ours", *KINDS]
    got = _hf_scores_in_fresh_process([exports[n][0] for n in names], ids, mask, tmp_path)
    for name, hf in zip(names, got, strict=True):
        folder, expected, _ = exports[name]
        assert hf["num_labels"] == 1, name
        assert hf["info"]["missing_keys"] == [] and hf["info"]["unexpected_keys"] == [], (name, hf["info"])
        assert hf["info"]["mismatched_keys"] == [], name
        assert torch.allclose(torch.tensor(hf["scores"]), expected, atol=1e-5), name
    assert got[0]["cls"] == "OPTForSequenceClassification" and got[2]["cls"] == "GPT2ForSequenceClassification"


def test_export_loads_back_as_ours(exports):
    ids, mask = _batch()
    folder, ours, model = exports["ours"]
    again = ScalarHeadModel.from_pretrained(folder).eval()
    assert torch.equal(again.value_head.weight, model.value_head.weight)
    with torch.no_grad():
        assert torch.allclose(again.score(ids, mask), ours, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_sequence_classification_checkpoint_loads_as_reward_and_critic(exports, kind):
    """A TRL-style reward checkpoint (a *ForSequenceClassification folder, num_labels=1) as our model: the same
    scores as the Hugging Face class on right-padded rows, and a value per position as a critic."""
    _, expected, rm = exports[kind]
    ids, mask = _batch()
    assert rm.value_head.bias is None and type(rm.body).__name__.endswith("Model")
    with torch.no_grad():
        assert torch.allclose(rm.score(ids, mask), expected, atol=1e-5)
        assert rm(ids, mask).shape == ids.shape


def test_sequence_classification_with_several_labels_is_refused(tmp_path):
    from transformers import OPTConfig, OPTForSequenceClassification

    config = OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
                       max_position_embeddings=32, word_embed_proj_dim=16, num_labels=3, pad_token_id=0)
    OPTForSequenceClassification(config).save_pretrained(str(tmp_path / "cls3"))
    with pytest.raises(ValueError, match="num_labels=3"):
        ScalarHeadModel.from_pretrained(tmp_path / "cls3")


def test_value_head_form_still_loads(lm_dir, tmp_path):
    """The earlier export: a base-model folder + value_head.safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoModel

    body = AutoModel.from_pretrained(str(lm_dir))
    folder = tmp_path / "old"
    body.save_pretrained(str(folder))
    head = torch.randn(1, 32)
    save_file({"weight": head}, str(folder / VALUE_HEAD_FILE))
    rm = ScalarHeadModel.from_pretrained(folder).eval()
    assert torch.equal(rm.value_head.weight, head)
    ids, mask = _batch()
    with torch.no_grad():
        hidden = body.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = (hidden @ head.T).squeeze(-1)[torch.arange(4), mask.sum(1) - 1]
        assert torch.allclose(rm.score(ids, mask), expected, atol=1e-5)


def test_pad_equal_eos_warns(lm_dir, tmp_path, caplog):
    model = ScalarHeadModel.from_pretrained(lm_dir, head_seed=0)
    with caplog.at_level("WARNING"):
        model.save_pretrained(tmp_path / "rm", pad_token_id=2)  # eos id of the tiny tokenizer
    assert "scores the token before a final EOS" in caplog.text

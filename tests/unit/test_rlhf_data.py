"""Built-in RLHF task, tokenizer, tiny model, dataset loading, collators and sampler."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import (
    PairCollator,
    PromptCollator,
    SFTCollator,
    ShardedEpochSampler,
    load_rlhf_dataset,
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return tiny.prepare_builtin(out, seed=0, n_sft=300, n_reward=200, n_ppo=50, n_eval=20)


@pytest.fixture(scope="module")
def tokenizer(assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets["tokenizer"]))


# --------------------------------------------------------------------------------------------------
# task
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("apple pear plum", 1.0),  # 3 distinct fruits
        ("apple pear cat", (2 - 0.5 * 1) / 3),  # one off topic
        ("apple apple pear", (2 - 0.5 * 1) / 3),  # a stutter
        ("apple pear apple", 1.0),  # repeats are only judged between neighbours
        ("apple pear plum kiwi", (3 - 0.5 * 1) / 3),  # one too many
        ("apple pear", 2 / 3),  # one too few
        ("apple apple apple", 0.0),  # (1 - 0.5 * 2) / 3
        ("apple apple pear pear plum", (3 - 0.5 * 2) / 3),
        ("apple pear plum plum plum", (3 - 0.5 * 2) / 3),
        ("cat dog horse", 0.0),
        ("", 0.0),
        ("apple pear plum </s> cat cat", 1.0),  # read up to the first EOS
        ("apple <pad> pear plum", 1.0),
    ],
)
def test_judge_values(answer, expected):
    assert tiny.judge("list 3 fruits :", answer) == pytest.approx(expected)


def test_judge_unknown_prompt_and_parse():
    assert tiny.judge("hello there", "apple pear") == 0.0
    assert tiny.judge("list 3 cheeses :", "apple") == 0.0
    assert tiny.parse_prompt("name 4 animals :") == (4, "animals")


def test_corpus_is_deterministic_and_mixed_quality():
    a, b, c = tiny.build_corpus(0), tiny.build_corpus(0), tiny.build_corpus(1)
    assert a == b and a != c
    assert {k: len(v) for k, v in a.items()} == {"sft": 2000, "reward": 6000, "ppo": 1000, "eval": 128}
    sft_scores = [tiny.judge(r["prompt"], r["response"]) for r in a["sft"]]
    perfect = sum(s == 1.0 for s in sft_scores) / len(sft_scores)
    # demonstrations teach the format but an imitating model must stay clearly below 1.0
    assert 0.35 < perfect < 0.5
    assert 0.6 < statistics.mean(sft_scores) < 0.85
    for row in a["reward"]:
        assert tiny.judge(row["prompt"], row["chosen"]) > tiny.judge(row["prompt"], row["rejected"])
    # the pairs cover the failure modes a policy drifts to (stutters), as chosen and as rejected
    rejected = [r["rejected"].split() for r in a["reward"]]
    stutter = [any(x == y for x, y in zip(w, w[1:], strict=False)) for w in rejected]
    assert sum(stutter) > 0.1 * len(stutter)


def test_sequences_are_short(tokenizer):
    corpus = tiny.build_corpus(0, n_sft=200, n_reward=200, n_ppo=10, n_eval=10)
    for row in corpus["sft"] + corpus["reward"]:
        assert len(tokenizer(row["prompt"])["input_ids"]) <= 16
        for key in ("response", "chosen", "rejected"):
            if key in row:
                assert len(tokenizer(row[key], add_special_tokens=False)["input_ids"]) + 1 <= 16


# --------------------------------------------------------------------------------------------------
# tokenizer and model
# --------------------------------------------------------------------------------------------------


def test_tokenizer_roundtrip(tokenizer, assets):
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    assert tokenizer.padding_side == "left"
    ids = tokenizer("list 3 fruits :")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 5
    assert tokenizer.unk_token_id not in ids
    answer = tokenizer("apple pear plum", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(answer + [tokenizer.eos_token_id, tokenizer.pad_token_id],
                            skip_special_tokens=True) == "apple pear plum"
    batch = tokenizer(["list 3 fruits :", "pear"], padding=True)
    assert batch["attention_mask"][1][:3] == [0, 0, 0]  # left padded


def test_tiny_model_config_and_forward(assets, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(assets["model"]))
    cfg = model.config
    assert type(model).__name__ == "OPTForCausalLM"
    assert cfg.vocab_size == len(tokenizer) and cfg.max_position_embeddings == 128
    assert cfg.hidden_size == 64 and cfg.word_embed_proj_dim == 64 and cfg.num_hidden_layers == 2
    assert cfg.dropout == 0.0 and cfg.attention_dropout == 0.0
    assert cfg.pad_token_id == tokenizer.pad_token_id and cfg.eos_token_id == tokenizer.eos_token_id
    logits = model(input_ids=torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tokenizer))


def test_tiny_model_seeded(tmp_path, assets):
    from safetensors.torch import load_file

    a = tiny.build_tiny_causal_lm(tmp_path / "a", assets["tokenizer"], seed=3)
    b = tiny.build_tiny_causal_lm(tmp_path / "b", assets["tokenizer"], seed=3)
    c = tiny.build_tiny_causal_lm(tmp_path / "c", assets["tokenizer"], seed=4)
    sa, sb, sc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    key = next(k for k in sa if "fc1.weight" in k)
    assert torch.equal(sa[key], sb[key]) and not torch.equal(sa[key], sc[key])


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------


def test_load_from_folder_and_file(assets):
    ds = load_rlhf_dataset(assets["data"], "reward")
    assert len(ds) == 200 and {"prompt", "chosen", "rejected"} <= set(ds.column_names)
    ds = load_rlhf_dataset(assets["sft"], "sft")
    assert len(ds) == 300 and ds[0]["prompt"].endswith(":")
    assert len(load_rlhf_dataset(assets["data"], "ppo")) == 50


def test_load_missing_columns_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "list 2 fruits :", "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"\['chosen', 'rejected'\]"):
        load_rlhf_dataset(path, "reward")
    with pytest.raises(ValueError, match="unknown RLHF split"):
        load_rlhf_dataset(path, "dpo")
    with pytest.raises(ValueError, match="Unsupported data file type '.txt'"):
        bad = tmp_path / "data.txt"
        bad.write_text("prompt\nx\n")
        load_rlhf_dataset(bad, "ppo")


def test_load_sft_accepts_chosen_and_parquet(tmp_path):
    from datasets import Dataset

    path = tmp_path / "pairs.parquet"
    Dataset.from_list([{"prompt": "list 2 fruits :", "chosen": "apple pear", "rejected": "cat"}]).to_parquet(
        str(path)
    )
    ds = load_rlhf_dataset(path, "sft")
    assert ds[0]["response"] == "apple pear"


# --------------------------------------------------------------------------------------------------
# collators
# --------------------------------------------------------------------------------------------------


def test_prompt_collator_left_pads(tokenizer):
    batch = PromptCollator(tokenizer, max_prompt_len=16)([{"prompt": "list 3 fruits :"}, "pear"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == (2, 5)
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    assert ids[1].tolist()[:3] == [pad, pad, pad] and ids[1, 3].item() == bos
    assert mask.tolist() == [[1] * 5, [0, 0, 0, 1, 1]]
    assert batch["prompts"] == ["list 3 fruits :", "pear"]
    # truncation keeps BOS and the end of the prompt
    short = PromptCollator(tokenizer, max_prompt_len=3)(["list 3 fruits :"])["input_ids"][0].tolist()
    assert short == [bos] + tokenizer("fruits :", add_special_tokens=False)["input_ids"]


def test_sft_collator_labels(tokenizer):
    rows = [{"prompt": "list 2 fruits :", "response": "apple pear"}, {"prompt": "say 3 colors :", "response": "red"}]
    batch = SFTCollator(tokenizer, max_prompt_len=16, max_response_len=16)(rows)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape == labels.shape == mask.shape == (2, 8)  # 5 prompt + 2 words + EOS
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    apple, pear = tokenizer("apple pear", add_special_tokens=False)["input_ids"]
    assert labels[0].tolist() == [-100] * 5 + [apple, pear, eos]
    red = tokenizer.convert_tokens_to_ids("red")
    assert labels[1].tolist() == [-100] * 5 + [red, eos, -100]  # EOS learned, padding not
    assert ids[1, 6:].tolist() == [eos, pad] and mask[1].tolist() == [1] * 7 + [0]


def test_pair_collator_layout(tokenizer):
    rows = [
        {"prompt": "list 2 fruits :", "chosen": "apple pear", "rejected": "cat"},
        {"prompt": "say 3 colors :", "chosen": "red blue green", "rejected": "red"},
    ]
    batch = PairCollator(tokenizer, max_prompt_len=16, max_response_len=16)(rows)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == (4, 9)  # longest: 5 + 3 words + EOS
    lengths = mask.sum(1).tolist()
    assert lengths == [8, 9, 7, 7]  # chosen rows first, then rejected, right padded
    eos = tokenizer.eos_token_id
    for row, n in zip(ids, lengths, strict=False):
        assert row[n - 1].item() == eos and (row[n:] == tokenizer.pad_token_id).all()
    assert torch.equal(ids[0, :5], ids[2, :5])


# --------------------------------------------------------------------------------------------------
# sampler
# --------------------------------------------------------------------------------------------------


def test_sampler_is_the_shared_one_and_resumes_prompts():
    from multiengine.engines import ShardedEpochSampler as shared

    assert ShardedEpochSampler is shared  # re-exported, not duplicated
    s = ShardedEpochSampler(20, world_size=2, rank=1, seed=7)
    s.set_epoch(1)
    epoch1 = s.indices(1)
    it = iter(s)
    first = [next(it) for _ in range(4)]
    resumed = ShardedEpochSampler(20, world_size=2, rank=1, seed=7)
    resumed.load_state_dict(s.state_dict())
    resumed.set_epoch(1)  # same epoch: the position is kept
    assert first + list(resumed) == epoch1 and len(epoch1) == 10

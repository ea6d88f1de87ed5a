"""RLHF data formats and sources: every source kind loads the same rows, column mapping, TRL's standard and
conversational formats, blends, held-out evaluation rows, chat templates and the up-front checks."""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import (
    DataSettings,
    PairCollator,
    PromptCollator,
    SFTCollator,
    check_rlhf_data,
    detect_format,
    load_rlhf_data,
    load_rlhf_dataset,
)
from multiengine.pipelines.sources import DataSourceError, as_sources, blend, heldout_split

ROWS = [{"prompt": f"list {n} {t} :", "response": " ".join(tiny.TOPICS[t][:n])}
        for n, t in [(2, "fruits"), (3, "animals"), (4, "colors"), (2, "tools"), (3, "sports"), (4, "countries")]]
CHAT = [
    {"messages": [{"role": "system", "content": "say tell"}, {"role": "user", "content": "list 2 fruits :"},
                  {"role": "assistant", "content": "apple pear"}, {"role": "user", "content": "list 2 animals :"},
                  {"role": "assistant", "content": "cat dog"}]},
    {"messages": [{"role": "user", "content": "list 3 colors :"}, {"role": "assistant", "content": "red blue green"}]},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path_factory.mktemp("chat_tok"), chat_template=True)


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --------------------------------------------------------------------------------------------------
# sources
# --------------------------------------------------------------------------------------------------


def test_every_source_kind_loads_the_same_rows(tmp_path):
    import csv

    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list(ROWS)
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    _jsonl(tmp_path / "a.jsonl", ROWS)
    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "response"])
        w.writeheader()
        w.writerows(ROWS)
    ds.to_parquet(str(tmp_path / "a.parquet"))
    ds.save_to_disk(str(tmp_path / "disk"))
    DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "disk_dict"))
    _jsonl(tmp_path / "layout" / "sft.jsonl", ROWS)  # the folder of split files tiny.write_builtin_dataset writes
    (tmp_path / "hf_layout").mkdir()
    ds.to_parquet(str(tmp_path / "hf_layout" / "train.parquet"))
    cache = str(tmp_path / "cache")
    for source in ("a.json", "a.jsonl", "a.csv", "a.parquet", "disk", "disk_dict", "layout", "hf_layout"):
        got = load_rlhf_dataset(tmp_path / source, "sft", cache_dir=cache)
        assert got.select_columns(["prompt", "response"]).to_list() == ROWS, source


def _fake_hub_cache(rows, name: str, cache_dir: str, workdir) -> None:
    """What ``load_dataset(name)`` leaves in its cache after a download (a prepared builder under
    ``<namespace>___<name>/default/<version>/<hash>``), written from local rows."""
    from datasets.packaged_modules.json.json import Json

    namespace, short = name.split("/")
    data = _jsonl(workdir / "hub_rows.jsonl", rows)
    Json(cache_dir=str(workdir / "build"), dataset_name=short, data_files={"train": data},
         hash="0123abcd").download_and_prepare()
    [prepared] = glob.glob(str(workdir / "build" / short / "default-*"))
    os.makedirs(os.path.join(cache_dir, f"{namespace}___{short}"), exist_ok=True)
    shutil.move(prepared, os.path.join(cache_dir, f"{namespace}___{short}", "default"))


def test_hub_name_loads_offline_from_the_cache(tmp_path):
    """A hub dataset name goes through load_dataset, which reads the local cache when offline."""
    cache = str(tmp_path / "hub_cache")
    _fake_hub_cache([{"question": r["prompt"], "answer": r["response"]} for r in ROWS], "someone/tiny-sft", cache,
                    tmp_path)
    code = (
        "import json\n"
        "from multiengine.pipelines.rlhf.data import load_rlhf_dataset\n"
        f"ds = load_rlhf_dataset('someone/tiny-sft', 'sft', columns={{'prompt': 'question', 'response': 'answer'}}, "
        f"cache_dir={cache!r})\n"
        "print(json.dumps(ds.to_list()))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ROWS


def test_missing_and_unusable_sources_are_named(tmp_path):
    with pytest.raises(DataSourceError, match=r"no such file or folder: .*nope\.jsonl \(data\.source\)"):
        load_rlhf_dataset(tmp_path / "nope.jsonl", "sft")
    with pytest.raises(DataSourceError, match=r"no such file or folder: \./data/missing \(data\.source\)"):
        load_rlhf_dataset("./data/missing", "sft")
    (tmp_path / "empty_folder").mkdir()
    with pytest.raises(DataSourceError, match="a folder with no sft/train file"):
        load_rlhf_dataset(tmp_path / "empty_folder", "sft")
    from datasets import Dataset

    Dataset.from_dict({"prompt": [], "response": []}).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(DataSourceError, match="has no rows"):
        load_rlhf_dataset(tmp_path / "none.parquet", "sft")


# --------------------------------------------------------------------------------------------------
# column mapping and formats
# --------------------------------------------------------------------------------------------------


def test_column_mapping(tmp_path):
    path = _jsonl(tmp_path / "qa.jsonl", [{"question": r["prompt"], "answer": r["response"], "id": i}
                                          for i, r in enumerate(ROWS)])
    ds = load_rlhf_dataset(path, "sft", columns={"prompt": "question", "response": "answer"})
    assert ds.select_columns(["prompt", "response"]).to_list() == ROWS
    with pytest.raises(DataSourceError, match=r"column\(s\) \['reply'\] \(for \['response'\]\) not in"):
        load_rlhf_dataset(path, "sft", columns={"prompt": "question", "response": "reply"})
    with pytest.raises(DataSourceError, match=r"unknown field\(s\) \['answer'\]"):
        load_rlhf_dataset(path, "sft", columns={"answer": "answer"})
    with pytest.raises(DataSourceError, match=r"missing \['prompt', 'response'\].*data\.columns\.prompt=question"):
        load_rlhf_dataset(path, "sft")
    # a column already named like a mapped field is replaced by the mapped one
    both = _jsonl(tmp_path / "both.jsonl",
                  [{"prompt": r["prompt"], "response": "x", "good": r["response"]} for r in ROWS])
    assert load_rlhf_dataset(both, "sft", columns={"response": "good"})["response"] == [r["response"] for r in ROWS]


def test_formats_are_detected_and_normalised(tmp_path):
    assert str(detect_format(["text"])) == "text (standard)"
    assert detect_format(["messages"]).conversational
    conv = {"prompt": [{"role": "user", "content": "x"}], "completion": [{"role": "assistant", "content": "y"}]}
    assert detect_format(["prompt", "completion"], conv).conversational
    assert detect_format(["chosen", "rejected"]).kind == "implicit_preference"
    assert detect_format(["foo"]) is None
    # prompt + completion is read as prompt + response
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": r["prompt"], "completion": r["response"]} for r in ROWS])
    assert load_rlhf_dataset(path, "sft")["response"] == [r["response"] for r in ROWS]
    # implicit preference, standard: the prompt is the shared beginning (the space goes with the answer)
    path = _jsonl(tmp_path / "ip.jsonl", [{"chosen": "list 2 fruits : apple pear", "rejected": "list 2 fruits : cat"}])
    row = load_rlhf_dataset(path, "reward")[0]
    assert row == {"chosen": " apple pear", "rejected": " cat", "prompt": "list 2 fruits :"}
    # implicit preference, conversational: the shared messages
    user = {"role": "user", "content": "list 2 fruits :"}
    path = _jsonl(tmp_path / "ipc.jsonl", [{"chosen": [user, {"role": "assistant", "content": "apple pear"}],
                                            "rejected": [user, {"role": "assistant", "content": "cat"}]}])
    row = load_rlhf_dataset(path, "reward")[0]
    assert row["prompt"] == [user] and row["chosen"] == [{"role": "assistant", "content": "apple pear"}]
    # PPO prompts from conversations: everything before the last assistant turn
    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    prompts = load_rlhf_dataset(path, "ppo")["prompt"]
    assert prompts[0] == CHAT[0]["messages"][:4] and prompts[1] == CHAT[1]["messages"][:1]


# --------------------------------------------------------------------------------------------------
# blends and evaluation rows
# --------------------------------------------------------------------------------------------------


def test_blend_is_weighted_deterministic_and_exhausts_before_repeating():
    from datasets import Dataset

    a = Dataset.from_dict({"prompt": [f"a{i}" for i in range(5)]})
    b = Dataset.from_dict({"prompt": [f"b{i}" for i in range(8)]})
    mixed = blend([a, b], [3, 1], seed=0, size=40)
    counts = collections.Counter(p for p in mixed["prompt"])
    assert sum(v for k, v in counts.items() if k[0] == "a") == 30
    assert {counts[f"a{i}"] for i in range(5)} == {6}  # 6 whole passes over a
    assert sorted(counts[f"b{i}"] for i in range(8)) == [1] * 6 + [2] * 2  # every row of b before any twice
    assert blend([a, b], [3, 1], seed=0, size=40)["prompt"] == mixed["prompt"]
    assert blend([a, b], [3, 1], seed=1, size=40)["prompt"] != mixed["prompt"]
    assert len(blend([a, b], [1, 1], seed=0)) == 13  # default size: all rows
    assert blend([a], [1.0])["prompt"] == a["prompt"]  # one source: unchanged
    with pytest.raises(DataSourceError, match="weights must be positive"):
        as_sources([{"path": "x.jsonl", "weight": 0}])
    with pytest.raises(DataSourceError, match="unknown key"):
        as_sources([{"path": "x.jsonl", "wieght": 1}])


def test_heldout_rows_are_never_trained_on(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "x"} for i in range(20)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "response": "y"} for i in range(40)])
    # b is oversampled 4x in the blend: its held-out rows must be split off before blending
    blend_of = DataSettings(sources=[{"path": a, "weight": 1}, {"path": b, "weight": 4}], eval_split="0.1")
    data = load_rlhf_data(blend_of, "sft", seed=3, size=200)
    train, heldout = set(data.train["prompt"]), set(data.eval["prompt"])
    assert len(heldout) == 2 + 4 and not train & heldout
    assert "2 rows held out of" in data.eval_origin and "4 rows held out of" in data.eval_origin
    assert len(data.train) == 200
    again = load_rlhf_data(blend_of, "sft", seed=3, size=200)
    assert again.train["prompt"] == data.train["prompt"] and again.eval["prompt"] == data.eval["prompt"]
    # a row count works too; a split leaving nothing to train on does not
    assert len(load_rlhf_data(DataSettings(source=a, eval_split="5"), "sft").eval) == 5
    with pytest.raises(DataSourceError, match="leaves none to train on"):
        load_rlhf_data(DataSettings(source=a, eval_split="20"), "sft")
    train_rows, held = heldout_split(load_rlhf_dataset(a, "sft"), 0.25, seed=0)
    assert len(held) == 5
    assert train_rows["prompt"] == [p for p in (f"a{i}" for i in range(20)) if p not in held["prompt"]]


def test_explicit_and_named_evaluation_rows(tmp_path, caplog):
    from datasets import Dataset, DatasetDict

    train = _jsonl(tmp_path / "train.jsonl", ROWS[:4])
    ev = _jsonl(tmp_path / "ev.jsonl", [{"prompt": "list 3 tools :"}])
    data = load_rlhf_data(DataSettings(source=train, eval_source=ev), "sft", eval_stage="eval")
    assert data.eval["prompt"] == ["list 3 tools :"] and data.eval_origin == f"data.eval_source={ev}"
    with pytest.raises(DataSourceError, match="is also a training source"):
        load_rlhf_data(DataSettings(source=train, eval_source=train), "sft")
    # a single file has no named splits: the old behaviour (its own rows as "eval") is an error now
    with pytest.raises(DataSourceError, match="single file with no 'eval' split.*data.eval_split=0.05"):
        load_rlhf_data(DataSettings(source=train, eval_split="eval"), "ppo")
    # the folder layout: ppo.jsonl to train on, eval.jsonl to evaluate on
    folder = tmp_path / "layout"
    _jsonl(folder / "ppo.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    _jsonl(folder / "eval.jsonl", [{"prompt": "list 4 tools :"}])
    data = load_rlhf_data(DataSettings(source=str(folder), eval_split="eval"), "ppo", eval_stage="eval")
    assert len(data.train) == 6 and data.eval["prompt"] == ["list 4 tools :"]
    # a DatasetDict folder with a test split; one without it is refused
    ds = Dataset.from_list(ROWS)
    DatasetDict({"train": ds.select(range(4)), "test": ds.select([4, 5])}).save_to_disk(str(tmp_path / "dd"))
    data = load_rlhf_data(DataSettings(source=str(tmp_path / "dd"), eval_split="test"), "sft")
    assert len(data.train) == 4 and data.eval["prompt"] == [ROWS[4]["prompt"], ROWS[5]["prompt"]]
    ds.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataSourceError, match="single dataset with no 'test' split"):
        load_rlhf_data(DataSettings(source=str(tmp_path / "one"), eval_split="test"), "sft")
    with caplog.at_level("WARNING"):
        assert load_rlhf_data(DataSettings(source=train, eval_split="none"), "sft").eval is None
    assert "no evaluation rows" in caplog.text


# --------------------------------------------------------------------------------------------------
# collators on conversational rows (standard rows: tests/unit/test_rlhf_data.py)
# --------------------------------------------------------------------------------------------------


def _tokens(tok, ids):
    return tok.convert_ids_to_tokens([i for i in ids if i >= 0])


def test_text_rows_learn_every_token(tok):
    batch = SFTCollator(tok, 16, 16)([{"text": "apple pear plum"}])
    assert _tokens(tok, batch["input_ids"][0].tolist()) == ["<s>", "apple", "pear", "plum", "</s>"]
    assert batch["labels"][0].tolist()[0] == -100 and _tokens(tok, batch["labels"][0].tolist()) == [
        "apple", "pear", "plum", "</s>"]


def test_conversational_sft_learns_only_assistant_tokens(chat_tok):
    batch = SFTCollator(chat_tok, 32, 16)(CHAT)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert _tokens(chat_tok, ids)[:8] == ["<s>", "<|system|>", "say", "tell", "<|user|>", "list", "2", "fruits"]
    learned = [t for t, lab in zip(_tokens(chat_tok, ids), labels, strict=True) if lab != -100]
    assert learned == ["apple", "pear", "</s>", "cat", "dog", "</s>"]  # both assistant turns, nothing else
    assert all(lab in (-100, i) for i, lab in zip(ids, labels, strict=True))
    # the single-turn conversation == the same row as prompt/completion messages
    row = CHAT[1]["messages"]
    as_pc = SFTCollator(chat_tok, 32, 16)([{"prompt": row[:1], "response": row[1:]}])
    assert torch.equal(as_pc["input_ids"], batch["input_ids"][1:2, : as_pc["input_ids"].shape[1]])
    assert torch.equal(as_pc["labels"], batch["labels"][1:2, : as_pc["labels"].shape[1]])


def test_conversational_prompts_and_pairs(chat_tok):
    user = [{"role": "user", "content": "list 2 fruits :"}]
    batch = PromptCollator(chat_tok, 16)([{"prompt": user}, {"messages": CHAT[1]["messages"]}])
    first = _tokens(chat_tok, batch["input_ids"][0].tolist())
    assert first[-7:] == ["<s>", "<|user|>", "list", "2", "fruits", ":", "<|assistant|>"]  # generation prompt last
    assert batch["prompts"] == ["list 2 fruits :", "list 3 colors :"]  # texts for judges
    assert batch["prompt_messages"][0] == user
    pairs = PairCollator(chat_tok, 16, 16)([{"prompt": user, "chosen": [{"role": "assistant", "content": "apple pear"}],
                                              "rejected": "cat"}])
    assert _tokens(chat_tok, pairs["input_ids"][0].tolist()) == first[-7:] + ["apple", "pear", "</s>"]
    n = int(pairs["attention_mask"][1].sum())
    assert _tokens(chat_tok, pairs["input_ids"][1, :n].tolist()) == first[-7:] + ["cat", "</s>"]


def test_conversational_data_needs_a_chat_template(tok, tmp_path):
    with pytest.raises(ValueError, match="has no chat template"):
        SFTCollator(tok, 16, 16)(CHAT)
    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    with pytest.raises(DataSourceError, match=r"data.source is conversational .* tokenizer of roles.actor.model"):
        check_rlhf_data(path, "sft", tokenizer=tok)


def test_chat_prompt_generates_the_learned_answer(chat_tok, tmp_path):
    """SFT on a conversation (assistant tokens only), then generation from the chat-template prompt with the
    generation prompt: the model answers after <|assistant|> and stops at EOS."""
    from transformers import AutoModelForCausalLM

    chat_tok.save_pretrained(str(tmp_path / "t"))
    folder = tiny.build_tiny_causal_lm(tmp_path / "m", tmp_path / "t", hidden=32, layers=1, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    rows = [{"messages": [{"role": "user", "content": "list 3 fruits :"},
                          {"role": "assistant", "content": "kiwi lemon plum"}]}]
    batch = SFTCollator(chat_tok, 16, 16)(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(60):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    prompts = PromptCollator(chat_tok, 16)([{"messages": rows[0]["messages"]}])
    with torch.no_grad():
        out = model.eval().generate(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                                    max_new_tokens=6, do_sample=False, eos_token_id=chat_tok.eos_token_id,
                                    pad_token_id=chat_tok.pad_token_id)
    answer = out[0, prompts["input_ids"].shape[1]:].tolist()
    assert _tokens(chat_tok, answer)[:4] == ["kiwi", "lemon", "plum", "</s>"]


def test_check_rlhf_data_reports_before_any_rank_starts(chat_tok, tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", CHAT)
    std = _jsonl(tmp_path / "std.jsonl", ROWS)
    report = check_rlhf_data(path, "sft", tokenizer=chat_tok)
    assert report["rows"] == 2 and report["conversational"] and "messages" in report["sources"][0]["format"]
    with pytest.raises(DataSourceError, match="some sources are conversational and some standard"):
        check_rlhf_data([{"path": path}, {"path": std}], "sft")
    with pytest.raises(DataSourceError, match="no such file or folder"):
        check_rlhf_data(str(tmp_path / "missing.jsonl"), "reward")
    with pytest.raises(DataSourceError, match=r"reward stage\) has columns \['prompt', 'response'\]"):
        check_rlhf_data(std, "reward")

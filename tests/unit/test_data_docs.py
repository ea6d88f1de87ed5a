"""Every example of docs/data.md runs: each example file is written and loaded (and encoded without unknown
tokens), and the Python snippets run in order in the folder holding those files."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import (
    PairCollator,
    PromptCollator,
    SFTCollator,
    detect_format,
    load_rlhf_dataset,
)
from PIL import Image

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"
EXAMPLE = re.compile(r"<!-- example: (\S+)((?: [^>]*?)?) -->\n```\w*\n(.*?)```", re.S)
RUN = re.compile(r"<!-- run -->\n```python\n(.*?)```", re.S)


def _examples():
    text = DOC.read_text(encoding="utf-8")
    out = []
    for name, opts, body in EXAMPLE.findall(text):
        words = opts.split()
        flags = {w for w in words if "=" not in w}
        kv = dict(w.split("=", 1) for w in words if "=" in w)
        columns = dict(pair.split(":") for pair in kv["columns"].split(",")) if "columns" in kv else None
        out.append({"name": name, "stage": kv.get("stage"), "chat": "chat" in flags, "images": "images" in flags,
                    "columns": columns, "body": body})
    return out


def test_the_page_has_examples_and_snippets():
    examples = _examples()
    assert len(examples) >= 14 and len(RUN.findall(DOC.read_text(encoding="utf-8"))) >= 6
    assert {e["stage"] for e in examples} == {"sft", "reward", "ppo", None}


def _write_all(root: Path):
    (root / "images").mkdir(exist_ok=True)
    for i, color in enumerate([(220, 30, 30), (30, 60, 220), (30, 170, 40)]):
        Image.new("RGB", (16, 16), color).save(root / "images" / f"{i:05d}.png")
    for e in _examples():
        path = root / e["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(e["body"], encoding="utf-8")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_data")
    _write_all(root)
    return root


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs_tok")
    return (tiny.train_tokenizer(tiny.task_vocabulary(), root / "std"),
            tiny.train_tokenizer(tiny.task_vocabulary(), root / "chat", chat_template=True))


@pytest.mark.parametrize("example", [e for e in _examples() if e["stage"]], ids=lambda e: e["name"])
def test_rlhf_example_files_load_and_encode(example, folder, tokenizers):
    ds = load_rlhf_dataset(folder / example["name"], example["stage"], columns=example["columns"])
    assert len(ds) == (2 if example["name"].endswith(".csv") else 3)
    assert detect_format(ds.column_names, ds[0]).conversational == example["chat"]
    tok = tokenizers[1] if example["chat"] else tokenizers[0]
    rows = ds.to_list()
    if example["stage"] == "sft":
        batch = SFTCollator(tok, 32, 16)(rows)
        assert (batch["labels"] != -100).any(dim=1).all()
    elif example["stage"] == "reward":
        batch = PairCollator(tok, 32, 16)(rows)
    else:
        batch = PromptCollator(tok, 32)(rows)
    assert tok.unk_token_id not in batch["input_ids"].tolist()  # every word of the examples is in the vocabulary


def test_image_example_files_load(folder):
    from multiengine.pipelines.diffusion.data import load_image_caption_dataset

    for e in (e for e in _examples() if e["images"]):
        source = folder / e["name"]
        source = source.parent if source.name == "metadata.jsonl" else source
        ds = load_image_caption_dataset(str(source), columns=e["columns"], cache_dir=str(folder / "cache"))
        image = (e["columns"] or {}).get("image", "image")
        assert len(ds) == 3 and ds[0][image].size == (16, 16), e["name"]


def test_snippets_run(folder, monkeypatch):
    monkeypatch.chdir(folder)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, code in enumerate(RUN.findall(DOC.read_text(encoding="utf-8"))):
            exec(compile(code, f"docs/data.md snippet {i}", "exec"), namespace)  # noqa: S102 - our own docs
    printed = out.getvalue()
    assert "{'prompt': 'list 3 fruits :', 'response': 'apple pear plum'}" in printed
    assert "\n8\n" in printed and "no such folder: ./models/my-gpt2 (model.pretrained)" in printed

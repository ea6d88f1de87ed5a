"""Every `multiengine run <recipe> ...` command of docs/data.md passes `multiengine validate <recipe> ...` with the
same arguments (its --nproc-per-node too: the batches must fit that many ranks), against the files and folders
it names: the page's example files grown to 80 rows (a batch per rank of the tiny configs needs more than the
page shows), tiny models in place of the user's, a save_to_disk image folder. The page's absolute
placeholders (/data/..., /models/...) are rooted in a temporary folder, which is also the working directory
for its relative paths (qa.jsonl, outputs/rlhf_sft/export/actor)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
from test_data_docs import DOC, _examples, _write_all

BASH = re.compile(r"```bash\n(.*?)```", re.S)
ROOTS = ("/data/", "/models/")  # the page's placeholders for the user's folders


def doc_commands() -> list[list[str]]:
    """The `multiengine run` commands of the page's bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in BASH.findall(DOC.read_text(encoding="utf-8")):
        lines = [line for line in block.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#")]
        commands += [shlex.split(line) for line in lines if line.strip().startswith("multiengine run ")]
    return commands


def as_validate(argv: list[str], root: Path) -> list[str]:
    """`multiengine run R --nproc-per-node N args` -> `validate R --nproc-per-node N args`, the placeholders
    rooted in `root`."""
    assert argv[:2] == ["multiengine", "run"], argv
    out = ["validate"]
    for arg in argv[2:]:
        for prefix in ROOTS:
            arg = arg.replace(prefix, f"{root}{prefix}")
        out.append(arg)
    return out


def _example(name: str) -> str:
    return next(e["body"] for e in _examples() if e["name"] == name)


def _jsonl(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_grown(body), encoding="utf-8")


def _grown(body: str, rows: int = 80) -> str:
    """The example's rows repeated to ``rows`` lines."""
    lines = [line for line in body.splitlines() if line.strip()]
    return "".join(lines[i % len(lines)] + "\n" for i in range(rows))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The page's files and folders: its examples, and for what it leaves to the user, tiny stand-ins."""
    import pandas as pd
    from multiengine.pipelines.diffusion.data import load_image_caption_dataset, make_shapes_dataset
    from multiengine.pipelines.rlhf import tiny
    from multiengine.recipes.sd_finetune import build_tiny_model
    from transformers import AutoTokenizer, OPTConfig, OPTForSequenceClassification

    root = tmp_path_factory.mktemp("docs_commands")
    _write_all(root)  # qa.jsonl, chat.jsonl, pairs.jsonl, prompts.jsonl, images/, ...
    _jsonl(root / "qa.jsonl", _example("qa.jsonl"))
    data, models = root / "data", root / "models"
    # a causal LM whose tokenizer has a chat template (the SFT of "your conversations"), and an SFT export
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok_chat", chat_template=True)
    tiny.build_tiny_causal_lm(models / "my-llama", root / "tok_chat", hidden=16, layers=1)
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok")
    tiny.build_tiny_causal_lm(root / "outputs" / "rlhf_sft" / "export" / "actor", root / "tok", hidden=16, layers=1)
    # a reward model as TRL saves it: a SequenceClassification checkpoint with one label, and its tokenizer
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    config = OPTConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=1,
                       max_position_embeddings=128, word_embed_proj_dim=16, num_labels=1,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    # ... and the block's own reward export, which rlhf_ppo's tiny config reads when model.reward is not given
    for folder in (models / "trl-reward", root / "outputs" / "rlhf_reward" / "export" / "reward"):
        OPTForSequenceClassification(config).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
    build_tiny_model(str(models / "sd15"), 0, 32, "sd")
    # the data files, from the page's examples
    _jsonl(data / "chats.jsonl", _example("chat.jsonl"))
    rows = [json.loads(line) for line in _grown(_example("pairs.jsonl")).splitlines()]
    pd.DataFrame([{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in rows]).to_parquet(
        data / "prefs.parquet")
    for name in ("prompts.jsonl", "eval_prompts.jsonl", "a.jsonl", "b.jsonl"):
        _jsonl(data / name, _example("prompts.jsonl"))
    # the user's captioned images (more than the tiny config holds out), saved with a `prompt` column
    shapes = make_shapes_dataset(str(root / "shapes"), n=24, resolution=32, seed=0)
    images = load_image_caption_dataset(shapes, cache_dir=str(root / "cache"))
    images.rename_column("text", "prompt").save_to_disk(str(data / "my_images_saved"))
    return root


def test_the_page_has_its_commands():
    recipes = [argv[2] for argv in doc_commands()]
    assert recipes == ["rlhf_sft", "rlhf_sft", "rlhf_reward", "rlhf_ppo", "rlhf_ppo", "sd_finetune"]


@pytest.mark.parametrize("argv", doc_commands(), ids=lambda a: f"{a[2]}:{'+'.join(x for x in a[3:] if '=' in x)[:60]}")
def test_doc_command_validates(argv, root, monkeypatch):
    from multiengine.recipes.language.cli import main

    monkeypatch.chdir(root)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    command = as_validate(argv, root)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(command)
    assert code == 0, f"multiengine {shlex.join(command)}\n{err.getvalue()[-3000:]}"
    assert f"ok: config for recipe '{argv[2]}' is valid" in out.getvalue()

"""Up-front checks of model folders and tokenizers (no model is built)."""

from __future__ import annotations

import pytest
from multiengine.pipelines.checks import (
    ModelFolderError,
    check_diffusers_folder,
    check_model_folder,
    check_vocab_fits,
    tokenizer_size,
)
from multiengine.pipelines.rlhf import tiny


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok")
    chat = tiny.train_tokenizer(tiny.task_vocabulary(), root / "chat_tok", chat_template=True)
    return {"root": root, "model": str(tiny.build_tiny_causal_lm(root / "m", root / "tok", hidden=16, layers=1)),
            "chat": chat}


def test_model_folders(lm, tmp_path, monkeypatch):
    assert check_model_folder(lm["model"]) == "local"
    for missing in (str(tmp_path / "gone"), "./outputs/rlhf_sft/export/actor", "~/nope/x", "a/b/c"):
        with pytest.raises(ModelFolderError, match=r"^no such folder: .* \(model\.actor\); check the path"):
            check_model_folder(missing, key="model.actor")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFolderError, match=r"model.pretrained=.*empty' has no config.json.*save_pretrained"):
        check_model_folder(str(tmp_path / "empty"))
    with pytest.raises(ModelFolderError, match="is a file"):
        check_model_folder(lm["model"] + "/config.json")
    # a hub name: fine online; offline it must be in the local cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert check_model_folder("someone/not-downloaded") == "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelFolderError, match="not in the local hub cache"):
        check_model_folder("someone/not-downloaded")


def test_vocabulary_must_fit(lm):
    assert check_vocab_fits(str(lm["root"] / "tok"), lm["model"]) == (108, 108)
    # the chat tokenizer appends three role tokens the model has no rows for
    assert tokenizer_size(lm["chat"]) == 111
    expected = (r"tokenizer of model.reward .* ids up to 110, but the model of model.actor .* embeds only 108 "
                r"tokens.*resize_token_embeddings\(111\)")
    with pytest.raises(ModelFolderError, match=expected):
        check_vocab_fits(lm["chat"], lm["model"], key="model.actor", tokenizer_key="model.reward")


def test_diffusers_folder(tmp_path):
    from multiengine.pipelines.diffusion.tiny import build_tiny_sd

    path = build_tiny_sd(str(tmp_path / "sd"), seed=0, resolution=16)
    assert check_diffusers_folder(path) == ["text_encoder"]
    with pytest.raises(ModelFolderError, match=r"no such folder: .*missing_sd \(model.pretrained\)"):
        check_diffusers_folder(str(tmp_path / "missing_sd"))
    with pytest.raises(ModelFolderError, match="has no model_index.json"):
        check_diffusers_folder(path + "/unet")

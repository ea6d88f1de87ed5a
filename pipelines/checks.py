"""Cheap checks of a user's model folders and tokenizers, meant to run before any rank starts (the data
checks are ``rlhf.data.check_rlhf_data`` and ``diffusion.data.check_image_caption_data``).

Nothing here builds a model: only ``config.json`` / ``model_index.json`` and tokenizer files are read.
Every error names the config key, the value and the fix.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .sources import is_hub_name

logger = logging.getLogger(__name__)

__all__ = ["ModelFolderError", "check_diffusers_folder", "check_model_folder", "check_vocab_fits", "load_tokenizer",
           "tokenizer_size"]


class ModelFolderError(ValueError):
    """A model folder / tokenizer that cannot be used as given (key, value and fix in the message)."""


def _offline() -> bool:
    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in flags)


def check_model_folder(path: str, key: str = "model.pretrained", kind: str = "transformers") -> str:
    """Check that ``path`` can be loaded as a model: an existing local folder with ``config.json``
    (``kind="transformers"``) or ``model_index.json`` (``kind="diffusers"``), or a hub name.

    A path that looks local (absolute, ``./``, ``~``, more than one ``/``) and does not exist is
    "no such folder", never a hub lookup; a hub name is checked against the local cache when offline.

    Returns:
        ``"local"`` or ``"hub"``.

    Raises:
        ModelFolderError: naming ``key``, the path and what to do.
    """
    if kind not in ("transformers", "diffusers"):
        raise ValueError(f"kind={kind!r}; use 'transformers' or 'diffusers'")
    marker = "config.json" if kind == "transformers" else "model_index.json"
    expanded = os.path.expanduser(str(path))
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, marker)):
            has = sorted(os.listdir(expanded))[:8]
            what = "a Hugging Face model folder (save one with save_pretrained)" if kind == "transformers" else \
                "a diffusers pipeline folder (DiffusionPipeline.save_pretrained)"
            raise ModelFolderError(f"{key}={path!r} has no {marker}, so it is not {what}; it holds {has}")
        return "local"
    if os.path.exists(expanded):
        raise ModelFolderError(f"{key}={path!r} is a file; give the folder that holds {marker}")
    if not is_hub_name(str(path)):
        raise ModelFolderError(f"no such folder: {path} ({key}); check the path (relative paths are read from "
                               f"{os.getcwd()})")
    if _offline():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(path), marker)
        if not isinstance(cached, str):
            raise ModelFolderError(
                f"no such folder: {path} ({key}), and {path} is not in the local hub cache (offline mode is on); "
                f"give a local folder, or download it first (huggingface-cli download {path})")
    else:
        logger.info("%s=%s is not a local folder: loading it from the hub (or its local cache)", key, path)
    return "hub"


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
_PROBE = "list 3 fruits : apple pear plum. Hello, world! 12345 \u00e9t\u00e9"


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path)``, except where transformers replaces a local folder's own
    tokenizer with its model family's class.

    For some families (Qwen2, Phi-3 among them) transformers ignores a generic ``tokenizer_class`` in
    ``tokenizer_config.json`` and builds the family's tokenizer from the vocabulary instead: a tokenizer the
    user trained (word level, or other pre-tokenization) then encodes text differently from its own
    ``tokenizer.json``, and training runs on wrong ids without any error. When the folder declares a generic
    class and the family class encodes a probe differently from ``tokenizer.json``, the folder's tokenizer is
    loaded as declared, with a warning.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    folder = Path(os.path.expanduser(str(path)), kwargs.get("subfolder") or "")
    raw_file, config_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if type(tokenizer).__name__ in _GENERIC_TOKENIZERS or not (raw_file.is_file() and config_file.is_file()):
        return tokenizer
    declared = json.loads(config_file.read_text()).get("tokenizer_class") or ""
    if declared not in _GENERIC_TOKENIZERS:
        return tokenizer
    from tokenizers import Tokenizer

    if tokenizer(_PROBE)["input_ids"] == Tokenizer.from_file(str(raw_file)).encode(_PROBE).ids:
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    logger.warning("%s: transformers loads this folder's tokenizer as %s, which encodes text differently from "
                   "its tokenizer.json; using the tokenizer as saved (tokenizer_class %s in tokenizer_config.json)",
                   path, type(tokenizer).__name__, declared)
    return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)


def tokenizer_size(tokenizer: Any) -> int:
    """The embedding rows a tokenizer needs: its largest id + 1 (added tokens included)."""
    vocab = tokenizer.get_vocab()
    return max(max(vocab.values()) + 1 if vocab else 0, len(tokenizer))


def _vocab_size(config: Any) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        size = getattr(cfg, "vocab_size", None) if cfg is not None else None
        if size:
            return int(size)
    return None


def check_vocab_fits(tokenizer: Any, model_path: str, *, key: str = "model.pretrained",
                     tokenizer_key: str | None = None, subfolder: str | None = None) -> tuple[int, int | None]:
    """Check that every id of ``tokenizer`` has a row in the model's embedding (from its ``config.json``).

    Args:
        tokenizer: a tokenizer object, or a folder / hub name to load one from (``AutoTokenizer``).
        model_path: the model folder (or hub name) whose config gives ``vocab_size``.
        key, tokenizer_key: config keys named in the error.
        subfolder: the model's subfolder (a diffusers text encoder).

    Returns:
        ``(tokenizer size, model vocab size or None when the config has none)``.

    Raises:
        ModelFolderError: the tokenizer has ids the model cannot embed.
    """
    from transformers import AutoConfig

    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(str(tokenizer))
    kwargs = {"subfolder": subfolder} if subfolder else {}
    vocab = _vocab_size(AutoConfig.from_pretrained(str(model_path), **kwargs))
    need = tokenizer_size(tokenizer)
    if vocab is not None and need > vocab:
        where = f"{model_path}/{subfolder}" if subfolder else str(model_path)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ModelFolderError(
            f"the tokenizer{f' of {tokenizer_key}' if tokenizer_key else ''} ({name}) has ids up to {need - 1}, but "
            f"the model of {key} ({where}) embeds only {vocab} tokens: ids >= {vocab} would index past its embedding. "
            f"Use the model's own tokenizer, or resize the model (model.resize_token_embeddings({need}) and "
            f"save_pretrained)")
    return need, vocab


def check_diffusers_folder(path: str, key: str = "model.pretrained") -> list[str]:
    """A local diffusers folder: ``model_index.json``, each text encoder's config and tokenizer, and the
    tokenizers' vocabularies fit their encoders. Returns the text encoder names (hub names: ``[]``)."""
    if check_model_folder(path, key, kind="diffusers") == "hub":
        return []
    index = json.loads((Path(os.path.expanduser(path)) / "model_index.json").read_text(encoding="utf-8"))
    encoders = sorted(k for k, v in index.items() if k.startswith("text_encoder") and isinstance(v, list) and v[0])
    for enc in encoders:
        tok = enc.replace("text_encoder", "tokenizer", 1)
        for sub in (enc, tok):
            if not os.path.isdir(os.path.join(os.path.expanduser(path), sub)):
                raise ModelFolderError(f"{key}={path!r}: model_index.json lists {sub!r} but the folder has no {sub}/")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.join(os.path.expanduser(path), tok))
        check_vocab_fits(tokenizer, os.path.expanduser(path), key=key, tokenizer_key=f"{key}/{tok}", subfolder=enc)
    return encoders

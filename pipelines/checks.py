"""Cheap checks, before any rank starts, of model folders, tokenizers and batch arithmetic (config.json /
model_index.json and tokenizer files only); every error names the config key, the value and the fix."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from multiengine.engines.settings import SettingsError

from .sources import is_hub_name

logger = logging.getLogger(__name__)

__all__ = ["ModelFolderError", "check_diffusers_folder", "check_model", "check_model_folder", "check_rows_per_rank",
           "check_stage_batches", "check_tokenizer", "check_vocab_fits", "has_tokenizer", "heldout_of_training",
           "load_tokenizer", "resolve_tokenizer", "role_tokenizer", "tokenizer_size"]


class ModelFolderError(SettingsError):
    """A model folder / tokenizer that cannot be used as given (key, value and fix in the message): a config
    error, reported without a traceback."""


def _offline() -> bool:
    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in flags)


def check_model_folder(path: str, key: str = "model.pretrained", kind: str = "transformers") -> str:
    """``"local"`` (a folder with ``config.json`` or, for ``kind="diffusers"``, ``model_index.json``) or ``"hub"``; a
    local-looking missing path is an error, never a hub lookup. ModelFolderError names ``key``, the path, the fix."""
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
    """``AutoTokenizer.from_pretrained(path)``, except where transformers swaps in its family's tokenizer (Qwen2,
    Phi-3 ignore a generic ``tokenizer_class``) and would encode differently: then the declared one, with a warning."""
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


def has_tokenizer(path: str) -> bool:
    """A local folder holding tokenizer files."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("tokenizer.json", "tokenizer_config.json"))


def resolve_tokenizer(*candidates: str) -> Any:
    """``AutoTokenizer`` from the first candidate that has one: a local folder with tokenizer files (exports
    carry their tokenizer), or a hub name (from the hub or its local cache). A tokenizer without a pad token
    gets its EOS as the pad token (decoder-only models often ship without one)."""
    errors = []
    for path in candidates:
        if not path:
            continue
        path = os.path.expanduser(str(path))
        if not (has_tokenizer(path) or (not os.path.exists(path) and is_hub_name(path))):
            continue
        try:
            tok = load_tokenizer(path)
        except (OSError, ValueError) as err:
            errors.append(f"{path}: {err}")
            continue
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    detail = f" ({'; '.join(errors)})" if errors else ""
    raise FileNotFoundError(f"no tokenizer in any of {[c for c in candidates if c]}{detail}")


def role_tokenizer(given: str, model_path: str, fallback: Any = None, *, what: str = "") -> Any:
    """A role's tokenizer: ``given`` (a tokenizer folder or hub name: its ``roles.<role>.tokenizer``), else the
    model folder's own, else ``fallback`` (e.g. the actor's, for a folder saved without one; logged)."""
    if given:
        return resolve_tokenizer(given)
    if has_tokenizer(os.path.expanduser(model_path)) or (not os.path.exists(model_path) and is_hub_name(model_path)):
        return resolve_tokenizer(model_path)
    if fallback is None:
        raise FileNotFoundError(f"no tokenizer in {model_path}; set the tokenizer key of {what or 'this role'}")
    logger.info("%s: %s has no tokenizer files; using %s's", what or "role", model_path,
                getattr(fallback, "name_or_path", "the actor"))
    return fallback


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
    """``(tokenizer size, the model's vocab_size or None)``: every tokenizer id has an embedding row in the model at
    ``model_path``, else ModelFolderError naming ``key`` and ``tokenizer_key``."""
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


def check_model(key: str, path: str) -> None:
    """``path`` (a ``model`` key) is a model folder with ``config.json`` or a hub name; "" passes (the built-in
    tiny model)."""
    if path:
        check_model_folder(str(path), key=key)


def check_tokenizer(key: str, given: str, model_key: str, model_path: str, fallback: Any = None) -> Any:
    """Load the tokenizer of a role (``given`` = its tokenizer key's value, else the model folder's) and check
    that the model embeds every id of it; returns it (``None`` when ``model_path`` is "")."""
    if not model_path:
        return None
    try:
        tok = role_tokenizer(given, model_path, fallback, what=model_key)
    except (OSError, ValueError) as err:
        raise SettingsError(f"{key if given else model_key}={given or model_path!r}: cannot load a "
                                f"tokenizer ({err}); set {key} to a tokenizer folder") from None
    check_vocab_fits(tok, str(model_path), key=model_key, tokenizer_key=key if given else model_key)
    return tok


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


# --- batch arithmetic: the rows each rank gets against the batches it draws ---------------------------------------
def check_rows_per_rank(rows: int, world_size: int, *, key: str, value: int, factor: int = 1, unit: str = "rows",
                        what: str = "", heldout: int = 0, heldout_key: str = "data.eval_split",
                        setting: str = "{key}={n}") -> None:
    """Refuse a batch (``value x factor`` rows per rank and step) that ``rows // world_size`` training rows per rank
    (less ``heldout``) cannot fill, before the run builds its models. ConfigValueError naming the key, value, fixes."""
    from multiengine.engines.settings import config_problem

    need = int(value) * int(factor)
    per_rank = rows // world_size
    if per_rank >= need:
        return
    ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
    after = f" (left after {heldout} held out for evaluation)" if heldout else ""
    problem = (f"asks for {need} {unit} per rank per step{f' ({what})' if what else ''}, but the {rows} training "
               f"{unit}{after} give {per_rank} per rank on {ranks}")
    fixes = []
    largest = per_rank // factor
    if largest >= 1:
        fixes.append(f"set {setting.format(key=key, n=largest)} or less")
    fit = rows // need
    if world_size > 1 and fit >= 1:
        fixes.append(f"run on {'1 rank' if fit == 1 else f'{fit} ranks or fewer'} (--nproc-per-node x --nnodes)")
    if heldout and (rows + heldout) // world_size >= need:
        fixes.append(f"hold out fewer rows ({heldout_key}; {heldout} now) or give evaluation rows of their own "
                     "(data.eval_source)")
    fixes.append(f"add training {unit}")
    fix = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + f", or {fixes[-1]}"
    raise config_problem(key, value, problem, fix)


def check_stage_batches(report: dict[str, Any] | None, world_size: int, *, key: str, value: int, factor: int = 1,
                        unit: str = "rows", what: str = "", setting: str = "{key}={n}") -> None:
    """:func:`check_rows_per_rank` for the training rows of a data check's report; built-in data passes."""
    if report is None:
        return
    check_rows_per_rank(int(report["train_rows"]), world_size, key=key, value=value, factor=factor, unit=unit,
                        what=what, heldout=heldout_of_training(report), setting=setting)


def heldout_of_training(report: dict[str, Any]) -> int:
    """Evaluation rows that the data check's split took out of the training rows (not a split or file of their own)."""
    return int(report.get("eval_rows") or 0) if "held out" in str(report.get("eval_origin") or "") else 0

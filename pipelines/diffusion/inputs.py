"""What a diffusion fine-tune reads before it trains, checked before any rank starts: the pipeline folder (its
family, the image side it allows), the image-caption rows (sources, columns, held-out split, unreadable
images, training rows per rank), and the RL recipes' rewards and prompts. Flat values in; the config keys
that the messages name are passed in, the diffusion recipes' names by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from multiengine.engines.settings import SettingsError, config_problem
from multiengine.pipelines.diffusion import data as data_lib
from multiengine.pipelines.diffusion.families import model_family
from multiengine.pipelines.diffusion.runs import eval_split_value, held_out_of, resolution_multiple

__all__ = ["DATA_KEY_NAMES", "ImageData", "check_config_folder", "check_prompts", "check_resolution", "check_rewards",
           "input_problem", "model_folder_family"]

# The config key of each ImageData field, as the messages name it.
DATA_KEY_NAMES = {"source": "data.source", "sources": "data.sources", "eval_source": "data.eval_source",
                  "eval_split": "data.eval_split", "heldout_size": "eval.heldout_size",
                  "builtin_size": "data.builtin_size", "check_images": "data.check_images"}


def input_problem(key: str, value: Any, problem: str, exc: Exception, named: Sequence[str]) -> SettingsError:
    """A data or model-folder error as the config error: as it is when it already names its key."""
    text = str(exc)
    return SettingsError(text) if text.startswith(tuple(named)) else config_problem(key, value, problem, text)


def model_folder_family(pretrained: str, tiny_family: str, key: str = "model.pretrained") -> str:
    """The family of the pipeline folder ``pretrained`` (a local folder, checked), ``tiny_family`` when it is
    empty, "" for a hub name (its family is known once downloaded)."""
    from multiengine.pipelines.checks import check_diffusers_folder, check_model_folder

    if not pretrained:
        return tiny_family
    try:
        if check_model_folder(pretrained, key, kind="diffusers") != "local":
            return ""
        check_diffusers_folder(pretrained, key)
        return model_family(os.path.expanduser(pretrained))
    except (ValueError, FileNotFoundError) as exc:
        raise input_problem(key, pretrained, "is not a usable diffusers folder", exc, named=(key,)) from None


def check_resolution(resolution: int, family: str, path: str, key: str = "data.resolution") -> None:
    """The image side must be a multiple of what the family's vae and denoiser need: from the folder's configs,
    the tiny models' when ``path`` is no local folder."""
    folder = os.path.expanduser(path) if path and os.path.isdir(os.path.expanduser(path)) else None
    multiple = resolution_multiple(family, folder)
    if resolution % multiple:
        raise config_problem(key, resolution, f"is not a multiple of {multiple}, which this {family} model needs "
                             "(vae downsampling x the denoiser's patches / levels)",
                             f"use {key}={max(multiple, resolution // multiple * multiple)}")


@dataclass(frozen=True)
class ImageData:
    """A run's image-caption rows: ``sources`` (a weighted list) or ``source`` (both empty: the built-in shapes
    data of ``builtin_size`` images); the held-out rows from ``eval_source``, else ``eval_split`` (a fraction, a
    count, a split name), else ``heldout_size`` rows of the training data. ``conditioning``: every row also has a
    conditioning image (its column in ``columns["conditioning_image"]``). ``keys``: the config key per field."""

    source: str = ""
    sources: Sequence[Any] = ()
    columns: Mapping[str, str] = field(default_factory=dict)  # field -> the user's column name (given ones only)
    image_column: str = "image"
    caption_column: str = "text"
    train_split: str = "train"
    eval_source: Any = None
    eval_split: str = ""
    heldout_size: int = 0
    builtin_size: int = 0
    max_train_samples: int = 0  # 0 = every training row
    check_images: bool = True
    cache_dir: str | None = None
    seed: int = 0
    conditioning: bool = False
    keys: Mapping[str, str] = field(default_factory=lambda: dict(DATA_KEY_NAMES))

    @property
    def spec(self) -> Any:
        """The training source(s): ``sources`` when given, else ``source`` ("" = the built-in data)."""
        return list(self.sources) or self.source

    @property
    def spec_key(self) -> str:
        return self.keys["sources"] if self.sources else self.keys["source"]

    @property
    def split_key(self) -> str:
        """The key that sets the held-out split: ``eval_split`` when given, else ``heldout_size``."""
        return self.keys["eval_split"] if self.eval_split.strip() else self.keys["heldout_size"]

    def _args(self) -> tuple[dict[str, Any], dict[str, str] | None]:
        columns, extra = dict(self.columns), None
        if self.conditioning:  # the conditioning images load as an extra image column
            extra = {"conditioning_image": columns.pop("conditioning_image", "conditioning_image")}
        return {"columns": columns, "image_column": self.image_column, "caption_column": self.caption_column,
                "cache_dir": self.cache_dir}, extra

    def load(self, source: Any) -> Any:
        """The training and held-out rows of ``source`` (``spec``, or the built-in data's folder)."""
        args, extra = self._args()
        return data_lib.load_image_caption_data(
            source, train_split=self.train_split, eval_source=self.eval_source or None,
            eval_split=eval_split_value(self.eval_split, self.heldout_size), seed=self.seed, extra_images=extra,
            **args)

    def first_rows(self, rows: Any) -> Any:
        """The first ``max_train_samples`` training rows (all when 0)."""
        return rows.select(range(min(self.max_train_samples, len(rows)))) if self.max_train_samples else rows

    def first_heldout(self, rows: Any | None) -> Any | None:
        """The first ``heldout_size`` held-out rows (None: none held out, or ``heldout_size`` 0)."""
        return None if rows is None or not self.heldout_size else rows.select(range(min(self.heldout_size, len(rows))))

    def _problem(self, key: str, problem: str, exc: Exception) -> SettingsError:
        return input_problem(key, self.spec, problem, exc, named=(self.keys["source"], self.keys["eval_source"]))

    def check(self) -> dict[str, Any] | None:
        """Each source exists, has the columns and rows, enough rows for the held-out split, and (``check_images``)
        every image opens; the built-in data needs only its sizes. Returns the sources' report (None: built-in)."""
        from multiengine.pipelines.sources import DataSourceError

        k, spec = self.keys, self.spec
        if not spec:
            if not self.eval_split.strip() and not self.eval_source and self.heldout_size >= self.builtin_size:
                raise config_problem(k["heldout_size"], self.heldout_size, f"leaves no training rows of the built-in "
                                     f"data ({self.builtin_size} images)", f"set {k['heldout_size']} below "
                                     f"{self.builtin_size} or raise {k['builtin_size']}")
            return None
        args, extra = self._args()
        try:
            report = data_lib.check_image_caption_data(spec, split=self.train_split, key=self.spec_key,
                                                       extra_image_columns=extra, **args)
        except (DataSourceError, ValueError, FileNotFoundError) as exc:
            raise self._problem(self.spec_key, "cannot be used as image-caption data", exc) from None
        held = eval_split_value(self.eval_split, self.heldout_size)
        if not self.eval_source and isinstance(held, int) and held >= report["rows"]:
            raise config_problem(self.split_key, held, f"holds out every row of the data ({report['rows']} rows)",
                                 f"set {self.split_key} below {report['rows']}")
        if self.check_images:
            bad = data_lib.unreadable_images(spec, split=self.train_split, extra_image_columns=extra, **args)
            if bad:
                shown = "; ".join(bad[:10]) + (f"; ... ({len(bad)} in all)" if len(bad) > 10 else "")
                raise config_problem(self.spec_key, spec, f"has {len(bad)} unreadable image(s): {shown}",
                                     f"remove or replace those files (or set {k['check_images']}=false to find them "
                                     "only when training reads them)")
        return report

    def training_rows(self) -> tuple[int, int]:
        """(training rows, rows the held-out split took out of them) as the run will have them: each rank's share
        of the first must fill a micro batch."""
        spec, split = self.spec, eval_split_value(self.eval_split, self.heldout_size)
        if not spec:
            train = self.builtin_size
            held = 0 if self.eval_source else held_out_of(train, split)
            train -= held
        else:
            try:
                data = self.load(spec)
            except (ValueError, FileNotFoundError) as exc:
                raise self._problem(self.spec_key, "cannot be split into training and evaluation rows", exc) from None
            train = len(data.train)
            held = len(data.eval) if data.eval is not None and "held out" in str(data.eval_origin) else 0
        return (min(train, self.max_train_samples) if self.max_train_samples else train), held


def check_config_folder(key: str, folder: str, what: str, fix: str) -> None:
    """A model folder given for ``key`` (a denoiser, a ControlNet, a reward model) holds its config.json."""
    if folder and not os.path.isfile(os.path.join(os.path.expanduser(folder), "config.json")):
        raise config_problem(key, folder, f"has no config.json (not {what})", fix)


def check_rewards(functions: Sequence[str], weights: Sequence[float], eval_reward: str, *,
                  reward_model: str = "reward_model") -> None:
    """reward.functions each load (``reward_model``, the reward role, always does), one weight per function, and
    the evaluation reward loads (the reward role only when the training rewards build it)."""
    from .rl_runs import load_reward_function

    if not functions:
        raise config_problem("reward.functions", [], "is empty: nothing scores the images",
                             "list a builtin (color, shapes, reward_model) or module:function")
    if weights and len(weights) != len(functions):
        raise config_problem("reward.weights", list(weights), f"has {len(weights)} weights for {len(functions)} "
                             "functions", "give one weight per reward function, or []")
    for name in [*functions, *([eval_reward] if eval_reward else [])]:
        if name == reward_model:
            continue
        try:
            load_reward_function(name)
        except (ValueError, ImportError) as exc:
            key = "reward.functions" if name in functions else "eval.reward"
            raise config_problem(key, name, f"cannot be loaded: {exc}", "use a builtin (color, shapes, "
                                 "reward_model) or an importable module:function") from None
    if eval_reward == reward_model and reward_model not in functions:
        raise config_problem("eval.reward", reward_model, "needs the reward role, built only when reward.functions "
                             "lists reward_model", "add reward_model to reward.functions, or set eval.reward=color")


def check_prompts(files: Mapping[str, str], eval_size: int, colors: Sequence[str]) -> None:
    """Each prompt file given (``{key: path}``) holds prompts; without both, the shapes captions of ``colors``
    split into training prompts and ``eval_size`` held-out ones."""
    from .rl_runs import read_prompts, shapes_prompt_split

    for key, path in files.items():
        if not path:
            continue
        try:
            if not read_prompts(os.path.expanduser(path)):
                raise ValueError("it holds no prompt")
        except (OSError, ValueError) as exc:
            raise config_problem(key, path, f"cannot be read as prompts: {exc}", "give a .txt file (one prompt a "
                                 "line) or .json/.jsonl rows with a prompt field") from None
    if not all(files.values()):
        try:
            shapes_prompt_split(eval_size, 0, list(colors))
        except ValueError as exc:
            raise config_problem("eval.size", eval_size, f"cannot split the shapes captions: {exc}",
                                 "set eval.size below the number of captions, or prompts.shapes_colors") from None

"""Recipe configs: a recipe's DEFAULTS, merged with a YAML file and `key=value` overrides, strictly.

A recipe is a module `<package>.<recipe>` (package `multiengine.recipes` by default) defining

* `DEFAULTS: dict` - the complete, nested set of valid keys with their default values (and
  therefore their types), which must include `output_dir`, `seed` and `max_steps`;
* `main(cfg: DictConfig) -> dict` - runs it and returns a summary;
* optionally `check_config(cfg)` - its own checks of values (raising RecipeConfigError), run by
  `load_config`, so the CLI reports them before any rank starts.

Its shipped configs are `configs/<recipe>/<name>.yaml` next to this file. Every key in a YAML
file or an override must exist in DEFAULTS: a typo is an error naming the closest valid key, never
a silently ignored setting. Types follow the default value (bool, int, float - ints accepted -,
str, list); `null` is accepted anywhere and a `${...}` interpolation is accepted for any key.
A default of `None` accepts any value; an empty dict `{}` is a free-form section whose keys are
not checked (for pass-through settings such as extra DeepSpeed config).
"""

from __future__ import annotations

import copy
import difflib
import importlib
import pkgutil
import re
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

RECIPES_PACKAGE = "multiengine.recipes"
CONFIGS_DIR = Path(__file__).resolve().parent / "configs"
REQUIRED_KEYS = ("output_dir", "seed", "max_steps")
# Modules of the recipes package that are infrastructure, not recipes.
_NOT_RECIPES = frozenset({"cli", "common", "config", "lifecycle"})


class RecipeConfigError(ValueError):
    """A user error in choosing or configuring a recipe (the CLI prints it and exits 2)."""


class ConfigKeyError(RecipeConfigError):
    """A key that the recipe's DEFAULTS do not define."""

    def __init__(self, message: str, key: str, value: Any, suggestion: str | None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.suggestion = suggestion


class ConfigTypeError(RecipeConfigError):
    """A value whose type does not match the default's."""


class OverrideSyntaxError(RecipeConfigError):
    """An override that is not `dotted.key=value`."""


class UnknownRecipeError(RecipeConfigError):
    """No recipe module of that name."""


class UnknownConfigError(RecipeConfigError):
    """No shipped config of that name, or a config file that cannot be read."""


class RecipeDefinitionError(TypeError):
    """A recipe module that breaks the contract (no DEFAULTS/main, a required key missing): a bug."""


# --- YAML ------------------------------------------------------------------------------------
# PyYAML follows YAML 1.1: `no`, `off`, `y` become booleans (so `dtype=no` or a prompt "yes" would
# turn into False) and `1e-3` stays a string (it wants `1.0e-3`). This loader accepts only
# true/false as booleans and reads exponent floats as floats, like YAML 1.2 and OmegaConf.
class _Loader(yaml.SafeLoader):
    pass


_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader subclass: no arbitrary objects


# --- recipes and shipped configs ---------------------------------------------------------------
def list_recipes(configs_dir: str | Path = CONFIGS_DIR) -> dict[str, list[str]]:
    """{recipe: [config names]} from the folders of `configs_dir` (`<recipe>/<name>.yaml`)."""
    root = Path(configs_dir)
    if not root.is_dir():
        return {}
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(("_", "."))
    }


def config_path(recipe: str, name: str, configs_dir: str | Path = CONFIGS_DIR) -> Path:
    """The shipped YAML `<configs_dir>/<recipe>/<name>.yaml`; UnknownConfigError if absent."""
    name = name.removesuffix(".yaml")
    path = Path(configs_dir) / recipe / f"{name}.yaml"
    if path.is_file():
        return path
    available = list_recipes(configs_dir).get(recipe, [])
    msg = f"recipe '{recipe}' has no shipped config '{name}'."
    close = difflib.get_close_matches(name, available, n=1)
    if close:
        msg += f" Did you mean '{close[0]}'?"
    msg += f" Available: {', '.join(available) or '(none)'}. To use a file, pass its path (ending in .yaml)."
    raise UnknownConfigError(msg)


def config_header(path: str | Path) -> str:
    """The first line of a YAML file's header comment (what the config is for), or ''."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if not stripped.startswith("#"):
                return ""
            text = stripped.lstrip("#").strip()
            if text:
                return text
    return ""


def _recipe_names(package: str, configs_dir: str | Path) -> list[str]:
    names = set(list_recipes(configs_dir))
    try:
        pkg = importlib.import_module(package)
        names.update(
            m.name for m in pkgutil.iter_modules(getattr(pkg, "__path__", []))
            if not m.name.startswith("_") and m.name not in _NOT_RECIPES
        )
    except ImportError:
        pass
    return sorted(names)


def load_recipe(recipe: str, package: str = RECIPES_PACKAGE, configs_dir: str | Path = CONFIGS_DIR) -> ModuleType:
    """Import `<package>.<recipe>` and check that it defines DEFAULTS (with the required keys) and main."""
    if not re.fullmatch(r"[A-Za-z_]\w*", recipe) or recipe in _NOT_RECIPES:
        raise UnknownRecipeError(f"'{recipe}' is not a recipe name.{_recipe_hint(recipe, package, configs_dir)}")
    modname = f"{package}.{recipe}"
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        # Only a missing recipe module is the user's error; a missing dependency inside it is not.
        if e.name not in (modname, package):
            raise
        raise UnknownRecipeError(
            f"unknown recipe '{recipe}' (no module {modname}).{_recipe_hint(recipe, package, configs_dir)}"
        ) from None
    defaults = getattr(module, "DEFAULTS", None)
    if not isinstance(defaults, dict):
        raise RecipeDefinitionError(f"recipe module {modname} must define DEFAULTS as a dict")
    if not callable(getattr(module, "main", None)):
        raise RecipeDefinitionError(f"recipe module {modname} must define main(cfg) -> dict")
    missing = [k for k in REQUIRED_KEYS if k not in defaults]
    if missing:
        raise RecipeDefinitionError(
            f"recipe module {modname}: DEFAULTS lacks required key(s) {missing}; every recipe must "
            f"define {list(REQUIRED_KEYS)}"
        )
    return module


def _recipe_hint(recipe: str, package: str, configs_dir: str | Path) -> str:
    names = _recipe_names(package, configs_dir)
    close = difflib.get_close_matches(recipe, names, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return hint + f" Known recipes: {', '.join(names) or '(none)'}."


# --- validation and merging -----------------------------------------------------------------
def _all_paths(defaults: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in defaults.items():
        paths.append(prefix + str(key))
        if isinstance(value, dict):
            paths.extend(_all_paths(value, f"{prefix}{key}."))
    return paths


class _Ctx:
    """What an error message needs: the recipe, the full DEFAULTS and where the value came from."""

    def __init__(
        self, recipe: str, defaults: dict, source: str, raw: str | None = None, raw_key: str | None = None
    ) -> None:
        self.recipe = recipe
        self.defaults = defaults
        self.source = source
        # An override's text after '=' and its key, so that a str key keeps exactly what was typed.
        self.raw = raw
        self.raw_key = raw_key

    def unknown(
        self, path: str, value: Any, siblings: Iterable[str] | None, note: str = ""
    ) -> ConfigKeyError:
        suggestion = None
        last = path.rsplit(".", 1)[-1]
        parent = path[: -len(last)]
        all_paths = _all_paths(self.defaults)
        if siblings is not None:  # the section exists: the likeliest fix is a key next to it
            close = difflib.get_close_matches(last, list(siblings), n=1)
            suggestion = parent + close[0] if close else None
        else:  # a section name is wrong: match the whole path (never one of its own ancestors)
            ancestors = {path[:i] for i, ch in enumerate(path) if ch == "."}
            close = difflib.get_close_matches(path, [p for p in all_paths if p not in ancestors], n=1)
            suggestion = close[0] if close else None
        if suggestion is None:  # a key in the wrong section, e.g. `stage=2` for `roles.actor.stage`
            for candidate in all_paths:
                if difflib.get_close_matches(last, [candidate.rsplit(".", 1)[-1]], n=1, cutoff=0.8):
                    suggestion = candidate
                    break
        msg = f"unknown config key '{path}' (value {value!r}) for recipe '{self.recipe}'."
        if suggestion:
            msg += f" Did you mean '{suggestion}'?"
        elif note:
            msg += f" {note}"
        elif siblings is not None:
            msg += f" Valid keys{' under ' + parent[:-1] if parent else ''}: {', '.join(sorted(siblings))}."
        msg += f" ({self.source})"
        return ConfigKeyError(msg, path, value, suggestion)

    def wrong_type(self, path: str, value: Any, expected: str) -> ConfigTypeError:
        return ConfigTypeError(
            f"config key '{path}' for recipe '{self.recipe}' expects {expected}, got {value!r} "
            f"({type(value).__name__}). ({self.source})"
        )


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _check_value(path: str, default: Any, value: Any, ctx: _Ctx) -> Any:
    """`value` converted to the default's type, or ConfigTypeError."""
    if value is None or default is None or _is_interpolation(value):
        return value
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ctx.wrong_type(path, value, "bool (true/false)")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ctx.wrong_type(path, value, "int")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ctx.wrong_type(path, value, "float")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if ctx.raw is not None and path == ctx.raw_key:  # the text typed: `name=007`, `p=a: b`
            return ctx.raw.strip()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ctx.wrong_type(path, value, "str")
    if isinstance(default, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise ctx.wrong_type(path, value, "list (e.g. [a,b])")
        kinds = {type(d) for d in default}
        if len(kinds) == 1 and kinds <= {bool, int, float, str}:  # a homogeneous default types its items
            item_ctx = _Ctx(ctx.recipe, ctx.defaults, ctx.source)
            return [_check_value(f"{path}[{i}]", default[0], v, item_ctx) for i, v in enumerate(value)]
        return list(value)
    if isinstance(default, dict):
        raise ctx.wrong_type(path, value, "a mapping")
    return value


def _deep_merge(target: dict, data: dict) -> None:
    """Unchecked merge, for free-form sections."""
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def _merge(target: dict, defaults: dict, data: dict, prefix: str, ctx: _Ctx) -> None:
    """Merge `data` into `target`, checking every key and value against `defaults`."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str) or key not in defaults:
            raise ctx.unknown(path, value, defaults.keys())
        default = defaults[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ctx.wrong_type(path, value, "a mapping")
            if not default:
                _deep_merge(target[key], value)
            else:
                _merge(target[key], default, value, path + ".", ctx)
        else:
            target[key] = _check_value(path, default, value, ctx)


_KEY_RE = re.compile(r"[A-Za-z_][\w-]*(?:\.[\w-]+)*")


def parse_override(text: str) -> tuple[str, Any]:
    """`"a.b=[1,2]"` -> `("a.b", [1, 2])`; the value is read as YAML (`key=` is the empty string)."""
    if "=" not in text:
        raise OverrideSyntaxError(f"malformed override '{text}': expected key=value (e.g. max_steps=3)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not _KEY_RE.fullmatch(key):
        raise OverrideSyntaxError(
            f"malformed override '{text}': '{key}' is not a config key (expected dotted.key=value)"
        )
    if not raw.strip():
        return key, ""
    try:
        value = _yaml_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise OverrideSyntaxError(f"malformed override '{text}': cannot read value '{raw}' ({problem})") from None
    return key, value


def _apply_override(merged: dict, text: str, ctx_base: tuple[str, dict]) -> None:
    key, value = parse_override(text)
    raw = text.split("=", 1)[1]
    recipe, defaults = ctx_base
    ctx = _Ctx(recipe, defaults, f"in override '{text}'", raw=raw, raw_key=key)
    parts = key.split(".")
    node_d, node_t = defaults, merged
    for i, part in enumerate(parts[:-1]):
        if part not in node_d or not isinstance(node_d[part], dict):
            # A wrong section name: the siblings of the last part are unknown, so match the full path.
            section = ".".join(parts[: i + 1])
            note = f"'{section}' is not a section (default {node_d[part]!r})." if part in node_d else ""
            raise ctx.unknown(key, value, None, note)
        if not node_d[part]:  # free-form section: set the rest of the path as given
            sub = node_t[part]
            for p in parts[i + 1 : -1]:
                if not isinstance(sub.get(p), dict):
                    sub[p] = {}
                sub = sub[p]
            sub[parts[-1]] = copy.deepcopy(value)
            return
        node_d, node_t = node_d[part], node_t[part]
    prefix = key[: -len(parts[-1])]
    _merge(node_t, node_d, {parts[-1]: value}, prefix, ctx)


def _free_form_paths(defaults: dict, prefix: str = "") -> list[str]:
    paths = []
    for key, value in defaults.items():
        if isinstance(value, dict):
            paths.extend([prefix + key] if not value else _free_form_paths(value, f"{prefix}{key}."))
    return paths


def resolve_config_file(recipe: str, config: str, configs_dir: str | Path = CONFIGS_DIR) -> Path:
    """A config argument as a file: a path if it has a '/' or a .yaml/.yml suffix, else a shipped name."""
    if "/" in config or "\\" in config or config.endswith((".yaml", ".yml")):
        path = Path(config).expanduser()
        if not path.is_file():
            raise UnknownConfigError(f"config file '{config}' does not exist")
        return path.resolve()
    return config_path(recipe, config, configs_dir)


def load_config(
    recipe: str,
    config: str | None = None,
    overrides: Iterable[str] = (),
    *,
    package: str = RECIPES_PACKAGE,
    configs_dir: str | Path = CONFIGS_DIR,
) -> DictConfig:
    """DEFAULTS of `<package>.<recipe>`, then the YAML `config` (shipped name or path), then overrides.

    Returns a struct-mode DictConfig (reading or setting an unknown key raises). Raises
    RecipeConfigError subclasses for user errors and RecipeDefinitionError for a broken recipe.
    """
    module = load_recipe(recipe, package, configs_dir)
    defaults = copy.deepcopy(module.DEFAULTS)
    merged = copy.deepcopy(defaults)
    if config is not None:
        path = resolve_config_file(recipe, config, configs_dir)
        try:
            data = _yaml_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise UnknownConfigError(f"config file {path} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UnknownConfigError(f"config file {path} must be a mapping of keys, got {type(data).__name__}")
        _merge(merged, defaults, data, "", _Ctx(recipe, defaults, f"in {path}"))
    for text in overrides:
        _apply_override(merged, text, (recipe, defaults))

    cfg = OmegaConf.create(merged)
    OmegaConf.set_struct(cfg, True)
    for path in _free_form_paths(defaults):
        OmegaConf.set_struct(OmegaConf.select(cfg, path), False)
    try:  # resolve once now so a broken ${...} fails here, not hours into the run
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeConfigError(f"config for recipe '{recipe}': {str(e).splitlines()[0]}") from None
    # a recipe's own checks of values (names, ranges, combinations): here, before any rank starts
    check = getattr(module, "check_config", None)
    if check is not None:
        check(cfg)
    return cfg


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as a plain, resolved dict (for summary.json and logging)."""
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]

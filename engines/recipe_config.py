"""Recipe configs: a recipe's DEFAULTS, merged with a YAML file and `key=value` overrides, strictly.

A recipe is a module `<package>.<recipe>` (package `multiengine.recipes` by default) defining

* `DEFAULTS: dict` - the complete, nested set of valid keys with their default values (and
  therefore their types), which must include `output_dir`, `seed` and `max_steps`;
* `main(cfg: DictConfig) -> dict` - runs it and returns a summary.

Its shipped configs are `recipes/configs/<recipe>/<name>.yaml`. Every key in a YAML
file or an override must exist in DEFAULTS: a typo is an error naming the closest valid key, never
a silently ignored setting. Types follow the default value (bool, int, float - ints accepted -,
str, list); `null` is accepted anywhere and a `${...}` interpolation is accepted for any key.
A default of `None` accepts any value; an empty dict `{}` is a free-form section whose keys are
not checked (for pass-through settings such as extra DeepSpeed config).

Checks: one mechanism, two hooks, both run before any rank starts. Optionally, a recipe module defines
* `CHECKS: dict` - dotted key (a `*` part matches any key of a section) -> Range / Choice /
  Length / PathExists / Each / Satisfies / OrFollow (or a list of them): each value on its own. A recipe
  that writes its keys as `Key(default, "meaning", check)` leaves (KEYS, below) gets each Key's check and
  the check of every key whose name the recipes share (engines/role_schema.py); its CHECKS then holds
  only what a Key cannot say (patterns such as `roles.*.model`), and wins.
  Applied by load_config to the resolved values, so every value error names the key, the value,
  where it was set and the fix. A recipe on the shared lifecycle (engines/recipe_lifecycle.py) also gets
  its COMMON_CHECKS (max_steps, backend, checkpoint, resume_from, dist_timeout_s, nonfinite, role
  placements); its own CHECKS entry for the same key replaces the common one;
* `validate(cfg)` - what needs more than one value or a look outside the config: cross-field
  rules, paths, data columns and sizes, tokenizer vs model vocabulary. Run by validate_config
  once, in the launching process (`multiengine validate`, `multiengine run` before launching, and
  a recipe that runs another in-process); raises config_problem(...) or any RecipeConfigError.
  Declared as `validate(cfg, world_size=1)` it also gets the number of ranks the run will have
  (`--nproc-per-node` x `--nnodes`), for checks of the batch arithmetic (rows per rank).
  Lifecycle recipes get the common cross-field checks first (lifecycle.validate_common);
* `HELP: dict` - dotted key -> one-line meaning, what `multiengine run <recipe> --help` shows. Recipes
  write their keys as `Key(default, "meaning")` leaves in `KEYS` and take both from one definition:
  `DEFAULTS, HELP = split_keys(KEYS)`.

There is no third hook: a module-level `check_config` (the name an earlier version ran inside
load_config) is refused, so a check written for it cannot be skipped silently.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import json
import pkgutil
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

RECIPES_PACKAGE = "multiengine.recipes"
# The shipped configs live beside the recipes (the package layout keeps engines/ and recipes/ side by side).
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "recipes" / "configs"
REQUIRED_KEYS = ("output_dir", "seed", "max_steps")
# Modules of the recipes package that are infrastructure, not recipes.
_NOT_RECIPES = frozenset({"cli", "common", "diffusion_base", "diffusion_keys", "plans"})


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


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that sets one key twice: PyYAML would keep the last value without a word."""

    def __init__(self, key: str, first_line: int, second_line: int) -> None:
        super().__init__(f"key '{key}' is set twice, on line {first_line} and on line {second_line}")
        self.key, self.first_line, self.second_line = key, first_line, second_line


def _refuse_duplicate_keys(node: yaml.Node, prefix: str = "") -> None:
    """DuplicateKeyError for the first mapping key that appears twice in ``node`` (dotted path, 1-based lines)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                name = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if name in seen:
                    raise DuplicateKeyError(prefix + key_node.value, seen[name], line)
                seen[name] = line
                _refuse_duplicate_keys(value_node, f"{prefix}{key_node.value}.")
            else:
                _refuse_duplicate_keys(value_node, prefix)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{prefix[:-1]}[{i}]." if prefix else f"[{i}].")


class _StrictLoader(_Loader):
    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(node)
        return super().construct_document(node)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what, where (1-based line and column) and what it was inside."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return str(e).replace("\n", " ")
    where = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or 'cannot parse'}"
    context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and start is not None:
        where += f" ({context} that starts on line {start.line + 1})"
    return f"{where}; fix: check the indentation and quoting there"


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


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
    if hasattr(module, "check_config"):
        raise RecipeDefinitionError(
            f"recipe module {modname} defines check_config(cfg); that hook is now validate(cfg) (run once before"
            " any rank starts, see engines/recipe_config.py): rename it")
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
        self, recipe: str, defaults: dict, source: str, raw: str | None = None, raw_key: str | None = None,
        where: dict[str, str] | None = None, renamed: dict[str, str] | None = None,
    ) -> None:
        self.recipe = recipe
        self.renamed = renamed or {}  # old key -> new key (the recipe's RENAMED): refused, naming the new key
        self.defaults = defaults
        self.source = source
        self.where = where  # dotted key -> where its value was last set (for value-check messages)
        # An override's text after '=' and its key, so that a str key keeps exactly what was typed.
        self.raw = raw
        self.raw_key = raw_key

    def record(self, path: str) -> None:
        if self.where is not None:
            self.where[path] = self.source

    def unknown(
        self, path: str, value: Any, siblings: Iterable[str] | None, note: str = ""
    ) -> ConfigKeyError:
        new = renamed_key(path, self.renamed)
        if new is not None:  # an entry "new.key (how)" names the new key and how its values differ
            key, _, how = new.partition(" ")
            all_paths = _all_paths(self.defaults)
            if key not in all_paths:  # a typo inside an old section: the closest key of the new one
                close = difflib.get_close_matches(key, all_paths, n=1)
                key = close[0] if close else key
            fix = f"set {key} {how}" if how else f"write {key}={_show(value)}"
            return ConfigKeyError(f"config key '{path}' (value {value!r}) is now '{key}' in recipe '{self.recipe}': "
                                  f"every role is configured under roles.<name> with the same keys. Fix: {fix}. "
                                  f"({self.source})", path, value, key)
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


def renamed_key(path: str, renamed: dict[str, str]) -> str | None:
    """The new name of an old key: an exact entry, else the longest ``section.*`` entry that covers it."""
    if path in renamed:
        return renamed[path]
    best = None
    for old in renamed:
        if old.endswith(".*") and (path + ".").startswith(old[:-1]) and (best is None or len(old) > len(best)):
            best = old
    if best is None:
        return None
    return renamed[best][:-2] + path[len(best) - 2:] if renamed[best].endswith(".*") else renamed[best]


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


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
                ctx.record(path)
            else:
                _merge(target[key], default, value, path + ".", ctx)
        else:
            target[key] = _check_value(path, default, value, ctx)
            ctx.record(path)


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
    except DuplicateKeyError as e:
        inner = f"{key}{'' if e.key.startswith('[') else '.'}{e.key}"
        raise OverrideSyntaxError(f"malformed override '{text}': key '{inner}' is set twice in '{raw}'") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise OverrideSyntaxError(f"malformed override '{text}': cannot read value '{raw}' ({problem})") from None
    return key, value


def _apply_override(merged: dict, text: str, ctx_base: tuple[str, dict], where: dict[str, str] | None = None,
                    renamed: dict[str, str] | None = None) -> None:
    key, value = parse_override(text)
    raw = text.split("=", 1)[1]
    recipe, defaults = ctx_base
    ctx = _Ctx(recipe, defaults, f"in override '{text}'", raw=raw, raw_key=key, where=where, renamed=renamed)
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
            ctx.record(key)
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
    renamed = dict(getattr(module, "RENAMED", None) or {})
    merged = copy.deepcopy(defaults)
    where: dict[str, str] = {}
    if config is not None:
        path = resolve_config_file(recipe, config, configs_dir)
        try:
            data = _yaml_load(path.read_text(encoding="utf-8"))
        except DuplicateKeyError as e:
            raise UnknownConfigError(f"config file {path}: {e}; YAML would keep only the second value; fix: delete "
                                     "one of the two lines") from None
        except yaml.YAMLError as e:
            raise UnknownConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UnknownConfigError(f"config file {path} must be a mapping of keys, got {type(data).__name__}")
        _merge(merged, defaults, data, "", _Ctx(recipe, defaults, f"in {path}", where=where, renamed=renamed))
    for text in overrides:
        _apply_override(merged, text, (recipe, defaults), where, renamed)

    cfg = OmegaConf.create(merged)
    OmegaConf.set_struct(cfg, True)
    for path in _free_form_paths(defaults):
        OmegaConf.set_struct(OmegaConf.select(cfg, path), False)
    try:  # resolve once now so a broken ${...} fails here, not hours into the run
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeConfigError(f"config for recipe '{recipe}': {str(e).splitlines()[0]}") from None
    run_checks(recipe, module, resolved, where)
    return cfg


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The config as a plain, resolved dict (for summary.json and logging)."""
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return out  # type: ignore[return-value]


def plain(value: Any) -> Any:
    """A config node as plain, resolved Python values (a leaf as it is)."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested section (config node or dict) as ``{dotted key: leaf}``."""
    out: dict[str, Any] = {}
    for k, v in plain(tree).items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


# --- value checks: a recipe's CHECKS and its validate(cfg) hook -------------------------------------
# A recipe module may define
#   CHECKS = {"max_steps": Range(1), "mode": Choice("full", "lora"), "roles.*.stage": Range(0, 3),
#             "data.path": PathExists("file")}
# (a dotted key, `*` standing for any one key of a section, mapped to one Check or a list of them)
# and `validate(cfg)`, called once before any rank starts, for what needs more than one value or a
# look at the data: cross-field rules, dataset columns and sizes, tokenizer vs model vocabulary. It
# raises config_problem(...) (or any RecipeConfigError). CHECKS run inside load_config, so every
# rank re-checks them for free; validate(cfg) runs in `multiengine validate`, before `run` starts,
# and through checked_config() when a recipe runs another in-process.


class ConfigValueError(RecipeConfigError):
    """Config values that break a recipe's CHECKS or its validate(cfg) hook."""

    def __init__(self, message: str, problems: list[Problem]) -> None:
        super().__init__(message)
        self.problems = problems
        self.fix = problems[0].fix if len(problems) == 1 else None

    @property
    def key(self) -> str:
        return self.problems[0].key


class Problem:
    """One bad value: the key, the value, what is wrong with it and how to fix it."""

    def __init__(self, key: str, value: Any, message: str, fix: str) -> None:
        self.key, self.value, self.message, self.fix = key, value, message, fix

    def __repr__(self) -> str:
        return f"Problem({self.key!r}, {self.value!r}, {self.message!r})"


def _problems_error(recipe: str | None, problems: list[Problem]) -> ConfigValueError:
    if len(problems) == 1:
        p = problems[0]
        return ConfigValueError(f"{p.message}; fix: {p.fix}", problems)
    lines = [f"{p.message}; fix: {p.fix}" for p in problems]
    who = f" for recipe '{recipe}'" if recipe else ""
    return ConfigValueError(f"config{who} has {len(problems)} problems:\n  - " + "\n  - ".join(lines), problems)


def config_problem(key: str, value: Any, problem: str, fix: str) -> ConfigValueError:
    """The error a recipe's validate(cfg) raises: `problem` completes "config key '<key>' ...",
    e.g. config_problem("data.path", path, "has no rows", "point data.path at a non-empty JSONL file")."""
    return _problems_error(None, [Problem(key, value, f"config key '{key}' {problem} (value {value!r})", fix)])


def _fmt_num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


class Check:
    """A constraint on one config value (see CHECKS above).

    allow_none: whether null passes; None (the default) means "if the key's default is null".
    Subclasses implement problem(value) -> None or what is wrong ("must be >= 1"),
    describe() for --help, and fix(key)."""

    allow_none: bool | None = None

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError

    def problem_at(self, value: Any, default: Any) -> str | None:
        """problem(value), for a key whose DEFAULTS value is `default` (OrFollow needs to know it)."""
        return self.problem(value)

    def describe_at(self, default: Any) -> str:
        return self.describe()

    def describe(self) -> str:
        raise NotImplementedError

    def fix(self, key: str, value: Any) -> str:
        return f"set {key} to a value that is {self.describe()}"


class Range(Check):
    """min <= value <= max for ints and floats (either bound optional; exclusive if asked)."""

    def __init__(self, min: float | None = None, max: float | None = None, *, min_exclusive: bool = False,
                 max_exclusive: bool = False, allow_none: bool | None = None) -> None:
        if min is None and max is None:
            raise TypeError("Range needs min, max or both")
        self.min, self.max = min, max
        self.min_exclusive, self.max_exclusive = min_exclusive, max_exclusive
        self.allow_none = allow_none

    def describe(self) -> str:
        if self.max is None:
            return f"{'>' if self.min_exclusive else '>='} {_fmt_num(self.min)}"
        if self.min is None:
            return f"{'<' if self.max_exclusive else '<='} {_fmt_num(self.max)}"
        left, right = "(" if self.min_exclusive else "[", ")" if self.max_exclusive else "]"
        return f"in {left}{_fmt_num(self.min)}, {_fmt_num(self.max)}{right}"

    def problem(self, value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number {self.describe()}"
        if value != value:  # NaN compares false with every bound
            return f"must be {self.describe()}"
        low_ok = self.min is None or (value > self.min if self.min_exclusive else value >= self.min)
        high_ok = self.max is None or (value < self.max if self.max_exclusive else value <= self.max)
        return None if low_ok and high_ok else f"must be {self.describe()}"


class Choice(Check):
    """One of a fixed set of values (an enum)."""

    def __init__(self, *choices: Any, allow_none: bool | None = None) -> None:
        if not choices:
            raise TypeError("Choice needs at least one choice")
        self.choices = choices
        self.allow_none = allow_none

    def describe(self) -> str:
        return "one of " + ", ".join(_choice_text(c) for c in self.choices)

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else f"must be {self.describe()}"

    def fix(self, key: str, value: Any) -> str:
        close = difflib.get_close_matches(str(value), [str(c) for c in self.choices], n=1)
        hint = f"did you mean {key}={close[0]}? " if close else ""
        return f"{hint}use one of: {', '.join(_choice_text(c) for c in self.choices)}"


def _choice_text(choice: Any) -> str:
    """A choice as a user types it: strings bare, except the empty one (shown as "")."""
    return choice if isinstance(choice, str) and choice else json.dumps(choice)


class Length(Check):
    """A list or string with at least `min` / at most `max` items (characters)."""

    def __init__(self, min: int | None = None, max: int | None = None, *, allow_none: bool | None = None) -> None:
        if min is None and max is None:
            raise TypeError("Length needs min, max or both")
        self.min, self.max = min, max
        self.allow_none = allow_none

    def describe(self) -> str:
        if self.max is None:
            return "non-empty" if self.min == 1 else f"at least {self.min} long"
        if self.min is None:
            return f"at most {self.max} long"
        return f"{self.min} to {self.max} long"

    def problem(self, value: Any) -> str | None:
        try:
            n = len(value)
        except TypeError:
            return f"must be a list or string, {self.describe()}"
        if (self.min is not None and n < self.min) or (self.max is not None and n > self.max):
            return f"must be {self.describe()} (it has {n})"
        return None


class PathExists(Check):
    """A path that must exist: kind "file", "dir" or "any". An empty string counts as unset, like null."""

    def __init__(self, kind: str = "any", *, allow_none: bool | None = None) -> None:
        if kind not in ("any", "file", "dir"):
            raise TypeError(f"PathExists kind must be 'any', 'file' or 'dir', got {kind!r}")
        self.kind = kind
        self.allow_none = allow_none

    def describe(self) -> str:
        return {"any": "an existing path", "file": "an existing file", "dir": "an existing folder"}[self.kind]

    def problem(self, value: Any) -> str | None:
        path = Path(str(value)).expanduser()
        ok = {"any": path.exists, "file": path.is_file, "dir": path.is_dir}[self.kind]()
        if ok:
            return None
        if path.exists():
            return f"must be {self.describe()} (it is a {'folder' if path.is_dir() else 'file'})"
        return f"must be {self.describe()} (no such path)"

    def fix(self, key: str, value: Any) -> str:
        return f"point {key} at {self.describe()}, or create it"


class Each(Check):
    """Apply a check to every item of a list."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.allow_none = check.allow_none

    def describe(self) -> str:
        return f"a list whose items are each {self.check.describe()}"

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"must be {self.describe()}"
        for i, item in enumerate(value):
            p = self.check.problem(item)
            if p:
                return f"item {i} ({item!r}) {p}"
        return None


class Satisfies(Check):
    """A custom rule: predicate(value) -> bool, with the phrase that describes it
    (e.g. Satisfies(lambda v: v % 8 == 0, "a multiple of 8"))."""

    def __init__(self, predicate: Any, description: str, *, allow_none: bool | None = None) -> None:
        self.predicate, self.description = predicate, description
        self.allow_none = allow_none

    def describe(self) -> str:
        return self.description

    def problem(self, value: Any) -> str | None:
        return None if self.predicate(value) else f"must be {self.description}"


class OrFollow(Check):
    """`check`, or the sentinel `follow` (e.g. a stage of -1, a dtype of "": take another role's) - but only
    where the key's own default is that sentinel, so a role that has nothing to follow cannot ask for it."""

    def __init__(self, check: Check, follow: Any) -> None:
        self.check, self.follow = check, follow
        self.allow_none = check.allow_none

    def describe(self) -> str:
        return f"{self.check.describe()} ({json.dumps(self.follow)} = follow, where that is the default)"

    def describe_at(self, default: Any) -> str:
        if default == self.follow:
            return f"{self.check.describe()}, or {json.dumps(self.follow)} = follow"
        return self.check.describe()

    def problem(self, value: Any) -> str | None:
        return self.check.problem(value)

    def problem_at(self, value: Any, default: Any) -> str | None:
        if value == self.follow and type(value) is type(self.follow):
            if default == self.follow:
                return None
            return f"must be {self.check.describe()} (this role has nothing to follow)"
        return self.check.problem(value)

    def fix(self, key: str, value: Any) -> str:
        return self.check.fix(key, value)


_MISSING = object()


def _lookup(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _expand(pattern: str, tree: dict) -> list[str]:
    """Dotted keys of `tree` matching `pattern`, where a `*` part matches any one key."""
    keys = [""]
    for part in pattern.split("."):
        nxt = []
        for prefix in keys:
            node = _lookup(tree, prefix[:-1]) if prefix else tree
            if not isinstance(node, dict):
                continue
            names = list(node) if part == "*" else [part] if part in node else []
            nxt.extend(f"{prefix}{name}." for name in names)
        keys = nxt
    return [k[:-1] for k in keys]


def _normalise_checks(raw: Any, owner: str, defaults: dict, strict: bool) -> dict[str, list[Check]]:
    if not isinstance(raw, dict):
        raise RecipeDefinitionError(f"{owner}: CHECKS must be a dict of key -> Check")
    out: dict[str, list[Check]] = {}
    for pattern, checks in raw.items():
        checks = list(checks) if isinstance(checks, (list, tuple)) else [checks]
        bad = [c for c in checks if not isinstance(c, Check)]
        if bad:
            raise RecipeDefinitionError(f"{owner}: CHECKS[{pattern!r}] holds {bad[0]!r}, not a Check (Range, Choice,"
                                        " Length, PathExists, Each, Satisfies, OrFollow)")
        if not _expand(pattern, defaults):
            if strict:
                raise RecipeDefinitionError(f"{owner}: CHECKS key {pattern!r} matches no key of DEFAULTS")
            continue  # a common check for a key this recipe does not have
        out[pattern] = checks
    return out


def _lifecycle(module: ModuleType) -> ModuleType | None:
    """engines.recipe_lifecycle when `module` is a recipe on the shared lifecycle (it uses with_common or Recipe).
    Looked up, not imported: a module that uses it has imported it, and config.py stays free of torch."""
    lc = sys.modules.get("multiengine.engines.recipe_lifecycle")
    if lc is None:
        return None
    for value in vars(module).values():
        if value is lc.with_common or (isinstance(value, type) and issubclass(value, lc.Recipe)):
            return lc
    return None


def recipe_checks(module: ModuleType) -> dict[str, list[Check]]:
    """The module's checks, normalised to lists and checked against its DEFAULTS (a bad CHECKS is a bug): for a
    module with KEYS, the check of each key by its name and the check its Key carries (role_schema.shared_checks),
    then its CHECKS, which win."""
    raw = getattr(module, "CHECKS", None)
    if isinstance(getattr(module, "KEYS", None), dict):
        from .role_schema import shared_checks

        raw = shared_checks(module.KEYS, raw)
    if raw is None:
        return {}
    return _normalise_checks(raw, f"recipe module {module.__name__}", module.DEFAULTS, strict=True)


def key_checks(module: ModuleType, tree: dict | None = None) -> dict[str, list[Check]]:
    """Dotted key of `tree` (default: DEFAULTS) -> the checks that apply to it: the recipe's CHECKS and, for a
    lifecycle recipe, the COMMON_CHECKS of keys its own CHECKS leave alone."""
    tree = module.DEFAULTS if tree is None else tree
    own: dict[str, list[Check]] = {}
    for pattern, checks in recipe_checks(module).items():
        for key in _expand(pattern, tree):
            own.setdefault(key, []).extend(checks)
    lc = _lifecycle(module)
    if lc is not None:
        common = _normalise_checks(lc.COMMON_CHECKS, "engines.recipe_lifecycle", module.DEFAULTS, strict=False)
        for pattern, checks in common.items():
            for key in _expand(pattern, tree):
                if key not in own:
                    own[key] = list(checks)
    return own


def run_checks(recipe: str, module: ModuleType, resolved: dict, where: dict[str, str] | None = None) -> None:
    """Apply the recipe's CHECKS (and the common ones) to the resolved config; ConfigValueError listing every
    problem, in the order of the keys in DEFAULTS."""
    problems: list[Problem] = []
    order = {key: i for i, key in enumerate(_all_paths(module.DEFAULTS))}
    checks_by_key = key_checks(module, resolved)
    for key in sorted(checks_by_key, key=lambda k: order.get(k, len(order))):
        value = _lookup(resolved, key)
        default = _lookup(module.DEFAULTS, key)
        source = (where or {}).get(key, "the default")
        for check in checks_by_key[key]:
            if value is None or (isinstance(check, PathExists) and value == ""):
                allowed = check.allow_none if check.allow_none is not None else default in (None, "")
                if allowed:
                    continue
                problem = f"must be set ({check.describe()})"
            else:
                problem = check.problem_at(value, default)
                if problem is None:
                    continue
            problems.append(Problem(
                key, value, f"config key '{key}' for recipe '{recipe}' {problem}, got {value!r} ({source})",
                check.fix(key, value)))
            break  # one problem per key is enough
    if problems:
        raise _problems_error(recipe, problems)


def world_size_from_env() -> int:
    """The job's world size as torchrun gives it to a rank (``WORLD_SIZE``), 1 outside a launched job."""
    import os

    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _takes_world_size(hook: Any) -> bool:
    try:
        params = inspect.signature(hook).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "world_size" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_output_dir_writable(output_dir: str, key: str = "output_dir") -> None:
    """``output_dir`` is a folder this process can create files in, or can be created: checked before any rank
    starts, by writing and removing one empty file in it (or in its nearest existing parent), since permission
    bits alone miss read-only file systems. Otherwise the run would fail at its first write, after building its
    models, or leave a half-made folder."""
    import os
    import tempfile

    path = Path(os.path.expanduser(output_dir))
    if path.is_symlink() and not path.exists():
        raise config_problem(key, output_dir, f"is a link to {os.readlink(path)}, which does not exist",
                             f"point {key} at a folder, or create the link's target")
    if path.exists() and not path.is_dir():
        raise config_problem(key, output_dir, "is an existing file, not a folder",
                             f"point {key} at a folder (a new one, or an earlier run's), or move the file away")
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise config_problem(key, output_dir, f"cannot be created: {existing} is a file",
                             f"point {key} at a folder whose parents are folders")
    try:
        fd, probe = tempfile.mkstemp(prefix=".multiengine-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        where = "in it" if existing == path.absolute() else f"in {existing}, where it would be created"
        raise config_problem(key, output_dir, f"is not writable: cannot create files {where} ({err.strerror})",
                             f"point {key} at a folder you can write to, or make {existing} writable") from None


def validate_config(
    recipe: str, cfg: DictConfig, *, package: str = RECIPES_PACKAGE, configs_dir: str | Path = CONFIGS_DIR,
    world_size: int | None = None,
) -> None:
    """The checks that need more than one value or a look outside the config, once, before any rank starts:
    output_dir can be written (check_output_dir_writable), for a lifecycle recipe the common checks
    (lifecycle.validate_common), then the recipe's validate(cfg)
    (CHECKS already ran in load_config). ``world_size``: the ranks the run will have (default: ``WORLD_SIZE``
    of a launched rank, else 1), given to a hook declared as ``validate(cfg, world_size)`` (batch arithmetic)."""
    module = load_recipe(recipe, package, configs_dir)
    check_output_dir_writable(str(cfg.output_dir))
    lc = _lifecycle(module)
    if lc is not None:
        lc.validate_common(cfg, getattr(module, "ROLES", None))
    hook = getattr(module, "validate", None)
    if hook is None:
        return
    if not callable(hook):
        raise RecipeDefinitionError(f"recipe module {module.__name__}: validate must be a function validate(cfg)")
    if _takes_world_size(hook):
        hook(cfg, world_size=world_size_from_env() if world_size is None else int(world_size))
    else:
        hook(cfg)


def checked_config(
    recipe: str, config: str | None = None, overrides: Iterable[str] = (), *, package: str = RECIPES_PACKAGE,
    configs_dir: str | Path = CONFIGS_DIR, world_size: int | None = None,
) -> DictConfig:
    """load_config + validate_config: for a recipe that runs another one in-process (its inputs exist now)."""
    cfg = load_config(recipe, config, overrides, package=package, configs_dir=configs_dir)
    validate_config(recipe, cfg, package=package, configs_dir=configs_dir, world_size=world_size)
    return cfg


# --- typed key definitions: a default and its one-line meaning -------------------------------------
class Key(NamedTuple):
    """One config key: its default value (which also gives its type), one line of help for ``--help`` and the
    check of its value, if it needs one beyond the check its name gets (engines/role_schema.py). A Key whose
    default is a dict is a section with a meaning of its own."""

    default: Any
    help: str
    check: Any = None  # a Check (Range, Choice, ...) or a list of them


def split_keys(tree: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, str]]:
    """(defaults, help) of a tree whose leaves may be :class:`Key`: the plain nested defaults a recipe's
    DEFAULTS holds, and dotted key -> meaning for every Key (its HELP)."""
    defaults: dict[str, Any] = {}
    meanings: dict[str, str] = {}
    for name, value in tree.items():
        path = prefix + str(name)
        if isinstance(value, Key):
            meanings[path] = value.help
            value = value.default
        if isinstance(value, dict):
            defaults[name], inner = split_keys(value, path + ".")
            meanings.update(inner)
        else:
            defaults[name] = copy.deepcopy(value)
    return defaults, meanings


def declared_checks(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key -> check of every :class:`Key` of ``tree`` that carries one."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        path = prefix + str(name)
        if isinstance(value, Key):
            if value.check is not None:
                out[path] = value.check
            value = value.default
        if isinstance(value, dict):
            out.update(declared_checks(value, path + "."))
    return out


def key_meanings(module: ModuleType) -> dict[str, str]:
    """Dotted key -> one-line meaning: the module's HELP (what split_keys returned for its DEFAULTS)."""
    help_dict = getattr(module, "HELP", None)
    return {str(k): str(v) for k, v in help_dict.items()} if isinstance(help_dict, dict) else {}


def _type_name(default: Any) -> str:
    if default is None:
        return "any"
    if isinstance(default, dict):
        return "mapping (free-form)" if not default else "section"
    if isinstance(default, (list, tuple)):
        kinds = {type(d) for d in default}
        return f"list[{next(iter(kinds)).__name__}]" if len(kinds) == 1 else "list"
    return type(default).__name__


def describe_keys(module: ModuleType) -> list[dict[str, str]]:
    """One row per key of DEFAULTS (sections too): key, type (with its checks), default, meaning."""
    meanings = key_meanings(module)
    per_key = {key: [c.describe_at(_lookup(module.DEFAULTS, key)) for c in checks]
               for key, checks in key_checks(module).items()}
    rows = []

    def visit(tree: dict, prefix: str) -> None:
        for name, default in tree.items():
            key = prefix + str(name)
            kind = _type_name(default)
            if per_key.get(key):
                kind += ", " + "; ".join(per_key[key])
            section = isinstance(default, dict) and bool(default)
            rows.append({"key": key, "type": kind, "default": "" if section else json.dumps(default),
                         "meaning": meanings.get(key, "")})
            if section:
                visit(default, key + ".")

    visit(module.DEFAULTS, "")
    return rows


def format_key_help(recipe: str, module: ModuleType) -> str:
    rows = describe_keys(module)
    head = {"key": "KEY", "type": "TYPE", "default": "DEFAULT", "meaning": "MEANING"}
    widths = {c: min(40, max(len(r[c]) for r in [head, *rows])) for c in ("key", "type", "default")}
    lines = [f"config keys of recipe '{recipe}' (set them in a YAML file or as key=value overrides):"]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(f"{r[c]:<{widths[c]}}" for c in ("key", "type", "default"))
                     + f"  {r['meaning']}".rstrip())
    return "\n".join(lines)

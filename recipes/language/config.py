"""Recipe configs: a recipe's typed ``Config`` filled from its defaults, a YAML file and ``key=value`` overrides,
strictly: an unknown key names the closest valid one (or its new name from ``renamed``), a bad value names the key,
the value, where it was set and the fix; ``${...}`` interpolations resolve first. Shipped configs:
``<recipes package>/configs/<recipe>/<name>.yaml``."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import json
import os
import re
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from multiengine.engines.settings import (
    FieldError,
    SettingsError,
    config_problem,  # re-exported: the error a recipe's validate raises
    field_checks,
    field_help,
    set_key,
    sets_feature,
    value_problem,
    when_holds,
    when_problem,
)

RECIPES_PACKAGE = "multiengine.recipes"
KEY_READS_ENV = "MULTIENGINE_KEY_READS"  # set (tests): runs record which keys they read (logs/key-reads-*.json)
REQUIRED_KEYS = ("output_dir", "seed", "max_steps")


def configs_dir(package: str = RECIPES_PACKAGE) -> Path:
    """The shipped configs of a recipes package: its ``configs/`` folder (found without importing the package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return Path(package.replace(".", os.sep)) / "configs"
    return Path(next(iter(spec.submodule_search_locations))) / "configs"


# A user error in choosing or configuring a recipe (the CLI prints it and exits 2): the engines' SettingsError, so the
# pipelines' checks (which cannot import the language) raise the same error the language does.
RecipeConfigError = SettingsError


class ConfigKeyError(RecipeConfigError):
    """A key the recipe's config does not define."""

    def __init__(self, message: str, key: str, value: Any, suggestion: str | None) -> None:
        super().__init__(message, key=key, value=value)
        self.suggestion = suggestion


class ConfigTypeError(RecipeConfigError):
    """A value whose type does not match the field's."""


class OverrideSyntaxError(RecipeConfigError):
    """An override that is not ``dotted.key=value``."""


class UnknownRecipeError(RecipeConfigError):
    """No recipe of that name."""


class UnknownConfigError(RecipeConfigError):
    """No shipped config of that name, or a config file that cannot be read."""


class RecipeDefinitionError(TypeError):
    """A recipe that breaks the contract (no RECIPE, no Config, a required key missing): a bug, not a user error."""


class Problem(NamedTuple):
    """One bad value: the key, the value, what is wrong with it and how to fix it."""

    key: str
    value: Any
    message: str
    fix: str


class ConfigValueError(RecipeConfigError):
    """Config values that break their fields' checks, or a recipe's checks across keys."""

    def __init__(self, message: str, problems: list[Problem]) -> None:
        super().__init__(message, key=problems[0].key, value=problems[0].value,
                         fix=problems[0].fix if len(problems) == 1 else None)
        self.problems = problems


def _problems_error(recipe: str | None, problems: list[Problem]) -> ConfigValueError:
    if len(problems) == 1:
        p = problems[0]
        return ConfigValueError(f"{p.message}; fix: {p.fix}", problems)
    who = f" for recipe '{recipe}'" if recipe else ""
    lines = [f"{p.message}; fix: {p.fix}" for p in problems]
    return ConfigValueError(f"config{who} has {len(problems)} problems:\n  - " + "\n  - ".join(lines), problems)


# --- YAML ------------------------------------------------------------------------------------
# PyYAML follows YAML 1.1: `no`, `off`, `y` become booleans and `1e-3` stays a string. This loader accepts only
# true/false as booleans and reads exponent floats as floats, like YAML 1.2 and OmegaConf.
class _Loader(yaml.SafeLoader):
    pass


_BOOL_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.VERBOSE),
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
                name, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
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


def yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


# --- recipes and shipped configs -------------------------------------------------------------------
def list_recipes(folder: str | Path | None = None) -> dict[str, list[str]]:
    """``{recipe: [config names]}`` from the folders of the configs folder (``<recipe>/<name>.yaml``)."""
    root = Path(folder) if folder is not None else configs_dir()
    if not root.is_dir():
        return {}
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(("_", "."))}


def config_path(recipe: str, name: str, folder: str | Path | None = None) -> Path:
    """The shipped YAML ``<configs>/<recipe>/<name>.yaml``; UnknownConfigError if absent."""
    folder = Path(folder) if folder is not None else configs_dir()
    name = name.removesuffix(".yaml")
    path = folder / recipe / f"{name}.yaml"
    if path.is_file():
        return path
    available = list_recipes(folder).get(recipe, [])
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


def resolve_config_file(recipe: str, config: str, folder: str | Path | None = None) -> Path:
    """A config argument as a file: a path if it has a '/' or a .yaml/.yml suffix, else a shipped name."""
    if "/" in config or "\\" in config or config.endswith((".yaml", ".yml")):
        path = Path(config).expanduser()
        if not path.is_file():
            raise UnknownConfigError(f"config file '{config}' does not exist")
        return path.resolve()
    return config_path(recipe, config, folder)


def load_recipe(recipe: str, package: str = RECIPES_PACKAGE, folder: str | Path | None = None) -> Any:
    """The recipe class of ``<package>.<recipe>`` (its module's ``RECIPE``)."""
    if not re.fullmatch(r"[A-Za-z_]\w*", recipe):
        raise UnknownRecipeError(f"'{recipe}' is not a recipe name.{_recipe_hint(recipe, package, folder)}")
    modname = f"{package}.{recipe}"
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name not in (modname, package):  # a missing dependency inside a recipe is not the user's error
            raise
        hint = _recipe_hint(recipe, package, folder)
        raise UnknownRecipeError(f"unknown recipe '{recipe}' (no module {modname}).{hint}") from None
    cls = getattr(module, "RECIPE", None)
    if cls is None:
        raise UnknownRecipeError(f"'{recipe}' is not a recipe (module {modname} defines no RECIPE)."
                                 f"{_recipe_hint(recipe, package, folder)}")
    config = getattr(cls, "Config", None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(config)):
        raise RecipeDefinitionError(f"{modname}.RECIPE must be a Recipe class with a Config dataclass")
    missing = [k for k in REQUIRED_KEYS if k not in {f.name for f in dataclasses.fields(config)}]
    if missing:
        raise RecipeDefinitionError(f"{modname}: Config lacks required key(s) {missing}")
    return cls


def _recipe_hint(recipe: str, package: str, folder: str | Path | None) -> str:
    names = sorted(list_recipes(folder if folder is not None else configs_dir(package)))
    close = difflib.get_close_matches(recipe, names, n=1)
    return (f" Did you mean '{close[0]}'?" if close else "") + f" Known recipes: {', '.join(names) or '(none)'}."


# --- the schema: a recipe's keys, from its typed config and its roles ------------------------------------
class Key(NamedTuple):
    """A default with a help line of its own (a role's default that means more there, e.g. "pairs per rank")."""

    default: Any
    help: str


class Leaf(NamedTuple):
    """One key: its default, type, help, checks and ``when`` (the sibling that must be set for it to matter)."""

    default: Any
    annotation: Any
    help: str
    checks: tuple
    when: str = ""
    example: Any = None
    items_when: tuple = ()  # ((item, condition), ...): a list's items that ask for a feature


@dataclasses.dataclass
class Node:
    """A section: its help, its keys (Leaf or Node) and how its object is built from them."""

    help: str
    children: dict[str, Any]
    build: Callable[[dict[str, Any]], Any]
    refused: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> why this section has no such key


def settings_node(cls: type, help: str = "", defaults: dict[str, Any] | None = None, omit: Iterable[str] = (),
                  refused: dict[str, str] | None = None) -> Node:
    """The schema of a settings dataclass: a Leaf per field, a Node per nested section; ``defaults`` (values or
    :class:`Key`) change defaults and help; ``omit`` leaves keys out (``refused`` says why, for the error)."""
    defaults, omit = dict(defaults or {}), set(omit)
    defaults_given = {k: v for k, v in defaults.items() if not isinstance(v, dict)}
    hints = typing.get_type_hints(cls)
    children: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in omit or not f.init or f.metadata.get("hidden"):
            continue
        given = defaults.pop(f.name, dataclasses.MISSING)
        if f.metadata.get("section"):
            inner = {**f.metadata.get("defaults", {}), **(given if isinstance(given, dict) else {})}
            sub_omit = [o.split(".", 1)[1] for o in omit if o.startswith(f.name + ".")]
            children[f.name] = settings_node(f.metadata["section"], field_help(f), inner, sub_omit)
            continue
        help_text = field_help(f)
        if isinstance(given, Key):
            given, help_text = given.default, given.help
        if given is dataclasses.MISSING:
            given = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        children[f.name] = Leaf(copy.deepcopy(given), hints.get(f.name, Any), help_text, field_checks(f),
                                f.metadata.get("when", ""), f.metadata.get("example"), f.metadata.get("items_when", ()))
    if defaults:
        raise RecipeDefinitionError(f"{cls.__name__} has no field(s) {sorted(defaults)} to set defaults of")
    for name in defaults_given:
        if isinstance(children.get(name), Leaf) and children[name].when:
            raise RecipeDefinitionError(f"{cls.__name__}.{name} applies only with {children[name].when}: a recipe "
                                        "cannot change its default (the class's default means 'unset')")
    return Node(help, children, lambda kw: cls(**kw), dict(refused or {}))


def recipe_schema(recipe: Any) -> Node:
    """The whole schema of a recipe class: its Config's fields (less ``recipe.omit``) and its roles section."""
    cached = recipe.__dict__.get("_schema")
    if cached is not None:
        return cached
    config = recipe.Config
    node = settings_node(config, "", omit=[*recipe.omit, "roles"])
    if recipe.roles:  # the declarations (roles.Role) build their section: roles.py imports this module, not back
        node.children["roles"] = recipe.roles[0].section(recipe.roles)
    build = node.build
    node.build = lambda kw: build({**kw, "roles": kw.get("roles")})
    recipe._schema = node
    return node


def defaults_of(node: Node) -> dict[str, Any]:
    return {k: defaults_of(v) if isinstance(v, Node) else copy.deepcopy(v.default) for k, v in node.children.items()}


def leaves(node: Node, prefix: str = "") -> dict[str, Leaf]:
    """Dotted key -> Leaf of every key of ``node``."""
    out: dict[str, Leaf] = {}
    for name, child in node.children.items():
        if isinstance(child, Node):
            out.update(leaves(child, f"{prefix}{name}."))
        else:
            out[prefix + name] = child
    return out


def _paths(node: Node, prefix: str = "") -> list[str]:
    out = []
    for name, child in node.children.items():
        out.append(prefix + name)
        if isinstance(child, Node):
            out.extend(_paths(child, f"{prefix}{name}."))
    return out


# --- merging YAML and overrides --------------------------------------------------------------------
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


class _Ctx:
    """What an error message needs: the recipe, its schema, where each value came from and the old key names."""

    def __init__(self, recipe: str, schema: Node, renamed: dict[str, str]) -> None:
        self.recipe, self.schema, self.renamed = recipe, schema, renamed
        self.where: dict[str, str] = {}  # dotted key -> where its value was last set
        self.raw: dict[str, str] = {}  # dotted key -> an override's text (a str key keeps exactly what was typed)
        self.source = "the default"
        self.layer, self.layers = 0, {}  # dotted key -> the layer that set it: 0 defaults, 1 the file, 2 overrides

    def unknown(self, path: str, value: Any, node: Node | None, note: str = "") -> ConfigKeyError:
        all_paths = _paths(self.schema)
        new = renamed_key(path, self.renamed)
        if new is not None:  # an entry "new.key (how)" names the new key and how its values differ
            key, _, how = new.partition(" ")
            if key not in all_paths:  # a typo inside an old section: the closest key of the new one
                close = difflib.get_close_matches(key, all_paths, n=1)
                key = close[0] if close else key
            fix = f"set {key} {how}" if how else f"write {key}={_show(value)}"
            return ConfigKeyError(f"config key '{path}' (value {value!r}) is now '{key}' in recipe '{self.recipe}': "
                                  f"every role is configured under roles.<name> with the same keys. Fix: {fix}. "
                                  f"({self.source})", path, value, key)
        last = path.rsplit(".", 1)[-1]
        parent = path[: -len(last)]
        if node is not None and last in node.refused:
            return ConfigKeyError(f"config key '{path}' (value {value!r}) is not accepted by recipe '{self.recipe}': "
                                  f"{node.refused[last]} ({self.source})", path, value, None)
        suggestion = None
        if node is not None:  # the section exists: the likeliest fix is a key next to it
            close = difflib.get_close_matches(last, list(node.children), n=1)
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
        elif node is not None:
            msg += f" Valid keys{' under ' + parent[:-1] if parent else ''}: {', '.join(sorted(node.children))}."
        return ConfigKeyError(msg + f" ({self.source})", path, value, suggestion)

    def wrong_type(self, path: str, value: Any, expected: str) -> ConfigTypeError:
        return ConfigTypeError(f"config key '{path}' for recipe '{self.recipe}' expects {expected}, got {value!r} "
                               f"({type(value).__name__}). ({self.where.get(path, self.source)})")


def _merge(target: dict, node: Node, data: dict, prefix: str, ctx: _Ctx) -> None:
    """Merge ``data`` into ``target``, every key checked against the schema ``node`` (values are typed later)."""
    for key, value in data.items():
        path = f"{prefix}{key}"
        child = node.children.get(key) if isinstance(key, str) else None
        if child is None:
            raise ctx.unknown(path, value, node)
        if isinstance(child, Node):
            if not isinstance(value, dict):
                raise ctx.wrong_type(path, value, "a mapping")
            _merge(target[key], child, value, path + ".", ctx)
        else:
            target[key] = copy.deepcopy(value)
            ctx.where[path], ctx.layers[path] = ctx.source, ctx.layer


_KEY_RE = re.compile(r"[A-Za-z_][\w-]*(?:\.[\w-]+)*")


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=[1,2]"`` -> ``("a.b", [1, 2])``; the value is read as YAML (``key=`` is the empty string)."""
    if "=" not in text:
        raise OverrideSyntaxError(f"malformed override '{text}': expected key=value (e.g. max_steps=3)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not _KEY_RE.fullmatch(key):
        raise OverrideSyntaxError(f"malformed override '{text}': '{key}' is not a config key (expected "
                                  "dotted.key=value)")
    if not raw.strip():
        return key, ""
    try:
        value = yaml_load(raw)
    except DuplicateKeyError as e:
        inner = f"{key}{'' if e.key.startswith('[') else '.'}{e.key}"
        raise OverrideSyntaxError(f"malformed override '{text}': key '{inner}' is set twice in '{raw}'") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise OverrideSyntaxError(f"malformed override '{text}': cannot read value '{raw}' ({problem})") from None
    return key, value


def _apply_override(merged: dict, text: str, ctx: _Ctx) -> None:
    key, value = parse_override(text)
    ctx.source = f"in override '{text}'"
    parts = key.split(".")
    node, target = ctx.schema, merged
    for i, part in enumerate(parts[:-1]):
        child = node.children.get(part)
        if not isinstance(child, Node):  # a wrong section name: match the full path
            section = ".".join(parts[: i + 1])
            if child is None and part in node.refused:
                raise ctx.unknown(section, value, node)
            note = f"'{section}' is not a section (default {child.default!r})." if isinstance(child, Leaf) else ""
            raise ctx.unknown(key, value, None, note)
        node, target = child, target[part]
    _merge(target, node, {parts[-1]: value}, key[: -len(parts[-1])], ctx)
    ctx.raw[key] = text.split("=", 1)[1]


# --- types and checks ---------------------------------------------------------------------------------
_SCALARS = {bool: "bool (true/false)", int: "int", float: "float", str: "str"}


def _coerce(path: str, value: Any, annotation: Any, ctx: _Ctx) -> Any:
    """``value`` as the field's type, or ConfigTypeError."""
    if value is None or annotation is Any:
        return value
    args = typing.get_args(annotation)
    if type(None) in args:  # X | None
        rest = [a for a in args if a is not type(None)]
        return _coerce(path, value, rest[0] if len(rest) == 1 else Any, ctx)
    origin = typing.get_origin(annotation) or annotation
    if origin is bool:
        if isinstance(value, bool):
            return value
    elif origin is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif origin is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif origin is str:
        if isinstance(value, str):
            return value
        if path in ctx.raw:  # the text typed: `name=007`, `p=a: b`
            return ctx.raw[path].strip()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            item = args[0] if args and args[0] in _SCALARS else None
            return [_coerce(f"{path}[{i}]", v, item, ctx) if item else v for i, v in enumerate(value)]
        raise ctx.wrong_type(path, value, "list (e.g. [a,b])")
    elif origin is dict:
        if isinstance(value, dict):
            return value
        raise ctx.wrong_type(path, value, "a mapping")
    else:
        return value
    raise ctx.wrong_type(path, value, _SCALARS.get(origin, str(origin)))


def _typed(node: Node, tree: dict, prefix: str, ctx: _Ctx) -> None:
    for name, child in node.children.items():
        path = prefix + name
        if isinstance(child, Node):
            _typed(child, tree[name], path + ".", ctx)
        else:
            tree[name] = _coerce(path, tree[name], child.annotation, ctx)


def _switch_off(path: str, leaf: Leaf, tree: dict) -> str | None:
    """The full ``when`` condition of a key that asks for something its switch has turned off, else None."""
    parent = path.rsplit(".", 1)[0] + "." if "." in path and "." not in leaf.when.partition("=")[0] else ""
    if not leaf.when or when_holds(leaf.when, lambda name: _lookup(tree, parent + name)):
        return None
    return parent + leaf.when if sets_feature(_lookup(tree, path), leaf.default) else None


def inactive_keys_of(schema: Node, tree: dict, where: dict[str, str], layers: dict[str, int]) -> dict[str, str]:
    """The later setting wins: a ``when`` key set in an earlier layer (defaults < file < overrides) than the one
    that turned its switch off goes back to its default, ``{key: why}``; one set in the same or a later layer stays
    for :func:`check_tree` to refuse (a contradiction written in one place)."""
    inactive: dict[str, str] = {}
    changed = True
    while changed:  # a switch turned off this way turns off the keys that depend on it
        changed = False
        for path, leaf in leaves(schema).items():
            when = _switch_off(path, leaf, tree)
            switch = (when or "").partition("=")[0]
            if when and path not in inactive and layers.get(path, 0) < layers.get(switch, 0):
                inactive[path] = (f"{when_problem(when)}; {switch}={_lookup(tree, switch)!r} {where[switch]} "
                                  f"(so {_lookup(tree, path)!r} {where.get(path, 'by default')} is not used)")
                parts = path.split(".")
                _lookup(tree, ".".join(parts[:-1]))[parts[-1]] = copy.deepcopy(leaf.default)
                layers[path], changed = layers[switch], True
            for item, when in _items_off(path, leaf, tree):
                switch = when.partition("=")[0]
                if layers.get(path, 0) < layers.get(switch, 0):
                    inactive[path] = (f"its item {item!r} {when_problem(when)}; {switch}={_lookup(tree, switch)!r} "
                                      f"{where[switch]} (so {item!r} {where.get(path, 'by default')} is not used)")
                    _lookup(tree, path).remove(item)
    return inactive


def _items_off(path: str, leaf: Leaf, tree: dict) -> list[tuple[Any, str]]:
    """``[(item, condition)]``: the items of a list key that ask for a feature that is off."""
    off = []
    for item, when in leaf.items_when:
        try:
            if item in _lookup(tree, path) and not when_holds(when, lambda name: _lookup(tree, name)):
                off.append((item, when))
        except KeyError:  # the recipe has no such feature
            continue
    return off


def check_tree(recipe: str, schema: Node, tree: dict, where: dict[str, str] | None = None) -> None:
    """Each value against its field's checks (and ``when``): ConfigValueError listing every problem, in key order."""
    where = where or {}
    problems = []
    for path, leaf in leaves(schema).items():
        value = _lookup(tree, path)
        source = where.get(path, "the default")
        found = value_problem(path, value, leaf.checks, leaf.annotation, leaf.default)
        when = _switch_off(path, leaf, tree) if found is None else None
        if when:
            found = (when_problem(when), f"set {when}, or drop {path}")
        for item, when in _items_off(path, leaf, tree) if found is None else ():
            found = (f"names {item!r}, which {when_problem(when)}", f"set {when}, or drop {item!r} from {path}")
        if found is not None:
            problem, fix = found
            problems.append(Problem(path, value, f"config key '{path}' for recipe '{recipe}' {problem}, got {value!r} "
                                                 f"({source})", fix))
    if problems:
        raise _problems_error(recipe, problems)


def _lookup(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split(".") if key else ():
        node = node[part]
    return node


def _build(node: Node, tree: dict, prefix: str, recipe: str, where: dict[str, str]) -> Any:
    """The typed object of ``node`` from the checked values of ``tree``; a rule across keys of one section
    (its ``check()``) becomes a ConfigValueError naming the whole key."""
    values = {name: _build(child, tree[name], f"{prefix}{name}.", recipe, where) if isinstance(child, Node)
              else tree[name] for name, child in node.children.items()}
    try:
        return node.build(values)
    except SettingsError as e:
        if not isinstance(e, FieldError):  # a FieldError names a field of this section: name the whole key
            raise
        path = prefix + e.key
        problem = getattr(e, "problem", None) or str(e)
        raise _problems_error(recipe, [Problem(path, e.value, f"config key '{path}' for recipe '{recipe}' {problem}, "
                                                          f"got {e.value!r} ({where.get(path, 'the default')})",
                                               e.fix or "")]) from None


def load_config(recipe: str, config: str | None = None, overrides: Iterable[str] = (), *,
                package: str = RECIPES_PACKAGE, configs_dir: str | Path | None = None) -> Any:
    """The recipe's defaults, then the YAML ``config`` (shipped name or path), then ``overrides``, as the recipe's
    typed config object. Raises RecipeConfigError subclasses for user errors."""
    cls = load_recipe(recipe, package, configs_dir)
    schema = recipe_schema(cls)
    ctx = _Ctx(recipe, schema, dict(cls.renamed))
    merged = defaults_of(schema)
    if config is not None:
        path = resolve_config_file(recipe, config, configs_dir)
        try:
            data = yaml_load(path.read_text(encoding="utf-8"))
        except DuplicateKeyError as e:
            raise UnknownConfigError(f"config file {path}: {e}; YAML would keep only the second value; fix: delete "
                                     "one of the two lines") from None
        except yaml.YAMLError as e:
            raise UnknownConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UnknownConfigError(f"config file {path} must be a mapping of keys, got {type(data).__name__}")
        ctx.source, ctx.layer = f"in {path}", 1
        _merge(merged, schema, data, "", ctx)
    ctx.layer = 2  # the override list is one layer: a contradiction within it is refused
    for text in overrides:
        _apply_override(merged, text, ctx)
    merged = _resolve(recipe, merged)
    _typed(schema, merged, "", ctx)
    inactive = inactive_keys_of(schema, merged, ctx.where, ctx.layers)
    check_tree(recipe, schema, merged, ctx.where)
    cfg = _build(schema, merged, "", recipe, ctx.where)
    set_key(cfg, cfg)  # which keys a run reads can be told (tests: every key is read by the run, or refused)
    object.__setattr__(cfg, "_inactive", inactive)
    return cfg


def inactive_keys(cfg: Any) -> dict[str, str]:
    """``{key: why}`` of the keys :func:`load_config` set aside: their feature was turned off by a later setting."""
    return dict(getattr(cfg, "_inactive", None) or {})


def inactive_line(cfg: Any) -> str:
    """One line naming the inactive keys and why (grouped by the switch), or ''."""
    why: dict[str, list[str]] = {}
    for key, reason in inactive_keys(cfg).items():
        why.setdefault(reason.split(" (so ")[0], []).append(key)
    return "inactive keys (a later setting turned their feature off): " + "; ".join(
        f"{', '.join(keys)} ({reason})" for reason, keys in why.items()) if why else ""


def _resolve(recipe: str, tree: dict) -> dict:
    """``${...}`` interpolations resolved (OmegaConf's), so a broken one fails here, not hours into the run."""
    if "${" not in json.dumps(tree, default=str):
        return tree
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeConfigError(f"config for recipe '{recipe}': {str(e).splitlines()[0]}") from None


# --- the checks across keys: a recipe's validate ------------------------------------------------------
def world_size_from_env() -> int:
    """The job's world size as torchrun gives it to a rank (``WORLD_SIZE``), 1 outside a launched job."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_output_dir_writable(output_dir: str, key: str = "output_dir") -> None:
    """``output_dir`` can be written (one empty file created and removed in it or its nearest existing parent;
    permission bits miss read-only file systems), before any rank starts rather than at the run's first write."""
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


def validate_config(recipe: str, cfg: Any, *, package: str = RECIPES_PACKAGE, configs_dir: str | Path | None = None,
                    world_size: int | None = None) -> None:
    """The checks across values or outside the config, once before any rank starts: output_dir writable, then the
    recipe's ``validate(cfg, world_size)`` (``world_size``: default ``WORLD_SIZE`` of a launched rank, else 1)."""
    cls = load_recipe(recipe, package, configs_dir)
    check_output_dir_writable(str(cfg.output_dir))
    cls.check(cfg, world_size_from_env() if world_size is None else int(world_size))


def checked_config(recipe: str, config: str | None = None, overrides: Iterable[str] = (), *,
                   package: str = RECIPES_PACKAGE, configs_dir: str | Path | None = None,
                   world_size: int | None = None) -> Any:
    """load_config + validate_config: for a recipe that runs another one in-process (its inputs exist now)."""
    cfg = load_config(recipe, config, overrides, package=package, configs_dir=configs_dir)
    validate_config(recipe, cfg, package=package, configs_dir=configs_dir, world_size=world_size)
    return cfg


# --- --help -------------------------------------------------------------------------------------------
def _type_name(leaf: Leaf) -> str:
    ann = leaf.annotation
    if ann is Any:
        return "any"
    text = getattr(ann, "__name__", None) if not typing.get_args(ann) else str(ann).replace("typing.", "")
    return text or str(ann)


def describe_keys(recipe: Any) -> list[dict[str, str]]:
    """One row per key (sections too): key, type (with its checks), default, meaning."""
    rows = []

    def visit(node: Node, prefix: str) -> None:
        for name, child in node.children.items():
            key = prefix + name
            if isinstance(child, Node):
                rows.append({"key": key, "type": "section", "default": "", "meaning": child.help})
                visit(child, key + ".")
                continue
            kind = _type_name(child) + "".join(f", {c.describe()}" for c in child.checks)
            if child.when:
                kind += f", only with {child.when}"
            rows.append({"key": key, "type": kind, "default": json.dumps(child.default), "meaning": child.help})

    visit(recipe_schema(recipe), "")
    return rows


def format_key_help(recipe_name: str, recipe: Any) -> str:
    rows = describe_keys(recipe)
    head = {"key": "KEY", "type": "TYPE", "default": "DEFAULT", "meaning": "MEANING"}
    widths = {c: min(40, max(len(r[c]) for r in [head, *rows])) for c in ("key", "type", "default")}
    lines = [f"config keys of recipe '{recipe_name}' (set them in a YAML file or as key=value overrides):"]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(f"{r[c]:<{widths[c]}}" for c in ("key", "type", "default"))
                     + f"  {r['meaning']}".rstrip())
    return "\n".join(lines)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested section (settings object or dict) as ``{dotted key: leaf}``."""
    plain = tree.to_dict() if hasattr(tree, "to_dict") else tree
    out: dict[str, Any] = {}
    for k, v in plain.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out

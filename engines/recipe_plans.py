"""The glue between recipes and the memory planner (engines/planner.py): a recipe's roles as planner requests,
models resolved without loading weights, and a planned placement written back into a config.

Models are resolved (:func:`resolve_model`) from a local folder's safetensors headers, the local Hugging Face
cache, the planner's built-in architectures, or the shipped config that exports the folder a config points at.
``assume`` (``--assume role=model``) says what a folder that does not exist yet will hold. Each recipe's own
part (its models and activation shapes) lives in recipes/plans.py.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import planner as P
from .recipe_config import CONFIGS_DIR, RecipeConfigError, list_recipes, load_config, resolve_config_file


@dataclass(frozen=True)
class RoleKeys:
    """The config keys a role's placement is written to (None: the config cannot set it)."""

    stage: str | None = None
    offload_params: str | None = None
    offload_optimizer: str | None = None



@dataclass
class RecipePlan:
    """A recipe's roles for the planner and where their placements live in its config."""

    title: str
    roles: list[P.RoleRequest]
    keys: dict[str, RoleKeys] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # rlhf_e2e: the step's overrides list (e.g. "sft.overrides") that --write appends the placements to
    overrides_key: str | None = None



def _is_pathlike(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") >= 2 or os.path.exists(name)



def _hub_cache(name: str) -> str | None:
    """The local Hugging Face cache's snapshot of `name`, without any network access."""
    if _is_pathlike(name) or name.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (or no huggingface_hub): fall through to the built-in table
        return None



def _producer(path: str, configs_dir: str | Path) -> tuple[str, str] | None:
    """(model, description) when `path` is `<output_dir>/export/<role>` of a shipped config: the model
    that config starts from (its export has the same architecture)."""
    norm = os.path.normpath(path)
    for recipe, names in list_recipes(configs_dir).items():
        for name in names:
            try:
                data = yaml.safe_load((Path(configs_dir) / recipe / f"{name}.yaml").read_text(encoding="utf-8"))
            except (OSError, yaml.YAMLError):
                continue
            if not isinstance(data, dict) or not data.get("output_dir"):
                continue
            export = os.path.normpath(os.path.join(str(data["output_dir"]), "export"))
            if os.path.dirname(norm) != export:
                continue
            role = ((data.get("roles") or {}).get(os.path.basename(norm)) or {})  # the exporting role's section
            model = role.get("model") or (data.get("model") or {}).get("pretrained")
            if model:
                return str(model), f"{recipe}/{name} exports there, starting from {model}"
            return "tiny:rlhf", f"{recipe}/{name} exports there, starting from its tiny model"
    return None



def resolve_model(name: str, role: str, *, assume: Mapping[str, str] | None = None,
                  configs_dir: str | Path = CONFIGS_DIR, tiny: Callable[[], P.ModelInfo] | None = None,
                  _seen: tuple[str, ...] = ()) -> P.ModelInfo:
    """A single model's parameters from `name` (folder, cached hub name, built-in name, or a shipped
    config's export folder); `assume[role]` replaces `name`."""
    from multiengine.engines import known_models

    note = ""
    if assume and role in assume:
        name, note = assume[role], f" (--assume {role}={assume[role]})"
    if name == "tiny:rlhf" and tiny is not None:
        return tiny()
    if os.path.isdir(name):
        return P.model_info(name)
    cached = _hub_cache(name)
    if cached:
        return P.model_info(cached)
    if known_models.is_known(name):
        return known_models.known_model_info(name)
    produced = _producer(name, configs_dir) if name not in _seen else None
    if produced:
        model, why = produced
        info = resolve_model(model, role, configs_dir=configs_dir, tiny=tiny, _seen=(*_seen, name))
        return P.ModelInfo(source=f"{name} (not there yet: {why})", tensors=info.tensors, config=info.config,
                           class_name=info.class_name)
    raise RecipeConfigError(
        f"role '{role}': model {name!r}{note} is not a local folder, not in the local Hugging Face cache and not a "
        f"built-in architecture ({', '.join(known_models.known_names())}). Download it, or say what it will "
        f"hold with --assume {role}=<folder or built-in name>.")



def resolve_pipeline(name: str, *, variant: str | None = None,
                     tiny: Callable[[], tuple[dict[str, P.ModelInfo], str]] | None = None,
                     assume: Mapping[str, str] | None = None) -> tuple[dict[str, P.ModelInfo], str]:
    """Per component ModelInfo of a diffusers pipeline (folder, cached hub name or built-in), and its source."""
    from multiengine.engines import known_models

    if assume and "pipeline" in assume:
        name = assume["pipeline"]
    if not name and tiny is not None:
        return tiny()
    if os.path.isdir(name):
        return P.pipeline_info(name, variant), name
    cached = _hub_cache(name)
    if cached:
        return P.pipeline_info(cached, variant), f"{name} (local cache)"
    if known_models.canonical(name) in known_models.PIPELINES:
        return known_models.known_pipeline_info(name), f"{name} (built-in architecture)"
    raise RecipeConfigError(
        f"model.pretrained={name!r} is not a diffusers folder, not in the local Hugging Face cache and not a "
        f"built-in pipeline ({', '.join(sorted(known_models.PIPELINES))}). Download it, or pass "
        f"--assume pipeline=<folder or built-in name>.")



def _current(stage: int, trainable: bool, offload_params: bool = False, offload_optimizer: bool = False) -> P.Choice:
    if not trainable and stage in (1, 2):
        stage = 0
    return P.Choice(stage, bool(offload_optimizer and trainable and stage > 0), bool(offload_params and stage == 3))



def _role(name: str, info: P.ModelInfo, dtype: str, *, trainable: bool, current: P.Choice,
          lora: tuple[int, Sequence[str]] | None = None, extra_trainable: int = 0,
          phases: Sequence[tuple[str, int]] = (), full_gather: Sequence[str] = (),
          choices: Sequence[P.Choice] = (), follows: str | None = None, follows_all: bool = False,
          note: str = "", gather_hint: str = "") -> P.RoleRequest:
    params = info.params
    numels = list(info.numels)
    trainable_params = params if trainable else 0
    if lora is not None:
        rank, targets = lora
        adapter_numels = P.lora_tensors(info.tensors, rank, targets)
        adapters = sum(adapter_numels)
        if not adapters:
            raise RecipeConfigError(f"role '{name}': LoRA target_modules {list(targets)} match no weight of the "
                                    f"model ({info.source}).")
        params += adapters
        numels += adapter_numels
        trainable_params = adapters + extra_trainable if trainable else 0
    return P.RoleRequest(
        name=name, params=params, dtype=dtype, trainable_params=trainable_params, numels=tuple(numels),
        hidden_size=info.hidden_size, lora=lora is not None, phases=tuple(phases), full_gather=tuple(full_gather),
        choices=tuple(choices), current=current, follows=follows, follows_all=follows_all, source=info.source,
        note=note, gather_hint=gather_hint)



def _keys(prefix: str, *, offload_params: bool = True, offload_optimizer: bool = True) -> RoleKeys:
    return RoleKeys(f"{prefix}.stage", f"{prefix}.offload_params" if offload_params else None,
                    f"{prefix}.offload_optimizer" if offload_optimizer else None)



def module_info(name: str, module: Any, dtype: str = "F32") -> P.ModelInfo:
    """The ModelInfo of a model built in code (its parameters' names and shapes; meta tensors work)."""
    return P.ModelInfo(name, tuple(P.TensorEntry(n, tuple(p.shape), dtype) for n, p in module.named_parameters()))



STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")



def _set(data: dict, dotted: str, value: Any) -> None:
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value



def placement_overrides(item: RecipePlan, placements: Mapping[str, P.Choice]) -> list[str]:
    """`key=value` overrides that put each role of `item` at its planned placement."""
    out = []
    for role, keys in item.keys.items():
        c = placements[role]
        for key, value in ((keys.stage, c.stage), (keys.offload_params, c.offload_params),
                           (keys.offload_optimizer, c.offload_optimizer)):
            if key is not None:
                out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    return out



def write_config(recipe: str, config: str | None, overrides: Sequence[str], items: Sequence[RecipePlan],
                 placements: Sequence[Mapping[str, P.Choice]], dest: str | os.PathLike, header: str,
                 configs_dir: str | Path = CONFIGS_DIR) -> Path:
    """The config (file + overrides) with every planned placement set, written to `dest` (atomically)."""
    from multiengine.engines.recipe_config import _yaml_load, parse_override

    data: dict[str, Any] = {}
    source_header: list[str] = []
    if config:
        path = resolve_config_file(recipe, config, configs_dir)
        text = path.read_text(encoding="utf-8")
        data = copy.deepcopy(_yaml_load(text) or {})
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            source_header.append(line)
    for text in overrides:
        key, value = parse_override(text)
        _set(data, key, value)
    for item, chosen in zip(items, placements):
        if item.overrides_key:
            section, _, name = item.overrides_key.partition(".")
            existing = list((data.get(section) or {}).get(name) or [])
            _set(data, item.overrides_key, existing + placement_overrides(item, chosen))
            continue
        for text in placement_overrides(item, chosen):
            key, value = parse_override(text)
            _set(data, key, value)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110)
    lines = [f"# {line}" for line in header.splitlines()] + source_header
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n" + body, encoding="utf-8")
    os.replace(tmp, dest)
    load_config(recipe, str(dest.resolve()), configs_dir=configs_dir)  # what we wrote must load
    return dest

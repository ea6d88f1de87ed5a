"""The glue between recipes and the memory planner: roles as planner requests, models resolved without weights
(local safetensors headers, the hub cache, built-in architectures, or the shipped config exporting a folder;
``--assume role=model``), and a planned placement written back into a config."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from multiengine.engines import planner as P
from multiengine.engines.settings import DECODER_LORA_TARGETS

from .config import RecipeConfigError, configs_dir, list_recipes, load_config, resolve_config_file, yaml_load


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
    packed: list[str] = field(default_factory=list)  # the roles whose token-sequence passes run packed (a note)
    # rlhf_e2e: the step's overrides list (e.g. "sft.overrides") that --write appends the placements to
    overrides_key: str | None = None
    # roles.rollout.ranks: what each rollout GPU (the job's last ones) holds; the roles above are then partitioned
    # over the other GPUs, the trainer GPUs
    rollout: RecipePlan | None = None
    rollout_ranks: tuple[int, ...] = ()


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


def _producer(path: str, folder: str | Path | None) -> tuple[str, str] | None:
    """(model, description) when `path` is `<output_dir>/export/<role>` of a shipped config: the model
    that config starts from (its export has the same architecture)."""
    norm = os.path.normpath(path)
    folder = Path(folder) if folder is not None else configs_dir()
    for recipe, names in list_recipes(folder).items():
        for name in names:
            try:
                data = yaml.safe_load((folder / recipe / f"{name}.yaml").read_text(encoding="utf-8"))
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
                  folder: str | Path | None = None, tiny: Callable[[], P.ModelInfo] | None = None,
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
    produced = _producer(name, folder) if name not in _seen else None
    if produced:
        model, why = produced
        info = resolve_model(model, role, folder=folder, tiny=tiny, _seen=(*_seen, name))
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


def current_choice(stage: int, trainable: bool, offload_params: bool = False,
                   offload_optimizer: bool = False) -> P.Choice:
    if not trainable and stage in (1, 2):
        stage = 0
    return P.Choice(stage, bool(offload_optimizer and trainable and stage > 0), bool(offload_params and stage == 3))


def role_plan(name: str, info: P.ModelInfo, dtype: str, *, trainable: bool, current: P.Choice,
              lora: tuple[int, Sequence[str]] | None = None, extra_trainable: int = 0, **request: Any) -> P.RoleRequest:
    """The planner's RoleRequest of a role on the model ``info`` (its LoRA adapters added); ``request``: the other
    RoleRequest fields (phases, full_gather, choices, follows, follows_all, note, gather_hint)."""
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
    request.update({k: tuple(request.get(k, ())) for k in ("phases", "full_gather", "choices")})
    return P.RoleRequest(name=name, params=params, dtype=dtype, trainable_params=trainable_params,
                         numels=tuple(numels), hidden_size=info.hidden_size, lora=lora is not None, current=current,
                         source=info.source, moe=info.moe, **request)


def role_keys(prefix: str, *, offload_params: bool = True, offload_optimizer: bool = True) -> RoleKeys:
    return RoleKeys(f"{prefix}.stage", f"{prefix}.offload_params" if offload_params else None,
                    f"{prefix}.offload_optimizer" if offload_optimizer else None)


def module_info(name: str, module: Any, dtype: str = "F32") -> P.ModelInfo:
    """The ModelInfo of a model built in code (its parameters' names and shapes; meta tensors work)."""
    return P.ModelInfo(name, tuple(P.TensorEntry(n, tuple(p.shape), dtype) for n, p in module.named_parameters()))


STATE_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")


def lora_choice(section: Any, default_targets: Sequence[str] | None = None) -> tuple[int, tuple[str, ...]] | None:
    """(rank, target modules) of a role's ``lora`` section, None for ``r: 0``; empty target modules take
    ``default_targets`` (unless given, the decoders' q/k/v and output projections), as TrainableRole.lora_spec does."""
    targets = tuple(section.target_modules) or tuple(default_targets or DECODER_LORA_TARGETS)
    return (int(section.r), targets) if section.r else None


def scalar_info(info: P.ModelInfo) -> P.ModelInfo:
    """A reward model / critic from `info`: the LM body without its head plus a value head (the folder's own
    ``score.weight`` or ``value_head.safetensors`` when it has one)."""
    has_head = any(t.name in ("score.weight", "weight") or t.name.startswith("value_head") for t in info.tensors)
    body = info.without("lm_head.")
    if has_head:
        return body
    hidden = P.transformer_dims(info.config).hidden if info.config else (info.hidden_size or 1)
    return body.plus("value_head.weight", (1, hidden))


def lm_phases(dims: P.TransformerDims, dtype: str, *, train: tuple[int, int] | None = None,
              forward: tuple[int, int] | None = None, generate: tuple[int, int, int] | None = None,
              logits: bool = True, checkpointing: bool = False, label: str = "forward") -> list[tuple[str, int]]:
    phases = []
    if generate:
        batch, prompt, new = generate
        kv = P.kv_cache_bytes(dims, batch=batch, seq=prompt + new, dtype=dtype)
        prefill = P.transformer_activation_bytes(dims, batch=batch, seq=prompt, dtype=dtype, trainable=False,
                                                 logits=False)
        phases.append(("generation", kv + prefill + batch * dims.vocab * 4))
    if forward:
        phases.append((label, P.transformer_activation_bytes(dims, batch=forward[0], seq=forward[1], dtype=dtype,
                                                             trainable=False, logits=logits)))
    if train:
        phases.append(("train step", P.transformer_activation_bytes(
            dims, batch=train[0], seq=train[1], dtype=dtype, trainable=True, gradient_checkpointing=checkpointing,
            logits=logits)))
    return phases


def role_request(role: Any, info: P.ModelInfo, phases: Sequence[tuple[str, int]] = (), **options: Any
                 ) -> P.RoleRequest:
    """The planner's request of a role config on the model ``info`` (trainable or frozen, stage, dtype, offload,
    LoRA); ``options``: more request fields (``full_gather``, ``gather_hint``, ``note``, ``choices``...)."""
    request: dict[str, Any] = {
        "lora": lora_choice(role.lora) if role.trainable else None,
        "current": current_choice(role.effective_stage, role.trainable, role.offload_params,
                            getattr(role, "offload_optimizer", False)),
        "phases": phases, "choices": P.trainable_choices() if role.trainable else P.frozen_choices()}
    request.update(options)
    return role_plan(role.name, info, role.effective_dtype, trainable=role.trainable, **request)


def declared_roles(cfg: Any, infos: Mapping[str, P.ModelInfo],
                   phases: Mapping[str, Sequence[tuple[str, int]]] | None = None, *, title: str = "",
                   notes: Sequence[str] = (), pinned: Mapping[str, P.Choice] | None = None, followers: bool = False,
                   **options: Mapping[str, Any]) -> RecipePlan:
    """The planner's roles from a config's declared roles that ``infos`` has a model for; ``pinned`` roles are built
    at one placement, ``followers`` (stage -1) at their leader's; neither has keys for ``--write``."""
    phases, pinned = phases or {}, pinned or {}
    requests, keys = [], {}
    for name, role in cfg.roles.items():
        if name not in infos:
            continue
        follows = role._decl.follows
        extra: dict[str, Any] = {}
        if name in pinned:
            extra.update(current=pinned[name], choices=(pinned[name],))
        elif followers and follows and role.stage == -1:
            extra.update(follows=follows, follows_all=True, note=f"placed like {follows} (its stage is -1)")
        else:
            keys[name] = role_keys(f"roles.{name}", offload_optimizer=role.trainable)
        requests.append(role_request(role, infos[name], phases.get(name, ()), **{**extra, **options.get(name, {})}))
    packed = [name for name, role in cfg.roles.items() if name in infos and packs(role, infos[name])]
    return RecipePlan(title, requests, keys, list(notes), packed)


def lm_role_phases(role: Any, info: P.ModelInfo, **shapes: Any) -> list[tuple[str, int]]:
    """The activation phases (:func:`lm_phases` of ``shapes``) of a causal-LM role config on ``info``, at its
    resolved dtype and with its gradient checkpointing."""
    return lm_phases(P.transformer_dims(info.config), role.effective_dtype,
                      checkpointing=bool(getattr(role, "gradient_checkpointing", False)), **shapes)


def packs(role: Any, info: P.ModelInfo) -> bool:
    """Whether a role config's token-sequence passes run packed on ``info``'s model, as the build decides: ``packing``
    packed, or auto on a family in ``PACKABLE_FAMILIES`` (the built-in tiny model is an OPT: padded)."""
    from multiengine.engines.packing import PACKABLE_FAMILIES

    if not getattr(getattr(role, "_decl", None), "sequences", False):
        return False
    family = str((info.config or {}).get("model_type", ""))
    return role.packing == "packed" or (role.packing == "auto" and family in PACKABLE_FAMILIES)


def update_shape(role: Any, info: P.ModelInfo, seq: int, rows: int) -> tuple[tuple[int, int], list[str]]:
    """(rows, tokens per row) one update micro-batch of a trainable LM role is planned at, and a note: its
    ``micro_batch_size`` rows of ``seq``; with a token budget packed, the budget's tokens in packed rows of ``seq``
    (at least one: a longer sequence runs alone); with a budget on padded rows, as many whole rows as an optimizer
    step has (``micro_batch_size`` x ``grad_accum``, at most ``rows``, at most a token each): short rows fill it."""
    budget = int(getattr(role, "token_budget", 0) or 0)
    if not budget:
        return (role.micro_batch_size, seq), []
    step = min(role.micro_batch_size * role.grad_accum, rows)
    if packs(role, info):
        shape, how = (min(-(-budget // seq), step), seq), "packed"
    else:  # each padded row costs the full width, however few real tokens it holds
        shape, how = (min(step, budget), seq), "padded (up to an optimizer step's rows: short rows fill a budget)"
    return shape, [f"token budget: roles.{role.name} updates on at most {budget} tokens per micro-batch, planned as "
                   f"{shape[0]} rows of {seq} tokens, {how}; micro_batch_size {role.micro_batch_size} rows without it"]


def gather_options(role: Any, *phases: str) -> dict[str, Any]:
    """A frozen role's request options: its ``phases`` run on whole (gathered) weights while its gather_forward is
    on."""
    return {"full_gather": phases if role.gather_forward else (),
            "gather_hint": f"roles.{role.name}.gather_forward=false"}


def recipe_plans(recipe: Any, cfg: Any, assume: Mapping[str, str] | None = None) -> list[RecipePlan]:
    """What the recipe's config builds, as the planner sees it: its class's ``plan(cfg, assume)``."""
    return recipe.plan(cfg, assume)


def _configured(items: Sequence[RecipePlan]) -> Iterator[tuple[P.RoleRequest, P.Choice]]:
    """Each role of each plan with the placement its config asks for (a follower's derived from its leader's
    exactly as the chooser derives it)."""
    for item in items:
        chosen = {r.name: r.current for r in item.roles}
        for req in item.roles:
            choice = chosen[req.name]
            yield req, P.follower_choice(req, chosen[req.follows], choice) if req.follows else choice


def configured_states(recipe: Any, cfg: Any, world_size: int, assume: Mapping[str, str] | None = None
                      ) -> dict[str, dict[str, int]]:
    """Planned per-rank model-state bytes of every role at the placements `cfg` asks for, for the
    planned-vs-measured check next to `registry.memory_report()` (keys as in the memory report)."""
    out: dict[str, dict[str, int]] = {}
    for req, choice in _configured(recipe_plans(recipe, cfg, assume)):
        o = P.cost_role(req, choice, world_size)
        out[req.name] = {"stage": o.choice.stage, "params_total": req.params,
                         "params_persistent": req.persistent if o.choice.stage == 3 else 0,
                         "param_bytes": o.states.params, "grad_bytes": o.states.grads,
                         "optimizer_bytes": o.states.optimizer, "host_bytes": o.states.host}
    return out


def planned_vs_measured(recipe: Any, cfg: Any, per_rank: Sequence[Mapping[str, Any]],
                        assume: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Per role: the planned per-rank model-state bytes at `cfg`'s placements (configured stage, no offload, as the
    memory report counts offloaded tensors too) beside the most any rank measured (`per_rank`), and the difference.
    ``tolerance_bytes``, what the planner promises: 5% of the planned total plus the persistent parameters' bytes."""
    world = len(per_rank)
    measured: dict[str, list[Mapping[str, Any]]] = {}
    for rank in per_rank:
        for row in rank.get("roles", []):
            measured.setdefault(str(row["role"]), []).append(row)
    roles: dict[str, Any] = {}
    for req, choice in _configured(recipe_plans(recipe, cfg, assume)):
        gpu = P.cost_role(req, choice, world)
        anywhere = P.cost_role(req, P.Choice(gpu.choice.stage), world).states
        planned = dict(zip(STATE_KEYS, (anywhere.params, anywhere.grads, anywhere.optimizer)))
        planned["total"] = sum(planned.values())
        persistent = req.persistent if gpu.choice.stage == 3 else 0
        entry: dict[str, Any] = {
            "stage": gpu.choice.stage, "params": req.params, "trainable_params": req.trainable_params,
            "dtype": req.dtype, "params_persistent": persistent, "planned": planned,
            "planned_accelerator_bytes": gpu.states.accelerator, "planned_host_bytes": gpu.states.host,
            "measured": None, "difference_bytes": None, "relative_difference": None,
            "tolerance_bytes": int(0.05 * planned["total"]) + P.DTYPE_BYTES[req.dtype] * persistent,
            "within_tolerance": None,
        }
        rows = measured.pop(req.name, [])
        if rows:
            top = max(rows, key=lambda row: sum(int(row[k]) for k in STATE_KEYS))
            got = {k: int(top[k]) for k in STATE_KEYS}
            got["total"] = sum(got.values())
            diff = got["total"] - planned["total"]
            entry.update(measured=got, measured_stage=int(top["stage"]),
                         measured_params=int(top["params_total"]),
                         measured_params_persistent=int(top["params_persistent"]), difference_bytes=diff,
                         relative_difference=diff / planned["total"] if planned["total"] else None,
                         within_tolerance=abs(diff) <= entry["tolerance_bytes"])
        roles[req.name] = entry
    for name, rows in measured.items():  # built by the run but not planned
        got = {k: int(rows[0][k]) for k in STATE_KEYS}
        roles[name] = {"planned": None, "measured": {**got, "total": sum(got.values())}}
    planned_total = sum(r["planned"]["total"] for r in roles.values() if r["planned"])
    measured_total = sum(r["measured"]["total"] for r in roles.values() if r["planned"] and r["measured"])
    return {"world_size": world, "roles": roles,
            "total": {"planned": planned_total, "measured": measured_total,
                      "difference_bytes": measured_total - planned_total},
            "all_within_tolerance": all(r.get("within_tolerance") for r in roles.values())}


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


def plan_recipe(recipe: Any, cfg: Any, budget: P.Budget, assume: Mapping[str, str] | None = None
                ) -> tuple[list[RecipePlan], list[P.Plan]]:
    """The recipe's plans (:func:`recipe_plans`) laid out for ``budget``, each result with its plan's notes; a plan
    with rollout ranks as two: its roles on the trainer GPUs, its rollout engine on each rollout GPU."""
    items, budgets, placed = [], [], []
    for item in recipe_plans(recipe, cfg, assume):
        if item.rollout is None:
            items.append(item)
            budgets.append(budget)
            placed.append("")
            continue
        trainers, rollouts = placement_budgets(item.rollout_ranks, budget)
        split = (f"{trainers.world_size} trainer GPUs + {rollouts.world_size} rollout GPUs (roles.rollout.ranks="
                 f"{list(item.rollout_ranks)})")
        items += [replace(item, title=f"{item.title}, {trainers.world_size} trainer GPUs"),
                  replace(item.rollout, title=f"{item.title}, {rollouts.world_size} rollout GPUs")]
        budgets += [trainers, rollouts]
        placed += [f"{split}: the DeepSpeed roles are partitioned over the {trainers.world_size} trainer GPUs, and "
                   "the rollout batch keys count per trainer GPU",
                   f"{split}: each rollout GPU holds a whole rollout engine (no DeepSpeed role)"]
    results = [P.plan(item.roles, b) for item, b in zip(items, budgets)]
    for item, result, note in zip(items, results, placed):
        result.notes.extend([note] if note else [])
        result.notes.extend(item.notes)
        if item.packed:
            result.notes.append(f"packed passes ({', '.join(item.packed)}): activations planned at the padded size, "
                                "the most a pass holds (packed, it computes the rows' real tokens only)")
    return items, results


def placement_budgets(ranks: Sequence[int], budget: P.Budget) -> tuple[P.Budget, P.Budget]:
    """The trainer GPUs' and the rollout GPUs' budgets of ``budget`` with ``ranks`` (roles.rollout.ranks) generating:
    the trainer GPUs are a DeepSpeed world of their own; a rollout GPU runs one process, with no NCCL (a gloo bridge
    carries prompts, answers and weights). A config error naming the key when ``ranks`` cannot split the GPUs."""
    from multiengine.engines.placement import layout_problem
    from multiengine.engines.settings import config_problem

    n, r = budget.world_size, len(ranks)
    problem = layout_problem(list(ranks), n)
    if problem is not None:
        fixes = [f"--gpus {max(ranks) + 1}"] if layout_problem(list(ranks), max(ranks) + 1) is None else []
        fixes += [f"roles.rollout.ranks={last}" for last in (list(range(n - k, n)) for k in (r, 1))
                  if n > len(last) and layout_problem(last, n) is None][:1]
        fix = " or ".join([*fixes, "roles.rollout.ranks=[] (rollouts on every rank)"])
        raise config_problem("roles.rollout.ranks", list(ranks), f"does not fit --gpus {n}: {problem}", fix)
    per_node = budget.ranks_per_node
    return (replace(budget, world_size=n - r, gpus_per_node=min(per_node, n - r)),
            replace(budget, world_size=r, gpus_per_node=min(per_node, r), nccl=0))


def write_config(recipe: str, config: str | None, overrides: Sequence[str], planned: tuple[Sequence[RecipePlan],
                 Sequence[P.Plan]], dest: str | os.PathLike, command: str, folder: str | Path | None = None) -> Path:
    """The config (file + overrides) with every placement of ``planned`` (the plans and their results) set, written
    to `dest` (atomically) under a header naming the ``command`` that chose them."""
    from .config import parse_override

    items, results = planned
    placements = [r.placements() for r in results]
    header = (f"Placements chosen by `{command}`:\n"
              + "\n".join(f"  {r.request.name}: {r.chosen.choice.label}" for res in results for r in res.roles))
    data: dict[str, Any] = {}
    source_header: list[str] = []
    if config:
        path = resolve_config_file(recipe, config, folder)
        text = path.read_text(encoding="utf-8")
        data = copy.deepcopy(yaml_load(text) or {})
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
    load_config(recipe, str(dest.resolve()), configs_dir=folder)  # what we wrote must load
    return dest

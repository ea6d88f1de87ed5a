"""The recipe language's roles: one set of keys for every role of every recipe, and one declaration per recipe.

Every role is configured under ``roles.<name>`` with the same keys and meanings. Frozen roles have
:data:`ROLE_KEYS`; trainable roles add :data:`TRAINABLE_KEYS` (optimizer, batches, LoRA). A recipe declares
its roles once, as a tuple of :class:`Role`::

    ROLES = (Role("actor", "the policy", trainable=True, keys={"stage": 2, "lr": 1e-3}),
             Role("ref", "the frozen SFT policy", follows="actor", weights="actor"))

and everything else reads that tuple: :func:`role_keys` writes the ``roles`` section of its DEFAULTS (a role
states only what differs from the shared defaults), :func:`placement`, :func:`optim_spec`, :func:`lora_spec` and
:func:`model_path` turn a built config into the engines' flat arguments ("follow another role" and "weights
from another role" are resolved here and nowhere else), :func:`old_keys` names the new key of every key an
earlier version of the recipe used, and the planner lays the roles out from the same declaration.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from multiengine.engines.recipe_config import (
    Choice,
    Each,
    Key,
    Length,
    Range,
    Satisfies,
    config_problem,
    declared_checks,
    split_keys,
)

__all__ = ["LORA_TARGETS", "ROLE_KEYS", "TRAINABLE_KEYS", "Role", "follow_chain", "lora_spec", "model_path",
           "old_keys", "optim_spec", "placement", "role_keys", "roles_of", "shared_checks", "tokenizer_path",
           "trainable_roles"]

# The attention projections of OPT (the embedded tiny model), Llama, Mistral, Qwen and most decoders.
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]

ROLE_KEYS: dict[str, Key] = {
    "model": Key("", "a model folder (save_pretrained) or hub name; \"\" = as the role's description says"),
    "tokenizer": Key("", "a tokenizer folder or hub name; \"\" = the model folder's own"),
    "stage": Key(3, "ZeRO stage 0-3"),
    "dtype": Key("bf16", "fp32 | bf16 | fp16 (GPU only)"),
    "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
    "offload_optimizer": Key(False, "optimizer state offload to CPU (trainable roles only)"),
    "gather_forward": Key(False, "frozen ZeRO-3 role: gather all its weights once per forward (frozen roles only)"),
    "gradient_checkpointing": Key(False, "recompute activations in backward: less memory, more time"),
}
TRAINABLE_KEYS: dict[str, Key] = {
    "lr": Key(1e-5, "peak learning rate"),
    "weight_decay": Key(0.0, "AdamW weight decay"),
    "betas": Key([0.9, 0.999], "Adam betas [beta1, beta2]"),
    "scheduler": Key("constant", "a transformers scheduler name (constant, constant_with_warmup, linear, cosine, ...)"),
    "warmup_steps": Key(0, "linear warm-up steps"),
    "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
    "micro_batch_size": Key(8, "rows per rank per forward/backward"),
    "grad_accum": Key(1, "micro batches per optimizer step"),
    "lora": Key({
        "r": Key(0, "LoRA adapter rank (0 = full fine-tuning, no adapters)"),
        "alpha": Key(0.0, "LoRA scaling alpha (0 = r)"),
        "dropout": Key(0.0, "adapter dropout"),
        "target_modules": Key(list(LORA_TARGETS), "module names that get adapters"),
    }, "LoRA adapters instead of full fine-tuning (lora.r > 0)"),
}


@dataclass(frozen=True)
class Role:
    """One role of a recipe, declared once.

    ``follows``: the role whose stage and dtype ``stage: -1`` and ``dtype: ""`` take. ``weights``: the role
    whose model folder an empty ``model`` takes (a ref starts from the actor, a critic from the reward
    model); a recipe with its own source for an empty folder (a tiny model, a run it trains first) says so in
    ``help`` and resolves it itself. ``tokenizer_of``: the role whose tokenizer an empty ``tokenizer`` takes.
    ``keys``: the differences from the shared role defaults (plain values keep the shared help).
    """

    name: str
    help: str
    trainable: bool = False
    follows: str = ""
    weights: str = ""
    tokenizer_of: str = ""
    keys: Mapping[str, Any] = field(default_factory=dict)


def _with(base: dict[str, Key], changes: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = copy.deepcopy(base)
    for name, value in changes.items():
        if name not in out:
            raise KeyError(f"{where}: '{name}' is not a role key; role keys: {', '.join(out)}")
        old = out[name]
        if isinstance(value, Key):
            out[name] = value
        elif isinstance(old.default, dict):
            out[name] = old._replace(default=_with(old.default, value, f"{where}.{name}"))
        else:
            out[name] = old._replace(default=value)  # the shared help (and check) with the role's default
    return out


def role_keys(roles: Sequence[Role]) -> Key:
    """The ``roles`` section of a recipe's DEFAULTS (Key leaves), from its declaration."""
    section = {}
    for role in roles:
        base = {**ROLE_KEYS, **TRAINABLE_KEYS} if role.trainable else dict(ROLE_KEYS)
        if role.follows:
            base["stage"] = Key(-1, f"ZeRO stage 0-3; -1 = the stage of roles.{role.follows}")
            base["dtype"] = Key("", f"fp32 | bf16 | fp16 (GPU only); \"\" = the dtype of roles.{role.follows}")
        if role.weights:
            base["model"] = Key("", f"a model folder or hub name; \"\" = roles.{role.weights}'s model")
        if role.tokenizer_of:
            base["tokenizer"] = Key("", f"a tokenizer folder; \"\" = roles.{role.tokenizer_of}'s tokenizer")
        section[role.name] = Key(_with(base, role.keys, f"role '{role.name}'"), role.help)
    return Key(section, "each role's model, placement (ZeRO stage, dtype, offload) and, if trainable, optimizer, "
                        "batches and LoRA; the same keys in every recipe")


def roles_of(module_or_roles: Any) -> dict[str, Role]:
    roles = getattr(module_or_roles, "ROLES", module_or_roles)
    return {r.name: r for r in roles}


def trainable_roles(roles: Sequence[Role]) -> list[str]:
    return [r.name for r in roles if r.trainable]


def _declared(roles: Sequence[Role], name: str) -> Role:
    for role in roles:
        if role.name == name:
            return role
    raise KeyError(f"no role '{name}' is declared (roles: {', '.join(r.name for r in roles)})")


def follow_chain(cfg: Any, roles: Sequence[Role], name: str, key: str, unset: Any) -> Any:
    """roles.<name>.<key>, or while it is ``unset`` (-1 / ""), the value of the role it follows."""
    seen = []
    while True:
        seen.append(name)
        value = cfg.roles[name][key]
        role = _declared(roles, name)
        if value != unset or not role.follows:
            return value
        if role.follows in seen:  # a declaration bug, not a user error
            raise ValueError(f"roles follow each other in a circle: {' -> '.join(seen + [role.follows])}")
        name = role.follows


def placement(cfg: Any, roles: Sequence[Role], name: str) -> Any:
    """The engines' Placement of roles.<name>, following another role where its declaration says so."""
    from multiengine.engines import Placement

    section = cfg.roles[name]
    role = _declared(roles, name)
    return Placement(stage=int(follow_chain(cfg, roles, name, "stage", -1)),
                     dtype=str(follow_chain(cfg, roles, name, "dtype", "")),
                     offload_params=bool(section.offload_params),
                     offload_optimizer=bool(section.offload_optimizer) and role.trainable,
                     gather_forward=bool(section.gather_forward) and not role.trainable)


def optim_spec(cfg: Any, name: str, total_steps: int, **overrides: Any) -> Any:
    """The engines' OptimSpec of a trainable roles.<name> (``max_grad_norm: 0`` = no clipping)."""
    from multiengine.engines import OptimSpec

    s = cfg.roles[name]
    values = {"lr": float(s.lr), "weight_decay": float(s.weight_decay), "betas": tuple(float(b) for b in s.betas),
              "scheduler": str(s.scheduler), "warmup_steps": int(s.warmup_steps), "total_steps": int(total_steps),
              "max_grad_norm": float(s.max_grad_norm) or None}
    values.update(overrides)
    return OptimSpec(**values)


def lora_spec(cfg: Any, name: str, default_targets: Sequence[str] = (), **overrides: Any) -> Any:
    """The engines' LoraSpec of roles.<name>.lora, or None for ``r: 0`` (``alpha: 0`` = alpha = r); an empty
    ``target_modules`` takes ``default_targets`` (the diffusion recipes: the family's)."""
    from multiengine.engines import LoraSpec

    s = cfg.roles[name].lora
    if not s.r:
        return None
    values = {"rank": int(s.r), "alpha": float(s.alpha) or None, "dropout": float(s.dropout),
              "target_modules": tuple(s.target_modules) or tuple(default_targets)}
    values.update(overrides)
    return LoraSpec(**values)


def model_path(cfg: Any, roles: Sequence[Role], name: str, fallback: Mapping[str, str] | None = None) -> str:
    """roles.<name>.model; an empty one takes the folder of the role named by its declaration's ``weights``
    (followed as far as it goes), then ``fallback[role]`` (what the recipe built or trained for it)."""
    fallback = fallback or {}
    seen = []
    while True:
        seen.append(name)
        given = str(cfg.roles[name].model or "")
        if given:
            return given
        role = _declared(roles, name)
        if not role.weights or role.weights in seen:
            return fallback.get(name, "")
        name = role.weights


def tokenizer_path(cfg: Any, roles: Sequence[Role], name: str) -> str:
    """roles.<name>.tokenizer; an empty one takes the tokenizer of ``tokenizer_of`` where declared ("" = the
    model folder's own)."""
    given = str(cfg.roles[name].tokenizer or "")
    role = _declared(roles, name)
    if given or not role.tokenizer_of:
        return given
    return tokenizer_path(cfg, roles, role.tokenizer_of)


def old_keys(trainable: str, *, model: str = "model.pretrained", extra: Mapping[str, str] | None = None
             ) -> dict[str, str]:
    """Old key -> new key of the dialect the recipes spoke before every role had the same keys (a ``.*``
    entry renames a whole section); config loading refuses an old key with a message naming the new one."""
    new = f"roles.{trainable}"
    out = {
        "train.*": f"{new}.*", "lora.enabled": f"{new}.lora.r (to the adapter rank, e.g. 8; 0 = no LoRA)",
        "lora.rank": f"{new}.lora.r", "lora.*": f"{new}.lora.*",
        model: f"{new}.model", "model.tokenizer": f"{new}.tokenizer",
    }
    out.update(extra or {})
    return out


def check_role_sections(cfg: Any, roles: Sequence[Role]) -> None:
    """Cross-key rules every role shares, before any rank starts: stage -1 / dtype "" only for a role that
    follows another, no optimizer offload for a frozen role, no gathered forward for a trainable one, and
    parameter offload only at ZeRO-3."""
    for role in roles:
        s = cfg.roles[role.name]
        key = f"roles.{role.name}"
        if not role.follows and s.stage == -1:
            raise config_problem(f"{key}.stage", -1, "follows no other role", f"set {key}.stage to 0, 1, 2 or 3")
        if not role.follows and s.dtype == "":
            raise config_problem(f"{key}.dtype", "", "follows no other role", f"set {key}.dtype to fp32, bf16 or fp16")
        if not role.trainable and s.offload_optimizer:
            raise config_problem(f"{key}.offload_optimizer", True, f"roles.{role.name} is frozen: it has no optimizer",
                                 f"set {key}.offload_optimizer=false (offload_params=true offloads its weights)")
        if role.trainable and s.gather_forward:
            raise config_problem(f"{key}.gather_forward", True, "applies to frozen roles only (a trainable ZeRO-3 "
                                 "role gathers layer by layer in forward and backward)",
                                 f"set {key}.gather_forward=false")
        stage = follow_chain(cfg, roles, role.name, "stage", -1)
        if s.offload_params and stage != 3:
            raise config_problem(f"{key}.offload_params", True, f"needs ZeRO-3 (roles.{role.name} runs at stage "
                                 f"{stage}): only ZeRO-3 partitions parameters",
                                 f"set {key}.stage=3, or {key}.offload_params=false")


# --- value checks by key name: the same name means the same thing in every recipe --------------------------------
def _scheduler_names() -> list[str]:
    from transformers.trainer_utils import SchedulerType

    return [t.value for t in SchedulerType]


def _by_name(name: str, default: Any) -> Any:
    """The check of a key by its last name (``lr``, ``stage``, ``micro_batch_size``, ``max_new_tokens``, ...)."""
    positive = Range(0, min_exclusive=True)
    if isinstance(default, bool):
        return None
    simple = {
        "max_steps": Range(1), "seed": Range(0), "dist_timeout_s": positive, "keep_last": Range(0),
        "every": Range(0), "size": Range(0), "batch_size": Range(1), "micro_batch_size": Range(1),
        "grad_accum": Range(1), "lr": positive, "weight_decay": Range(0), "warmup_steps": Range(0),
        "max_grad_norm": Range(0), "alpha": Range(0), "dropout": Range(0, 1, max_exclusive=True),
        "target_modules": Length(1) if default else Each(Length(1)),  # [] = the family's targets (diffusion)
        "max_new_tokens": Range(1), "temperature": positive, "top_k": Range(0),
        "top_p": Range(0, 1, min_exclusive=True), "max_prompt_len": Range(1), "max_response_len": Range(1),
        "max_ptx_len": Range(1), "heldout_size": Range(0), "hidden": Range(8), "layers": Range(1), "r": Range(0),
        "student_hidden": Range(8), "student_layers": Range(1), "decay": Range(0, 1),
        "backend": Choice("auto", "deepspeed", "torch"), "mode": Choice("gather", "per_token"),
        # the algorithm sections' shared names (ppo, grpo, dpo, diffusion, ...)
        "epochs": Range(1), "rollout_batch_size": Range(1), "clip_eps": positive, "dual_clip": Range(0),
        "kl_coef": Range(0), "gamma": Range(0, 1), "clip_reward": Range(0), "no_eos_penalty": Range(0),
        # the diffusion recipes' shared names
        "resolution": Range(8), "builtin_size": Range(2), "num_inference_steps": Range(1), "timesteps": Range(1),
        "max_sequence_length": Range(0), "adam_epsilon": positive, "max_train_samples": Range(0),
        "num_workers": Range(0), "tiny_vae_steps": Range(0), "tiny_unet_steps": Range(0),
        "guidance_scale": Range(0, allow_none=default is None),
        "sources": Satisfies(lambda v: isinstance(v, (list, tuple)), "a list of {path, weight, columns, split}"),
    }
    if name in simple:
        return simple[name]
    if name == "stage":
        return Range(-1 if default == -1 else 0, 3)
    if name == "dtype":
        return Choice("fp32", "bf16", "fp16", *([""] if default == "" else []))
    if name == "scheduler":
        return Satisfies(lambda v: v in _scheduler_names(), "a transformers scheduler name (constant, "
                                                              "constant_with_warmup, linear, cosine, ...)")
    if name == "resume_from":
        return Satisfies(lambda v: v in ("", "latest") or os.path.isdir(os.path.expanduser(str(v))),
                         '"", "latest" or an existing checkpoint folder')
    return None


def shared_checks(keys: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A recipe's CHECKS from its KEYS: the check by name of every key whose name the recipes share (see
    :func:`_by_name`; ``data.columns`` is a user's mapping, not checked), each Key's own check, which wins, and
    ``extra`` (patterns, or checks that need more than one key's declaration), which wins over both."""
    out: dict[str, Any] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for name, value in tree.items():
            key = f"{prefix}{name}"
            if isinstance(value, dict):
                if key != "data.columns":
                    walk(value, key + ".")
                continue
            check = _by_name(name, value)
            if check is not None:
                out[key] = check

    walk(split_keys(keys)[0], "")
    out.update(declared_checks(keys))
    out.update(extra or {})
    return out

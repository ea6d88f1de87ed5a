"""The roles of a recipe: declared once, configured under ``roles.<name>`` with the same keys in every recipe.

A recipe declares its roles as a tuple of :class:`Role`::

    roles = (Role("actor", "the policy", trainable=True, defaults={"stage": 2, "lr": 1e-3}),
             Role("ref", "the frozen SFT policy", follows="actor", weights="actor"))

and each ``roles.<name>`` section becomes a typed role config: a :class:`FrozenRole` (model, tokenizer, placement,
``gather_forward``) or a :class:`TrainableRole` (also optimizer, batches, LoRA, gradient checkpointing), holding only
what its kind can honour (``omit`` drops what the recipe cannot, e.g. LoRA on a network peft does not adapt). The
role config resolves "follow another role's stage and dtype" (``stage: -1``, ``dtype: ""``) and "weights from another
role" (an empty ``model``) here and nowhere else, and turns itself into what the registry builds (:meth:`spec`);
``plans.role_request`` turns it into what the planner sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from multiengine.engines.settings import (
    DECODER_LORA_TARGETS,
    DTYPES,
    OPTIMIZER_CHECKS,
    Choice,
    Each,
    Length,
    Range,
    Settings,
    section,
    setting,
)

from .config import Key, Node, config_problem, settings_node

__all__ = ["FrozenRole", "LoraSettings", "Role", "RoleConfig", "Roles", "RolloutRole", "TrainableRole",
           "roles_node"]


@dataclass(frozen=True)
class LoraSettings(Settings):
    r: int = setting(0, "LoRA adapter rank (0 = full fine-tuning, no adapters)", Range(0))
    alpha: float = setting(0.0, "LoRA scaling alpha (0 = r)", Range(0), when="r")
    dropout: float = setting(0.0, "adapter dropout", Range(0, 1, max_exclusive=True), when="r")
    target_modules: list[str] = setting([], "module names that get adapters; [] = the model's usual targets "
                                        "(decoders: q/k/v and output projections; unets, SD3, FLUX: diffusers' "
                                        "attention projections)", Each(Length(1)), when="r")


@dataclass(frozen=True)
class RoleConfig(Settings):
    """The keys every role has: where its weights come from and where it lives."""

    model: str = setting("", "a model folder (save_pretrained) or hub name; \"\" = as the role's description says")
    tokenizer: str = setting("", "a tokenizer folder or hub name; \"\" = the model folder's own")
    stage: int = setting(3, "ZeRO stage 0-3", Range(-1, 3))
    dtype: str = setting("bf16", "fp32 | bf16 | fp16 (GPU only)", Choice(*DTYPES, ""))
    offload_params: bool = setting(False, "ZeRO-3 parameter offload to CPU")
    packing: str = setting("auto", "token-sequence passes without padding: packed | padded | auto (packed for the "
                                   "families that pack, docs/rlhf.md)", Choice("auto", "packed", "padded"))

    # set by Roles: the declaration and the other roles (for follows and weights)
    def _bind(self, decl: Role, roles: Roles) -> None:
        object.__setattr__(self, "_decl", decl)
        object.__setattr__(self, "_roles", roles)

    @property
    def name(self) -> str:
        return self._decl.name

    @property
    def trainable(self) -> bool:
        return False

    def follow(self, key: str, unset: Any) -> Any:
        """This role's ``key``, or while it is ``unset`` (-1 / ""), the value of the role it follows."""
        role, seen = self, []
        while True:
            seen.append(role.name)
            value = getattr(role, key)
            if value != unset or not role._decl.follows:
                return value
            if role._decl.follows in seen:
                raise ValueError(f"roles follow each other in a circle: {' -> '.join([*seen, role._decl.follows])}")
            role = role._roles[role._decl.follows]

    @property
    def effective_stage(self) -> int:
        return int(self.follow("stage", -1))

    @property
    def effective_dtype(self) -> str:
        return str(self.follow("dtype", ""))

    def placement(self, stage: int | None = None) -> Any:
        """The engines' Placement (``stage``: the recipe's, for a role whose stage is not a key, e.g. an EMA's)."""
        from multiengine.engines import Placement

        return Placement(stage=self.effective_stage if stage is None else stage, dtype=self.effective_dtype,
                         offload_params=self.offload_params,
                         offload_optimizer=bool(getattr(self, "offload_optimizer", False)),
                         gather_forward=bool(getattr(self, "gather_forward", False)))

    def model_path(self, fallback: Mapping[str, str] | None = None) -> str:
        """``model``; an empty one takes the folder of the role its declaration's ``weights`` names (followed as far
        as it goes), then ``fallback[role]`` (what the recipe built or trained for it)."""
        fallback, role, seen = fallback or {}, self, []
        while True:
            seen.append(role.name)
            if role.model:
                return role.model
            if not role._decl.weights or role._decl.weights in seen:
                return fallback.get(role.name, "")
            role = role._roles[role._decl.weights]

    def tokenizer_path(self) -> str:
        """``tokenizer``; an empty one takes the tokenizer of ``tokenizer_of`` ("" = the model folder's own)."""
        if self.tokenizer or not self._decl.tokenizer_of:
            return self.tokenizer
        return self._roles[self._decl.tokenizer_of].tokenizer_path()


@dataclass(frozen=True)
class FrozenRole(RoleConfig):
    """A frozen role: no optimizer, no gradients, eval mode; at ZeRO-3 it may gather whole per forward."""

    gather_forward: bool = setting(False, "ZeRO-3: gather all its weights once per forward (one collective; for small "
                                          "models called once per step)")

    def spec(self, model: Callable[[], Any], *, seed: int = 0, name: str | None = None, stage: int | None = None,
             stateful: bool = False, lora: Any = None) -> Any:
        """The RoleSpec the registry builds: ``model()`` under this role's placement (``stage`` for a role whose stage
        the recipe sets); ``stateful``/``lora``: an EMA of a (LoRA) trained role."""
        from multiengine.engines import frozen_role

        return frozen_role(name or self.name, model, self.placement(stage), stateful=stateful, lora=lora, seed=seed)


@dataclass(frozen=True)
class TrainableRole(RoleConfig):
    """A trainable role: a role's keys, its optimizer, batches, LoRA and gradient checkpointing."""

    offload_optimizer: bool = setting(False, "optimizer state offload to CPU")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward: less memory, more time")
    lr: float = setting(1e-5, "peak learning rate", OPTIMIZER_CHECKS["lr"])
    weight_decay: float = setting(0.0, "AdamW weight decay", OPTIMIZER_CHECKS["weight_decay"])
    betas: list[float] = setting([0.9, 0.999], "Adam betas [beta1, beta2]", OPTIMIZER_CHECKS["betas"])
    scheduler: str = setting("constant", "a transformers scheduler name (constant, constant_with_warmup, linear, "
                                         "cosine, ...)", OPTIMIZER_CHECKS["scheduler"])
    warmup_steps: int = setting(0, "linear warm-up steps", OPTIMIZER_CHECKS["warmup_steps"])
    max_grad_norm: float = setting(1.0, "gradient clipping (0 = none)", OPTIMIZER_CHECKS["max_grad_norm"])
    micro_batch_size: int = setting(8, "rows per rank per forward/backward", Range(1))
    grad_accum: int = setting(1, "micro batches per optimizer step", Range(1))
    token_budget: int = setting(0, "RL updates: tokens per rank per forward/backward, the step's rows spread over "
                                   "balanced micro-batches; 0 = micro_batch_size rows", Range(0))
    router_aux_loss_coef: float = setting(-1.0, "MoE policies: the router's load-balancing loss in the trained loss, "
                                                "this times it; -1 = the model config's router_aux_loss_coef, 0 = off",
                                          Range(-1))
    lora: LoraSettings = section(LoraSettings, "LoRA adapters instead of full fine-tuning (lora.r > 0)")

    @property
    def trainable(self) -> bool:
        return True

    def lora_spec(self, default_targets: Sequence[str] = DECODER_LORA_TARGETS, init: bool | str = True) -> Any:
        """The engines' LoraSpec, or None for ``lora.r: 0`` (``alpha: 0`` = r); empty ``target_modules`` take
        ``default_targets`` (the diffusion family's)."""
        from multiengine.engines import LoraSpec

        s = self.lora
        if not s.r:
            return None
        return LoraSpec(rank=s.r, alpha=s.alpha or None, dropout=s.dropout,
                        target_modules=tuple(s.target_modules) or tuple(default_targets) or DECODER_LORA_TARGETS,
                        init=init)

    def optim(self, total_steps: int, eps: float = 1e-8) -> Any:
        """The engines' OptimSpec: this role's optimizer and schedule over ``total_steps`` optimizer steps."""
        from multiengine.engines import OptimSpec

        return OptimSpec(lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas), eps=eps,
                         scheduler=self.scheduler, warmup_steps=self.warmup_steps, total_steps=total_steps,
                         max_grad_norm=self.max_grad_norm)

    def spec(self, model: Callable[[], Any], *, seed: int = 0, name: str | None = None, total_steps: int = 0,
             rows: int = 1, accum: int = 1, lora_targets: Sequence[str] = DECODER_LORA_TARGETS,
             lora_init: bool | str = True, eps: float = 1e-8) -> Any:
        """The RoleSpec the registry builds: ``model()`` under this role's placement, its optimizer over
        ``total_steps``, ``rows`` x micro_batch_size rows per forward (a DPO pair is 2 rows), ``accum`` x grad_accum
        backward passes per step, LoRA (``lora_targets``/``lora_init``: the family's) and gradient checkpointing."""
        from multiengine.engines import trainable_role

        spec = trainable_role(name or self.name, model, self.placement(), self.optim(total_steps, eps),
                              micro_batch_size=rows * self.micro_batch_size, grad_accum=accum * self.grad_accum,
                              lora=self.lora_spec(lora_targets, lora_init),
                              gradient_checkpointing=self.gradient_checkpointing, seed=seed)
        spec.token_budget = self.token_budget
        return spec


_VLLM = "generation.engine=vllm"


@dataclass(frozen=True)
class RolloutRole(Settings):
    """An inference engine generating the actor's rollouts, its weights synced from the actor after each step: vLLM on
    every rank (docs/vllm.md; its keys apply with generation.engine=vllm), or either engine on ranks of its own
    (``ranks``, docs/async.md)."""

    dtype: str = setting("", "fp32 | bf16 | fp16; \"\" = the actor's dtype", Choice(*DTYPES, ""), when=_VLLM)
    kv_cache_gb: float = setting(1.0, "KV cache per rank, GiB (GPU: 0 = what gpu_memory_utilization leaves)",
                                 Range(0), when=_VLLM)
    max_model_len: int = setting(0, "longest prompt + answer the engine holds; 0 = data.max_prompt_len + "
                                    "generation.max_new_tokens (multi-turn: grpo.max_total_tokens)", Range(0),
                                 when=_VLLM)
    tensor_parallel_size: int = setting(1, "GPUs per engine (consecutive ranks; GPU only)", Range(1), when=_VLLM)
    gpu_memory_utilization: float = setting(0.3, "GPU: share of the device for the engine's weights + KV cache",
                                            Range(0, 1, min_exclusive=True), when=_VLLM)
    sleep: bool = setting(False, "GPU: free the engine's memory between rollouts (vLLM sleep mode)", when=_VLLM)
    ranks: list[int] = setting([], "the ranks that only generate (the job's last ranks, e.g. [1] of 2, [6, 7] of 8; "
                                   "each holds a whole copy of the actor: transformers, or vLLM with "
                                   "generation.engine=vllm); [] = the rollouts are generated on every rank, in turn "
                                   "with training (docs/async.md)", Each(Range(0)))

    def _bind(self, decl: Role, roles: Roles) -> None:
        object.__setattr__(self, "_decl", decl)
        object.__setattr__(self, "_roles", roles)

    @property
    def trainable(self) -> bool:
        return False

    def engine_settings(self, seq_len: int, seed: int) -> Any:
        """The engines' VLLMSettings (``seq_len``: max_model_len when the key is 0)."""
        from multiengine.engines.vllm_rollout import VLLMSettings

        dtype = self.dtype or self._roles[self._decl.follows].effective_dtype
        return VLLMSettings(DTYPES[dtype],
                            self.max_model_len or seq_len, self.kv_cache_gb, self.gpu_memory_utilization,
                            self.tensor_parallel_size, self.sleep, seed)


@dataclass(frozen=True)
class Role:
    """One role of a recipe, declared once.

    ``follows``: the role whose stage and dtype ``stage: -1`` and ``dtype: ""`` take. ``weights``: the role whose model
    folder an empty ``model`` takes (a ref starts from the actor). ``tokenizer_of``: the role whose tokenizer an empty
    ``tokenizer`` takes. ``defaults``: the differences from the shared role defaults (a :class:`Key` also changes
    the help). ``omit``: keys this recipe cannot honour for the role, refused with ``why``.
    """

    name: str
    help: str
    trainable: bool = False
    follows: str = ""
    weights: str = ""
    tokenizer_of: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    omit: tuple[str, ...] = ()
    why: str = ""
    rollout: bool = False  # an inference engine generating for the role it follows (RolloutRole's keys)
    sequences: bool = False  # a language model: its passes run over token sequences (the packing keys)
    routed: bool = False  # a policy whose loss takes an MoE router's auxiliary loss (router_aux_loss_coef)

    @staticmethod
    def section(roles: Sequence[Role]) -> Node:
        """The ``roles`` section of a recipe's schema from its declaration (:func:`roles_node`)."""
        return roles_node(roles)


_FROZEN_NOTE = ("roles.{name} is frozen: it has no {key} (only trainable roles have an optimizer, batches, LoRA and "
                "gradient checkpointing)")


_SEQUENCE_KEYS = ("packing", "token_budget")


def _role_node(role: Role) -> Node:
    if role.rollout:
        return settings_node(RolloutRole, role.help, dict(role.defaults))
    cls = TrainableRole if role.trainable else FrozenRole
    defaults = dict(role.defaults)
    if role.follows:
        defaults.setdefault("stage", Key(-1, f"ZeRO stage 0-3; -1 = the stage of roles.{role.follows}"))
        defaults.setdefault("dtype", Key("", f"fp32 | bf16 | fp16 (GPU only); \"\" = the dtype of "
                                             f"roles.{role.follows}"))
    if role.weights:
        defaults.setdefault("model", Key("", f"a model folder or hub name; \"\" = roles.{role.weights}'s model"))
    if role.tokenizer_of:
        defaults.setdefault("tokenizer", Key("", f"a tokenizer folder; \"\" = roles.{role.tokenizer_of}'s tokenizer"))
    refused = {k: role.why or f"recipe cannot honour roles.{role.name}.{k}" for k in role.omit if "." not in k}
    if not role.sequences:  # packing is for token sequences: refused for images, points, ...
        refused.update({k: f"roles.{role.name} runs no token-sequence passes" for k in _SEQUENCE_KEYS})
        role = dataclasses.replace(role, omit=(*role.omit, *_SEQUENCE_KEYS))
    if role.trainable and not role.routed:
        refused["router_aux_loss_coef"] = (f"roles.{role.name}'s loss takes no router auxiliary loss (the policy "
                                           "losses do: SFT, DPO, the RL actor, distillation's student)")
        role = dataclasses.replace(role, omit=(*role.omit, "router_aux_loss_coef"))
    if not role.trainable:
        refused.update({f.name: _FROZEN_NOTE.format(name=role.name, key=f.name)
                        for f in dataclasses.fields(TrainableRole) if f.init and f.name not in _FROZEN_FIELDS})
    node = settings_node(cls, role.help, {k: v for k, v in defaults.items() if k not in role.omit}, role.omit, refused)
    # a role that follows none cannot ask for -1 / "": its checks say so (Roles checks it again for Python callers)
    if "stage" in node.children and not role.follows:
        node.children["stage"] = node.children["stage"]._replace(checks=(Range(0, 3),))
    if "dtype" in node.children and not role.follows:
        node.children["dtype"] = node.children["dtype"]._replace(checks=(Choice(*DTYPES),))
    fixed = {k: v.default if isinstance(v, Key) else v for k, v in defaults.items() if k in role.omit}
    build = node.build
    node.build = lambda kw: build({**kw, **fixed})  # an omitted key keeps the declaration's (or the class's) value
    return node


_FROZEN_FIELDS = {f.name for f in dataclasses.fields(FrozenRole)}


def _model_type(path: str) -> str:
    """The ``model_type`` of a model folder's config.json; "opt" for "" (the built-in tiny model); "" when unknown
    here (a hub name: the build checks it)."""
    config = _model_config(path)
    return "" if config is None else str(config.get("model_type", ""))


def _model_config(path: str) -> dict[str, Any] | None:
    """A model folder's config.json as a dict; the built-in tiny OPT's keys for "" (dense); None when unknown here."""
    import json
    import os

    if not path:
        return {"model_type": "opt"}
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def roles_node(roles: Sequence[Role]) -> Node:
    """The ``roles`` section of a recipe's schema, from its declaration."""
    children = {role.name: _role_node(role) for role in roles}
    return Node("each role's model, placement (ZeRO stage, dtype, offload) and, if trainable, optimizer, batches and "
                "LoRA; the same keys in every recipe", children, lambda kw: Roles(roles, kw))


class Roles:
    """The ``roles`` section: one typed role config per declared role (``cfg.roles.actor``, ``cfg.roles["ref"]``),
    checked across roles when made (follow only where declared, no optimizer offload on a frozen role, parameter
    offload only at ZeRO-3)."""

    def __init__(self, declaration: Sequence[Role], configs: Mapping[str, RoleConfig]) -> None:
        self._decl = {r.name: r for r in declaration}
        self._configs = dict(configs)
        for name, config in self._configs.items():
            config._bind(self._decl[name], self)
        for name, config in self._configs.items():
            if not self._decl[name].rollout:
                self._check(config)

    def _check(self, role: RoleConfig) -> None:
        key, decl = f"roles.{role.name}", role._decl
        if not decl.follows and role.stage == -1:
            raise config_problem(f"{key}.stage", -1, "follows no other role", f"set {key}.stage to 0, 1, 2 or 3")
        if not decl.follows and role.dtype == "":
            raise config_problem(f"{key}.dtype", "", "follows no other role", f"set {key}.dtype to fp32, bf16 or fp16")
        stage = role.effective_stage
        if role.offload_params and stage != 3 and "stage" not in decl.omit:
            raise config_problem(f"{key}.offload_params", True, f"needs ZeRO-3 (roles.{role.name} runs at stage "
                                 f"{stage}): only ZeRO-3 partitions parameters",
                                 f"set {key}.stage=3, or {key}.offload_params=false")

    def check_packing(self) -> None:
        """Refuse ``packing: packed`` for a role whose model family cannot pack (its folder's ``model_type``; an empty
        model is the built-in tiny OPT), naming the key and the family, before any rank starts."""
        from multiengine.engines.packing import PACKABLE_FAMILIES

        for name, role in self._configs.items():
            if getattr(role, "packing", "") != "packed" or not role._decl.sequences:
                continue
            family, where = _model_type(role.model_path()), role.model_path() or "the built-in tiny model"
            if family and family not in PACKABLE_FAMILIES:
                packable = ", ".join(sorted(PACKABLE_FAMILIES))
                raise config_problem(f"roles.{name}.packing", "packed", f"asks to pack the {family} model ({where}): "
                                     f"that family's attention is not confined to packed sequences by position ids "
                                     f"(these pack: {packable})",
                                     f"set roles.{name}.packing=auto (packed where the family packs) or padded")

    def check_moe(self) -> None:
        """Refuse ``router_aux_loss_coef`` other than -1 (the model's) or >= 0, or set on a dense model, naming the
        key, before any rank starts."""
        from multiengine.engines.moe import moe_shape

        for name, role in self._configs.items():
            coef = getattr(role, "router_aux_loss_coef", -1.0)
            if coef == -1.0 or not role._decl.routed:
                continue
            key = f"roles.{name}.router_aux_loss_coef"
            if coef < 0:
                raise config_problem(key, coef, "is neither -1 (the model config's coefficient) nor >= 0",
                                     f"set {key}=-1, 0 (off) or a coefficient > 0")
            config = _model_config(role.model_path())
            if config is not None and moe_shape(config) is None:
                where = role.model_path() or "the built-in tiny model"
                raise config_problem(key, coef, f"applies to mixtures of experts; {where} is dense (no routers)",
                                     f"leave {key} unset (-1)")

    def __getattr__(self, name: str) -> Any:
        configs = self.__dict__.get("_configs", {})
        if name in configs:
            return configs[name]
        raise AttributeError(f"no role '{name}' (roles: {', '.join(configs)})")

    def __getitem__(self, name: str) -> Any:
        return self._configs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._configs

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def items(self) -> Any:
        return self._configs.items()

    def declaration(self, name: str) -> Role:
        return self._decl[name]

    def trainable(self) -> list[str]:
        return [n for n, r in self._configs.items() if r.trainable]

    def to_dict(self) -> dict[str, Any]:
        return {name: config.to_dict() for name, config in self._configs.items()}

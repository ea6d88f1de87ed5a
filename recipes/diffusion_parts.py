"""What the diffusion recipes share, as functions: the component roles and their defaults, the checks of a model
folder's family against the keys, and the plans. A function given ``recipe`` calls its ``check_family`` and
``role_specs``, which every diffusion recipe defines."""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Mapping
from typing import Any

from multiengine.engines import planner as P
from multiengine.pipelines.checks import check_rows_per_rank
from multiengine.pipelines.diffusion import planning as D
from multiengine.pipelines.diffusion.families import family_roles
from multiengine.pipelines.diffusion.inputs import check_config_folder, check_resolution, model_folder_family
from multiengine.pipelines.diffusion.models import SEED_BASELINE
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, config_problem, defaults_of, flatten, recipe_schema
from multiengine.recipes.language.roles import Role

# What a trained denoiser (or controlnet) changes from the shared role defaults: the tiny run's optimisation,
# diffusers' AdamW weight decay, LoRA targets from the family.
TRAINED: dict[str, Any] = {
    "dtype": "fp32", "lr": 1e-3, "weight_decay": 1e-2, "scheduler": "constant_with_warmup", "warmup_steps": 5,
    "micro_batch_size": Key(8, "images per rank per forward (global batch = micro x grad_accum x ranks)"),
}
# Frozen components: fp32 on CPU, gathered whole once per call (one collective; 1/N between calls).
FROZEN: dict[str, Any] = {"dtype": "fp32", "gather_forward": True}
COMPONENT_WHY = ("a component comes from its folder of model.pretrained (a diffusers pipeline): it has no model or "
                 "tokenizer of its own")
PLACEMENT = ("stage", "offload_params", "gather_forward")  # what seed_baseline decides for a frozen role
SEED_BASELINE_NOTE = "seed_baseline: full copy"


def renamed(trained: str, hint: str = "") -> dict[str, str]:
    """The old keys of the image fine-tunes (train.*, lora.*, flow.*) -> their new names; ``hint`` follows a role
    key's new name."""
    new = f"roles.{trained}"
    out = {f"train.{k}": f"{new}.{k}{hint}" for k in ("micro_batch_size", "grad_accum", "lr", "max_grad_norm",
                                                       "gradient_checkpointing")}
    out.update({"train.lr_scheduler": f"{new}.scheduler{hint}", "train.lr_warmup_steps": f"{new}.warmup_steps{hint}",
                "train.adam_weight_decay": f"{new}.weight_decay{hint}",
                "train.adam_beta1": f"{new}.betas (a list [beta1, beta2]){hint}",
                "train.adam_beta2": f"{new}.betas (a list [beta1, beta2]){hint}",
                "train.adam_epsilon": "diffusion.adam_epsilon", "train.*": "diffusion.*", "flow.*": "diffusion.*",
                "lora.enabled": f"{new}.lora.r (to the adapter rank, e.g. 4; 0 = no LoRA){hint}",
                "lora.rank": f"{new}.lora.r{hint}", "lora.*": f"{new}.lora.*",
                "model.tiny_text_encoders": "model.tiny_family (sdxl: two text encoders)"})
    return out


def component(name: str, help: str, **declaration: Any) -> Role:
    """A role whose weights are the folder ``name`` of model.pretrained: no model or tokenizer key."""
    return Role(name, help, omit=("model", "tokenizer"), why=COMPONENT_WHY, **declaration)


def components(*encoders: str, vae: str = "frozen: latents of the training images, validation decodes"
               ) -> tuple[Role, ...]:
    """The frozen vae and text encoders; ``encoders``: the help of text_encoder_2, text_encoder_3, ... (each placed
    like text_encoder unless it says otherwise)."""
    return (component("vae", vae, defaults=FROZEN),
            component("text_encoder", "frozen: the first text encoder (CLIP-L)", defaults=FROZEN),
            *(component(f"text_encoder_{i}", text, follows="text_encoder", defaults={"gather_forward": True})
              for i, text in enumerate(encoders, start=2)))


def changed(recipe: Any, cfg: Any, role: str) -> dict[str, Any]:
    """The keys of ``roles.<role>`` set to other than the recipe's defaults."""
    default = flatten(defaults_of(recipe_schema(recipe))["roles"][role])
    return {k: v for k, v in flatten(cfg.roles[role]).items() if k in default and v != default[k]}


def unset(section: Any, names: tuple[str, ...], prefix: str, why: str) -> dict[str, tuple[Any, str]]:
    """{key: (value, why)} of the fields of ``section`` among ``names`` set to other than their defaults."""
    fields = type(section).__dataclass_fields__
    return {f"{prefix}.{n}": (getattr(section, n), why) for n in names
            if getattr(section, n) != (fields[n].default_factory() if callable(fields[n].default_factory)
                                       else fields[n].default)}


def refuse(unused: Mapping[str, tuple[Any, str]], where: str = "") -> None:
    """The first of ``unused`` ({key: (value, why)}, :func:`unset`) as the config error."""
    for key, (value, why) in unused.items():
        raise config_problem(key, value, f"{why}{where}", f"drop {key}")


IMAGE_HEADLINE = (("loss", "held-out diffusion loss", False), ("loss_ema", "held-out diffusion loss of the EMA", False))
IMAGE_PANELS = [("diffusion loss", ["train/loss", "eval/loss", "eval/loss_ema"])]


def family_of(cfg: Any, key: str = "data.resolution") -> str:
    """The family of model.pretrained (checked; its image side ``key`` too), the tiny model's without one, "" for a
    hub name (known once downloaded)."""
    m = cfg.model
    if m.pretrained and m.revision and os.path.isdir(os.path.expanduser(m.pretrained)):
        raise config_problem("model.revision", m.revision, "applies to a hub name, and model.pretrained is a "
                             "local folder", "drop model.revision")
    family = model_folder_family(m.pretrained, m.tiny_family)
    if family:
        check_resolution(int(operator.attrgetter(key)(cfg)), family, m.pretrained, key)
    return family


def absent_roles(cfg: Any, family: str) -> dict[str, tuple[str, str]]:
    """{declared text encoder or denoiser that ``family`` has not: (why, fix)}; the fix may name ``{key}``."""
    fr = family_roles(family)
    out = {n: (f"this {family} model has no {n}", "drop roles.{role}.{key}") for n in cfg.roles
           if n.startswith("text_encoder") and n not in fr.text_encoders}
    other = "transformer" if fr.denoiser == "unet" else "unet"
    if other in cfg.roles and cfg.roles.declaration(other).trainable:
        out[other] = (f"this {family} model has no {other}: its denoiser is roles.{fr.denoiser}",
                      f"set roles.{fr.denoiser}.{{key}} instead")
    return out


def check_family(recipe: Any, cfg: Any, absent: Mapping[str, tuple[str, str]],
                 unused: Mapping[str, tuple[Any, str]], where: str = "") -> None:
    """The keys of a role the run does not build (``absent``: {role: (why, fix)}) and the options set that the
    family has no use for (``unused``: :func:`unset`) are refused. (LoRA options without LoRA are refused by the
    roles' own `when`.)"""
    where = f" ({where})" if where else ""
    for name, (why, fix) in absent.items():
        for key, value in changed(recipe, cfg, name).items():
            raise config_problem(f"roles.{name}.{key}", value, f"is set, but {why}{where}",
                                 fix.format(role=name, key=key))
    refuse(unused, where)


def describe(recipe: Any, cfg: Any, key: str = "data.resolution") -> dict[str, Any]:
    """Recipe.describe of a diffusion recipe: the roles its :meth:`role_specs` builds on the family's folder."""
    out = {k: v for k, v in cfg.to_dict().items() if k != "roles"}
    family = family_of(cfg, key) or cfg.model.tiny_family
    folder = cfg.model.pretrained or os.path.join(cfg.output_dir, f"tiny_{family}")
    out["roles"] = {}
    for spec in recipe.role_specs(cfg, family, folder):
        role = cfg.roles[spec.name]
        out["roles"][spec.name] = {**spec.describe(), "model": role.model_path()}
        if cfg.roles.declaration(spec.name).follows:  # its own stage and dtype stay when the leader's change
            out["roles"][spec.name]["follows"] = {"stage": role.stage, "dtype": role.dtype}
    return out


def denoiser_of(recipe: Any, cfg: Any, family: str) -> str:
    """The family's denoiser; for a hub name (family "") the one the config sets, else the unet."""
    if family:
        return family_roles(family).denoiser
    return "transformer" if "transformer" in cfg.roles and changed(recipe, cfg, "transformer") else "unet"


def check_image_run(recipe: Any, cfg: Any, world_size: int, family: str, trained_role: str = "") -> None:
    """The keys against the folder's ``family``, seed_baseline, export.roles, the data and a micro batch per rank on
    ``world_size`` ranks; ``trained_role``: "" = the denoiser."""
    if family:
        recipe.check_family(cfg, family)
    trained = trained_role or denoiser_of(recipe, cfg, family)
    if cfg.mode == SEED_BASELINE:
        fr = family_roles(family) if family else None
        frozen = [n for n in cfg.roles if not cfg.roles.declaration(n).trainable and n != "ema"] if not fr else \
            ["vae", *fr.text_encoders] if not trained_role else [fr.denoiser, "vae", *fr.text_encoders]
        for name in frozen:
            for key in set(changed(recipe, cfg, name)) & set(PLACEMENT):
                raise config_problem(f"roles.{name}.{key}", getattr(cfg.roles[name], key), "is set, but mode="
                                     "seed_baseline builds every frozen role whole at stage 0 (diffusers' layout)",
                                     f"drop roles.{name}.{key}, or set mode=zero3")
    built = {s.name for s in recipe.role_specs(cfg, family, "")} if family else set(cfg.roles)
    extra = [r for r in cfg.export.roles if r not in built]
    if extra:
        raise config_problem("export.roles", list(cfg.export.roles), f"names {extra}, not among the roles this "
                             f"run builds {sorted(built)}", "name built roles only")
    d, micro = cfg.data, cfg.roles[trained].micro_batch_size
    d.check_rows(cfg.eval.heldout_size)
    train, held = d.training_rows(cfg.eval.heldout_size, cfg.seed)
    if d.max_train_samples and train == d.max_train_samples and train // world_size < micro:
        raise config_problem("data.max_train_samples", train, f"gives {train // world_size} training images per "
                             f"rank on {world_size} ranks, fewer than roles.{trained}.micro_batch_size={micro}",
                             f"set data.max_train_samples to {micro * world_size} or more (0 = all rows)")
    check_rows_per_rank(train, world_size, key=f"roles.{trained}.micro_batch_size", value=micro, unit="images",
                        heldout=held, heldout_key=d.split_key())


def image_plan(cfg: Any, assume: Any, title: str, trained: str | None = None, ema: bool = False
               ) -> list[plans.RecipePlan]:
    """The trained role, the frozen denoiser it feeds (controlnet), vae, text encoders (whole at stage 0 in
    seed_baseline mode) and the trained role's EMA where ``ema``; ``trained``: None = the denoiser."""
    components_, source = plans.resolve_pipeline(
        cfg.model.pretrained, variant=cfg.model.variant or None, assume=assume,
        tiny=lambda: D.tiny_pipeline(cfg.output_dir, cfg.seed, cfg.data.resolution, cfg.model.tiny_family))
    denoiser = D.denoiser_name(components_, title, source, controlnet=trained is not None)
    trained = trained or denoiser
    r, t = cfg.roles, cfg.roles[trained]
    baseline = cfg.mode == SEED_BASELINE
    res, batch = cfg.data.resolution, t.micro_batch_size
    vae, net = components_["vae"], components_[denoiser]
    scale = D.vae_scale(vae)
    lora = plans.lora_choice(t.lora, family_roles(D.pipeline_family(components_)).lora_targets)
    encoders = D.encoder_names(components_)
    infos = {denoiser: net, "vae": vae, **{n: components_[n] for n in encoders}}
    if trained != denoiser:
        infos[trained] = P.model_info(t.model, cfg.model.variant or None) if os.path.isdir(t.model) \
            else D.meta_controlnet(net, scale)
    tokens, text = D.text_tokens(components_, getattr(cfg.diffusion, "max_sequence_length", 0))
    v = cfg.validation
    prompts = (len(v.prompts) or v.num_prompts) if v.enabled else 0

    def denoiser_phases(dtype: str, trainable: bool, checkpointing: bool) -> list[tuple[str, int]]:
        act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=scale, dtype=dtype,
                                text_tokens=text)
        train = act(batch=batch, trainable=trainable, checkpointing=checkpointing)
        val = act(batch=2 * prompts, trainable=False, checkpointing=False) if prompts else 0
        return [("train step", train)] + ([("validation", val)] if val else [])

    vae_act = functools.partial(D.vae_activation_bytes, vae, resolution=res, dtype=r.vae.effective_dtype)
    phases = {trained: denoiser_phases(t.effective_dtype, True, t.gradient_checkpointing),
              "vae": [("encode", vae_act(batch=batch))]
              + ([("validation decode", vae_act(batch=prompts))] if prompts else []),
              **encode_phases(cfg, components_, batch, tokens)}
    options: dict[str, Any] = {"vae": plans.gather_options(r.vae, "encode", "validation decode"),
                               **{n: plans.gather_options(r[n], "encode") for n in encoders}}
    options[trained] = {"lora": lora}
    if lora:
        options[trained]["note"] = "LoRA: activations estimated as for a full fine-tune (an upper bound)"
    if trained != denoiser:  # the frozen denoiser the trained role feeds (ControlNet); its backward runs too
        phases[denoiser] = denoiser_phases(r[denoiser].effective_dtype, True, False)
        options[denoiser] = {"note": "frozen; activations kept for the trained role's backward"}
    pinned = {n: P.Choice(0) for n in infos if n != trained} if baseline else {}
    for n in pinned:
        options.setdefault(n, {})["note"] = SEED_BASELINE_NOTE
    notes = [f"model: {source}", f"{res}x{res} px (latents {res // scale}x{res // scale}), micro batch {batch}"
             + (", gradient checkpointing" if t.gradient_checkpointing else "")]
    plan = plans.declared_roles(cfg, infos, phases, title=title, notes=notes, pinned=pinned, followers=True,
                                **options)
    if ema:  # the trained role's weights (and adapters), sharded like it
        e = cfg.roles.ema
        plan.roles.append(plans.role_plan(
            "ema", infos[trained], e.effective_dtype, trainable=False, lora=lora,
            current=plans.current_choice(0 if baseline else t.effective_stage, False, e.offload_params),
            choices=(P.Choice(0),) if baseline else (), follows=None if baseline else trained,
            note=SEED_BASELINE_NOTE if baseline else f"sharded like the {trained} (same stage)"))
        if not baseline:
            plan.keys["ema"] = plans.RoleKeys(None, "roles.ema.offload_params")
    return [plan]


def encode_phases(cfg: Any, components_: Mapping[str, P.ModelInfo], rows: int,
                  tokens: Mapping[str, int]) -> dict[str, list[tuple[str, int]]]:
    """Each text encoder's forward ("encode") over ``rows`` prompts of its ``tokens``."""
    return {n: plans.lm_role_phases(cfg.roles[n], components_[n], forward=(rows, tokens[n]), logits=False,
                                    label="encode") for n in D.encoder_names(components_)}


# --- diffusion_grpo and diffusion_dpo -------------------------------------------------------------------------------
POLICY: dict[str, Any] = {
    "dtype": "fp32", "stage": 2, "lr": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0,
    "model": Key("", "a folder holding the denoiser (config.json + weights, e.g. an export's unet/); \"\" = the "
                     "unet/ or transformer/ of model.pretrained"),
    "micro_batch_size": Key(16, "images per rank per rollout (prompts x diffusion.group_size)"),
    "grad_accum": Key(1, "rollouts per optimizer step (each trains on its sampled steps; the engine accumulates "
                         "grad_accum x the trained steps)"),
}
DENOISER_WHY = "the denoiser's tokenizers are model.pretrained's"


def rl_roles(policy: Mapping[str, Any], ref: str, *extra: Role, vae: str) -> tuple[Role, ...]:
    """policy (trained), ref (frozen; a separate copy of the policy's starting weights, ZeRO-3 whatever the policy's
    stage, its dtype the policy's), ``extra`` roles, the vae and the text encoders."""
    stage = Key(3, "ZeRO stage 0-3 (a frozen role asked for stage 1 or 2 is built at 0: nothing to partition but "
                   "its weights)")
    return (Role("policy", "the denoiser trained (SD/SDXL unet, SD3/FLUX transformer)", trainable=True,
                 defaults=policy, omit=("tokenizer",), why=DENOISER_WHY),
            Role("ref", ref, follows="policy", weights="policy", defaults={"stage": stage, "gather_forward": True},
                 omit=("tokenizer",), why=DENOISER_WHY),
            *extra, *components("frozen: SDXL's and SD3's CLIP-G, FLUX's T5", "frozen: SD3's T5", vae=vae))

def check_rl_model(recipe: Any, cfg: Any, key: str = "data.resolution") -> str:
    """The policy and ref folders, the pipeline folder's family and image side ``key``, and the family's keys;
    before any rank starts."""
    for name in ("policy", "ref"):
        check_config_folder(f"roles.{name}.model", cfg.roles[name].model, "a denoiser folder",
                            f"give a unet/ or transformer/ folder, or set roles.{name}.model=\"\"")
    family = family_of(cfg, key)
    if family:
        recipe.check_family(cfg, family)
    return family


def rl_plan(cfg: Any, assume: Any, title: str, rows: int, note: str, *, res: int, ref: bool = True, **setup: Any
            ) -> list[plans.RecipePlan]:
    """The roles of a diffusion RL recipe for the planner (the ``ref`` role where ``ref``): ``rows`` per forward at
    ``res`` px, doubled by CFG where ``setup["guidance_scale"]`` > 1 (not FLUX); ``setup``: ``extra``,
    ``guidance_scale``, ``t5_tokens``."""
    components_, source = plans.resolve_pipeline(
        cfg.model.pretrained, variant=cfg.model.variant or None, assume=assume,
        tiny=lambda: D.tiny_pipeline_info(cfg.seed, res, cfg.model.tiny_family))
    denoiser = D.denoiser_name(components_, title, source)
    net, vae = components_[denoiser], components_["vae"]
    tokens, text = D.text_tokens(components_, setup.get("t5_tokens", 0))
    encoders = D.encoder_names(components_)
    if setup.get("guidance_scale", 1.0) > 1 and D.pipeline_family(components_) != "flux":
        rows, note = 2 * rows, note + ", CFG doubles each denoiser batch"
    infos = {"policy": net, **({"ref": net} if ref else {}), "vae": vae, **{n: components_[n] for n in encoders},
             **setup.get("extra", {})}
    r = cfg.roles
    pol = r.policy
    act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=D.vae_scale(vae),
                            batch=rows, checkpointing=pol.gradient_checkpointing, text_tokens=text)
    vae_act = D.vae_activation_bytes(vae, batch=rows, resolution=res, dtype=r.vae.effective_dtype)
    # the text encoders see at most one prompt per denoiser row (an upper bound: prompts repeat across a group)
    phases = {"policy": [("rollout", act(dtype=pol.effective_dtype, trainable=False)),
                         ("train step", act(dtype=pol.effective_dtype, trainable=True))],
              "ref": [("forward", act(dtype=r.ref.effective_dtype, trainable=False))],
              "vae": [("decode / encode", vae_act)], **encode_phases(cfg, components_, rows, tokens)}
    targets = family_roles(D.pipeline_family(components_)).lora_targets
    options = {"policy": {"lora": plans.lora_choice(pol.lora, targets)},
               "vae": plans.gather_options(r.vae, "decode / encode"),
               **({"ref": plans.gather_options(r.ref, "forward")} if ref else {}),
               **{n: plans.gather_options(r[n], "encode") for n in encoders}}
    return [plans.declared_roles(cfg, infos, phases, title=title, notes=[
        f"model: {source}", f"{res}x{res} px, policy micro batch {pol.micro_batch_size}", note], **options)]

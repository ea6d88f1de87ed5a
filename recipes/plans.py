"""What each recipe's config builds, as the memory planner sees it: one function per recipe (the glue they
share, model resolution and --write, is engines/recipe_plans.py).

Each function reads its recipe's config and returns the roles it would build (model, dtype, trainable or
frozen, LoRA, the batch and sequence/image sizes of each use), the placement the config asks for and the
config keys each placement lives under (for ``multiengine plan --write``). Models are resolved without
loading weights (:func:`resolve_model`): a local folder's safetensors headers, the local Hugging Face
cache, the planner's built-in architectures, or the shipped config that exports the folder a config
points at. ``assume`` (``--assume role=model``) says what a folder that does not exist yet will hold.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from multiengine.engines import planner as P
from multiengine.engines.recipe_config import CONFIGS_DIR, load_config
from multiengine.engines.recipe_plans import (  # noqa: F401 - recipe_plans: the tests' name
    RecipePlan,
    RoleKeys,
    _current,
    _keys,
    _lm_phases,
    _lora,
    _role,
    _scalar,
    declared_roles,
    gather_options,
    lm_role_phases,
    module_info,
    recipe_plans,
    resolve_model,
    resolve_pipeline,
)
from multiengine.engines.role_schema import follow_chain, model_path
from multiengine.pipelines.diffusion import planning as D


def registry_demo(cfg: Any, assume: Mapping[str, str] | None = None,
                  configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .registry_demo import ROLES, tiny_opt_config

    folder = os.path.join(str(cfg.output_dir), "tiny_lm")
    if (assume and "actor" in assume) or os.path.isfile(os.path.join(folder, "config.json")):
        info = resolve_model(folder, "actor", assume=assume, configs_dir=configs_dir)
    else:  # the recipe's own tiny OPT, on the meta device
        import torch
        from transformers import OPTForCausalLM

        m = cfg.model
        config = tiny_opt_config(m.hidden_size, m.layers, m.vocab_size)
        with torch.device("meta"):
            tensors = module_info("", OPTForCausalLM(config)).tensors
        info = P.ModelInfo(f"registry_demo's tiny OPT (hidden {m.hidden_size}, {m.layers} layers, vocab "
                           f"{m.vocab_size})", tensors, config=config.to_dict(), class_name="OPTForCausalLM")
    batch, seq = int(cfg.roles.actor.micro_batch_size), int(cfg.seq_len)
    phases = {"actor": lm_role_phases(cfg, ROLES, "actor", info, train=(batch, seq)),
              "reward": lm_role_phases(cfg, ROLES, "reward", info, forward=(batch, seq)),
              "encoder": lm_role_phases(cfg, ROLES, "encoder", info, forward=(batch, seq), logits=False)}
    # the demo's roles are planned without optimizer offload, and its frozen roles without parameter offload
    return [declared_roles(cfg, ROLES, {"actor": info, "reward": info, "encoder": info.without("lm_head.")}, phases,
                           title="registry_demo", actor={"choices": P.trainable_choices(False)},
                           reward={"choices": P.frozen_choices(False)}, encoder={"choices": P.frozen_choices(False)})]


SEED_BASELINE_NOTE = "seed_baseline: full copy"


def _family_lora(section: Any, components: Mapping[str, P.ModelInfo]) -> tuple[int, tuple[str, ...]] | None:
    """A diffusion role's LoRA, empty target_modules filled with diffusers' targets of the model's family as the
    diffusion recipes fill them."""
    from multiengine.pipelines.diffusion.families import family_roles

    return _lora(section.lora, family_roles(D.pipeline_family(components)).lora_targets)


def _encode_phases(cfg: Any, roles: Any, components: Mapping[str, P.ModelInfo], rows: int,
                   tokens: Mapping[str, int]) -> dict[str, list[tuple[str, int]]]:
    """Each text encoder's forward ("encode") over ``rows`` prompts of its ``tokens``."""
    return {n: lm_role_phases(cfg, roles, n, components[n], forward=(rows, tokens[n]), logits=False, label="encode")
            for n in D.encoder_names(components)}


def _diffusion_plan(cfg: Any, assume: Mapping[str, str] | None, title: str, roles: Any,
                    trained: str | None) -> list[RecipePlan]:
    """sd_finetune (``trained`` None: the folder's denoiser) and controlnet (its folder, else one initialised from
    the unet), from the recipe's ``roles``: ``trained`` (the denoiser, or a ControlNet beside a frozen denoiser)
    trainable; the denoiser (when it is not the trained role), vae and text encoders frozen, all of them whole at
    stage 0 in seed_baseline mode; an EMA of the trained role where ``ema.enabled``."""
    components, source = resolve_pipeline(
        str(cfg.model.pretrained), variant=str(cfg.model.variant) or None, assume=assume,
        tiny=lambda: D.tiny_pipeline(str(cfg.output_dir), int(cfg.seed), int(cfg.data.resolution),
                                     str(cfg.model.tiny_family)))
    denoiser = D.denoiser_name(components, title, source, controlnet=trained is not None)
    trained = trained or denoiser
    r, t = cfg.roles, cfg.roles[trained]
    baseline = cfg.mode == "seed_baseline"
    res, batch = int(cfg.data.resolution), int(t.micro_batch_size)
    vae, net = components["vae"], components[denoiser]
    scale = D.vae_scale(vae)
    lora = _family_lora(t, components)
    encoders = D.encoder_names(components)
    infos = {denoiser: net, "vae": vae, **{n: components[n] for n in encoders}}
    if trained != denoiser:
        given = str(t.model)
        infos[trained] = P.model_info(given, str(cfg.model.variant) or None) if os.path.isdir(given) \
            else D.meta_controlnet(net, scale)
    tokens, text = D.text_tokens(components, int(cfg.diffusion.get("max_sequence_length") or 0))
    prompts = (len(cfg.validation.prompts) or int(cfg.validation.num_prompts)) if cfg.validation.enabled else 0

    def denoiser_phases(dtype: str, trainable: bool, checkpointing: bool) -> list[tuple[str, int]]:
        act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=scale, dtype=dtype,
                                text_tokens=text)
        train = act(batch=batch, trainable=trainable, checkpointing=checkpointing)
        val = act(batch=2 * prompts, trainable=False, checkpointing=False) if prompts else 0
        return [("train step", train)] + ([("validation", val)] if val else [])

    vae_act = functools.partial(D.vae_activation_bytes, vae, resolution=res, dtype=str(r.vae.dtype))
    phases = {trained: denoiser_phases(str(t.dtype), True, bool(t.gradient_checkpointing)),
              "vae": [("encode", vae_act(batch=batch))]
              + ([("validation decode", vae_act(batch=prompts))] if prompts else []),
              **_encode_phases(cfg, roles, components, batch, tokens)}
    options = {"vae": gather_options(cfg, "vae", "encode", "validation decode"),
               **{n: gather_options(cfg, n, "encode") for n in encoders}}
    options[trained] = {"lora": lora}
    if lora:
        options[trained]["note"] = "LoRA: activations estimated as for a full fine-tune (an upper bound)"
    if trained != denoiser:  # the frozen denoiser the trained role feeds (ControlNet); its backward runs too
        phases[denoiser] = denoiser_phases(str(r[denoiser].dtype), True, False)
        options[denoiser] = {"note": "frozen; activations kept for the trained role's backward"}
    pinned = {n: P.Choice(0) for n in infos if n != trained} if baseline else {}
    for n in pinned:
        options.setdefault(n, {})["note"] = SEED_BASELINE_NOTE
    notes = [f"model: {source}", f"{res}x{res} px (latents {res // scale}x{res // scale}), micro batch {batch}"
             + (", gradient checkpointing" if t.gradient_checkpointing else "")]
    plan = declared_roles(cfg, roles, infos, phases, title=title, notes=notes, pinned=pinned, followers=True, **options)
    ema = cfg.get("ema") or {}
    if ema.get("enabled"):  # the trained role's weights (and adapters), sharded like it
        plan.roles.append(_role(
            "ema", infos[trained], str(ema.dtype), trainable=False, lora=lora,
            current=_current(0 if baseline else int(t.stage), False, ema.offload_params),
            choices=(P.Choice(0),) if baseline else (), follows=None if baseline else trained,
            note=SEED_BASELINE_NOTE if baseline else f"sharded like the {trained} (same stage)"))
        if not baseline:
            plan.keys["ema"] = RoleKeys(None, "ema.offload_params")
    return [plan]


def sd_finetune(cfg: Any, assume: Mapping[str, str] | None = None,
                configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .sd_finetune import ROLES

    return _diffusion_plan(cfg, assume, "sd_finetune", ROLES, None)


def controlnet(cfg: Any, assume: Mapping[str, str] | None = None,
               configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .controlnet import ROLES

    return _diffusion_plan(cfg, assume, "controlnet", ROLES, "controlnet")


def rlhf_ppo(cfg: Any, assume: Mapping[str, str] | None = None) -> list[RecipePlan]:
    """Actor, critic, a frozen ref, the reward-model roles and an EMA of the actor (ema.enabled)."""
    from . import common

    r, g, d = cfg.roles, cfg.generation, cfg.data
    actor_info = common.lm_info(cfg, r.actor.model, "actor", assume)
    prompt, new, rollout = d.max_prompt_len, g.max_new_tokens, cfg.ppo.rollout_batch_size
    rewards, reward_infos = common.reward_plan(cfg, rollout, assume)
    # the critic's folder as the recipe resolves it: roles.critic.model, else the reward model's (its
    # declaration), else the first reward model, else the actor's with a fresh head (rewards from functions only)
    if r.critic.model or (assume and "critic" in assume):
        critic_info = _scalar(common.lm_info(cfg, r.critic.model, "critic", assume))
    elif reward_infos:
        critic_info = reward_infos.get("reward") or next(iter(reward_infos.values()))
    else:
        critic_info = _scalar(actor_info)
    plan = common.policy_plan("rlhf_ppo", f"generation: {rollout} prompts x ({prompt} + {new}) tokens per rank, mode "
                              f"{g.mode}; updates on {r.actor.micro_batch_size} rows (critic "
                              f"{r.critic.micro_batch_size}) per forward/backward", cfg,
                              {"actor": actor_info, "critic": critic_info}, True, rollout, rollout, rewards)
    if cfg.ema.enabled:  # the actor's weights (and adapters) at the actor's stage
        plan.roles.append(_role("ema", actor_info, r.ema.effective_dtype, trainable=False, lora=_lora(r.actor.lora),
                                current=_current(plan.roles[0].current.stage, False, r.ema.offload_params),
                                follows="actor", note="built at the actor's stage"))
        plan.keys["ema"] = RoleKeys(None, "roles.ema.offload_params")
    return [plan]


def rlhf_grpo(cfg: Any, assume: Mapping[str, str] | None = None) -> list[RecipePlan]:
    """Actor, a frozen ref (none when ``grpo.kl_coef`` is 0) and the reward-model roles; no critic. A rollout is
    ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows per rank, generated and scored in one batch; the
    update runs on ``roles.actor.micro_batch_size`` rows at a time."""
    from . import common

    gr, g, a = cfg.grpo, cfg.generation, cfg.roles.actor
    info = common.lm_info(cfg, a.model, "actor", assume)
    prompt, new = cfg.data.max_prompt_len, g.max_new_tokens
    rows = gr.rollout_batch_size * gr.n_samples_per_prompt
    rows_gen = max(rows, cfg.eval.batch_size if cfg.eval.size else 0)
    note = (f"rollout: {gr.rollout_batch_size} prompts x {gr.n_samples_per_prompt} samples = {rows} rows of "
            f"({prompt} + {new}) tokens per rank, generation mode {g.mode}; updates on {a.micro_batch_size} "
            "rows per forward/backward")
    return [common.policy_plan("rlhf_grpo", note, cfg, {"actor": info}, gr.kl_coef > 0, rows, rows_gen,
                               common.reward_plan(cfg, rows_gen, assume)[0])]


def gan(cfg: Any, assume: Mapping[str, str] | None = None,
        configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    import torch
    from multiengine.pipelines.gan import MLP
    from multiengine.recipes import gan as recipe

    with torch.device("meta"):
        infos = {r.name: module_info(r.name, MLP(**recipe._shape(cfg, r.name))) for r in recipe.ROLES}
    return [declared_roles(cfg, recipe.ROLES, infos, title="gan",
                           notes=["two MLPs of gan.width x gan.depth; activations are negligible"])]


def _diffusion_rl(cfg: Any, recipe: Any, title: str, res: int, assume: Mapping[str, str] | None, rows: int,
                  note: str, extra: Mapping[str, P.ModelInfo] | None = None, ref: bool = True,
                  guidance_scale: float = 1.0, t5_tokens: int = 0) -> list[RecipePlan]:
    """diffusion_grpo / diffusion_dpo: the roles the run builds (the frozen ref where ``ref``, the models of
    ``extra``), from the recipe's declaration; ``rows`` per forward of the policy, ref and vae, doubled by CFG
    where ``guidance_scale`` > 1 (FLUX takes it as an input instead); ``t5_tokens``: T5 tokens per prompt."""
    components, source = resolve_pipeline(
        str(cfg.model.pretrained), variant=str(cfg.model.variant) or None, assume=assume,
        tiny=lambda: D.tiny_pipeline_info(int(cfg.seed), res, str(cfg.model.tiny_family)))
    denoiser = D.denoiser_name(components, title, source)
    net, vae = components[denoiser], components["vae"]
    tokens, text = D.text_tokens(components, t5_tokens)
    encoders = D.encoder_names(components)
    if guidance_scale > 1 and D.pipeline_family(components) != "flux":
        rows, note = 2 * rows, note + ", CFG doubles each denoiser batch"
    infos = {"policy": net, **({"ref": net} if ref else {}), "vae": vae, **{n: components[n] for n in encoders},
             **(extra or {})}
    pol = cfg.roles.policy
    dtype, ref_dtype = str(pol.dtype), str(follow_chain(cfg, recipe.ROLES, "ref", "dtype", ""))
    act = functools.partial(D.denoiser_activation_bytes, net, denoiser, res=res, scale=D.vae_scale(vae), batch=rows,
                            checkpointing=bool(pol.gradient_checkpointing), text_tokens=text)
    vae_act = D.vae_activation_bytes(vae, batch=rows, resolution=res, dtype=str(cfg.roles.vae.dtype))
    # the text encoders see at most one prompt per denoiser row (an upper bound: prompts repeat across a group)
    phases = {"policy": [("rollout", act(dtype=dtype, trainable=False)),
                         ("train step", act(dtype=dtype, trainable=True))],
              "ref": [("forward", act(dtype=ref_dtype, trainable=False))],
              "vae": [("decode / encode", vae_act)], **_encode_phases(cfg, recipe.ROLES, components, rows, tokens)}
    options = {"policy": {"lora": _family_lora(pol, components)}, "vae": gather_options(cfg, "vae", "decode / encode"),
               **({"ref": gather_options(cfg, "ref", "forward")} if ref else {}),
               **{n: gather_options(cfg, n, "encode") for n in encoders}}
    return [declared_roles(cfg, recipe.ROLES, infos, phases, title=title,
                           notes=[f"model: {source}", f"{res}x{res} px, policy micro batch {int(pol.micro_batch_size)}",
                                  note], **options)]


def diffusion_grpo(cfg: Any, assume: Mapping[str, str] | None = None,
                   configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    import torch
    from multiengine.pipelines.diffusion.rewards import TinyShapesRewardModel
    from multiengine.recipes import diffusion_grpo as recipe

    d = cfg.diffusion
    extra = {}
    if recipe.REWARD_MODEL in list(cfg.reward.functions):
        with torch.device("meta"):
            extra["reward"] = module_info("reward", TinyShapesRewardModel())
    return _diffusion_rl(cfg, recipe, "diffusion_grpo", int(d.resolution), assume,
                         int(cfg.roles.policy.micro_batch_size),
                         f"{int(d.num_inference_steps)} sampling steps, group {int(d.group_size)}", extra,
                         ref=bool(float(d.kl_coef)), guidance_scale=float(d.guidance_scale))


def diffusion_dpo(cfg: Any, assume: Mapping[str, str] | None = None,
                  configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from multiengine.recipes import diffusion_dpo as recipe

    pairs = 2 * int(cfg.roles.policy.micro_batch_size)  # chosen and rejected images
    return _diffusion_rl(cfg, recipe, "diffusion_dpo", int(cfg.data.resolution), assume, pairs,
                         f"{pairs // 2} preference pairs per rank: {pairs} images per forward",
                         t5_tokens=int(cfg.dpo.max_sequence_length))

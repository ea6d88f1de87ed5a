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
from multiengine.pipelines.rlhf.tiny import tiny_model_info


def _lm_model(cfg: Any, model: str, role: str, assume: Mapping[str, str] | None, configs_dir: str | Path,
              tiny: tuple[int, int, int] | None = None) -> P.ModelInfo:
    """A causal LM's ModelInfo; ``model`` "" = the random tiny OPT ``(hidden, layers, seed)``, by default tiny.*'s."""
    build = functools.partial(tiny_model_info, *(tiny or (cfg.tiny.hidden, cfg.tiny.layers, cfg.seed)))
    if not model and not (assume and role in assume):
        return build()
    return resolve_model(str(model), role, assume=assume, configs_dir=configs_dir, tiny=build)


def _eval_generation(cfg: Any) -> tuple[int, int, int] | None:
    """The evaluation answers' generation (eval.batch_size prompts, prompt and new tokens); None with eval.size 0."""
    d = cfg.data
    return (int(cfg.eval.batch_size), int(d.max_prompt_len), int(cfg.generation.max_new_tokens)) if cfg.eval.size \
        else None


def rlhf_sft(cfg: Any, assume: Mapping[str, str] | None = None,
             configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .rlhf_sft import ROLES

    a, d = cfg.roles.actor, cfg.data
    info = _lm_model(cfg, a.model, "actor", assume, configs_dir)
    seq = int(d.max_prompt_len) + int(d.max_response_len)
    phases = lm_role_phases(cfg, ROLES, "actor", info, train=(int(a.micro_batch_size), seq),
                             generate=_eval_generation(cfg))
    return [declared_roles(cfg, ROLES, {"actor": info}, {"actor": phases}, title="rlhf_sft",
                           notes=[f"sequences of {seq} tokens, micro batch {a.micro_batch_size}"],
                           actor={"full_gather": ("generation",)})]


def rlhf_reward(cfg: Any, assume: Mapping[str, str] | None = None,
                configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .rlhf_reward import ROLES

    r, d = cfg.roles.reward, cfg.data
    info = _scalar(_lm_model(cfg, r.model, "reward", assume, configs_dir))
    seq, rows = int(d.max_prompt_len) + int(d.max_response_len), 2 * int(r.micro_batch_size)
    phases = lm_role_phases(cfg, ROLES, "reward", info, train=(rows, seq), logits=False)
    return [declared_roles(cfg, ROLES, {"reward": info}, {"reward": phases}, title="rlhf_reward",
                           notes=[f"pairs of {seq}-token sequences, micro batch {r.micro_batch_size} pairs "
                                  f"({rows} rows)"],
                           reward={"extra_trainable": P.transformer_dims(info.config).hidden})]


def _reward_roles(cfg: Any, declared: Any, rows: int, assume: Mapping[str, str] | None,
                  configs_dir: str | Path) -> tuple[RecipePlan, dict[str, P.ModelInfo]]:
    """Every reward-model role the recipe builds from ``reward.models`` (or the `reward` role from
    ``roles.reward.model`` when the section names no source), placed as the recipe places them: ``roles.reward``
    as its declaration resolves it (``declared``: the recipe's ROLES), then each entry's own placement keys.

    ``roles.reward``'s keys go to the first role that sets no placement of its own; the other such roles
    follow its placement (they share the section). A role whose entry sets its stage or offload is
    planned at that placement only: its keys live in a list the planner does not rewrite. Returns their roles,
    keys and notes (rlhf_ppo, rlhf_grpo: forwards of ``rows`` rollout rows) and the scalar-head model of each.
    """
    from .common import reward_entries

    r = cfg.roles.reward
    entries, functions = reward_entries(cfg.reward)
    if not entries and not functions:
        entries = [{"role": "reward", "model": "", "weight": 1.0}]
    stage = int(follow_chain(cfg, declared, "reward", "stage", -1))
    dtype = str(follow_chain(cfg, declared, "reward", "dtype", ""))
    seq = int(cfg.data.max_prompt_len) + int(cfg.generation.max_new_tokens)
    out, infos = RecipePlan("", []), {}
    leader: str | None = None
    for i, e in enumerate(entries):
        info = _scalar(_lm_model(cfg, e.get("model") or r.model or "", e["role"], assume, configs_dir))
        e_stage = e.get("stage")
        e_stage = stage if e_stage is None or e_stage < 0 else int(e_stage)
        e_dtype = str(e.get("dtype") or dtype)
        own = "stage" in e or "offload_params" in e
        gather = bool(e.get("gather_forward", r.gather_forward))
        current = _current(e_stage, False, bool(e.get("offload_params", r.offload_params)))
        follows = leader if not own and leader is not None else None
        note = f"weight {e['weight']:g}"
        if own:
            note += f"; placement set in reward.models[{i}] (planned as written)"
        elif follows:
            note += f"; placed like {leader} (one roles.reward section)"
        out.roles.append(_role(
            e["role"], info, e_dtype, trainable=False, current=current,
            phases=_lm_phases(P.transformer_dims(info.config), e_dtype, forward=(rows, seq), logits=False,
                              label="experience forward"),
            full_gather=("experience forward",) if gather else (),
            gather_hint=f"reward.models[{i}].gather_forward=false" if "gather_forward" in e
            else "roles.reward.gather_forward=false",
            choices=(current,) if own else (), follows=follows, follows_all=follows is not None, note=note))
        infos[e["role"]] = info
        if not own and leader is None:
            leader = e["role"]
            out.keys[e["role"]] = _keys("roles.reward", offload_optimizer=False)
    if functions:
        out.notes.append("reward functions (no memory): " + ", ".join(f"{fn} x {w:g}" for fn, w in functions))
    return out, infos


def _policy(title: str, note: str, cfg: Any, roles: Any, infos: Mapping[str, P.ModelInfo], ref: bool, rows: int,
            rollout: int, rewards: RecipePlan) -> RecipePlan:
    """rlhf_ppo, rlhf_grpo: the actor generating ``rollout`` rows and updating on its micro batch, the critic where
    ``infos`` has one, a frozen ref from the actor's folder where ``ref`` (experience forwards of ``rows`` rows by
    the actor and critic, of ``rollout`` rows by the ref), then the reward-model roles ``rewards``."""
    prompt, new = int(cfg.data.max_prompt_len), int(cfg.generation.max_new_tokens)
    seq, r = prompt + new, cfg.roles
    infos = {**infos, "ref": infos["actor"]} if ref else infos
    phases = {"actor": lm_role_phases(cfg, roles, "actor", infos["actor"], generate=(rollout, prompt, new),
                                       forward=(rows, seq), train=(int(r.actor.micro_batch_size), seq),
                                       label="experience forward"),
              "ref": lm_role_phases(cfg, roles, "ref", infos["actor"], forward=(rollout, seq),
                                     label="experience forward")}
    options = {"actor": {"full_gather": ("generation",) if cfg.generation.mode == "gather" else (),
                         "gather_hint": "generation.mode=per_token"},
               "ref": gather_options(cfg, "ref", "experience forward")}
    if "critic" in infos:
        phases["critic"] = lm_role_phases(cfg, roles, "critic", infos["critic"], forward=(rows, seq),
                                           train=(int(r.critic.micro_batch_size), seq), logits=False,
                                           label="experience forward")
        options["critic"] = {"extra_trainable": P.transformer_dims(infos["critic"].config).hidden}
    plan = declared_roles(cfg, roles, infos, phases, title=title, notes=[note, *rewards.notes], **options)
    plan.roles += rewards.roles
    plan.keys.update(rewards.keys)
    return plan


def rlhf_ppo(cfg: Any, assume: Mapping[str, str] | None = None,
             configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    from .rlhf_ppo import ROLES

    r, g, d = cfg.roles, cfg.generation, cfg.data
    actor_info = _lm_model(cfg, r.actor.model, "actor", assume, configs_dir)
    prompt, new, rollout = int(d.max_prompt_len), int(g.max_new_tokens), int(cfg.ppo.rollout_batch_size)
    rewards, reward_infos = _reward_roles(cfg, ROLES, rollout, assume, configs_dir)
    # the critic's folder as the recipe resolves it: roles.critic.model, else the reward model's (its
    # declaration), else the first reward model, else the actor's with a fresh head (rewards from functions only)
    if r.critic.model or (assume and "critic" in assume):
        critic_info = _scalar(_lm_model(cfg, r.critic.model, "critic", assume, configs_dir))
    elif reward_infos:
        critic_info = reward_infos.get("reward") or next(iter(reward_infos.values()))
    else:
        critic_info = _scalar(actor_info)
    plan = _policy("rlhf_ppo", f"generation: {rollout} prompts x ({prompt} + {new}) tokens per rank, mode {g.mode}; "
                   f"updates on {int(r.actor.micro_batch_size)} rows (critic {int(r.critic.micro_batch_size)}) per "
                   "forward/backward", cfg, ROLES, {"actor": actor_info, "critic": critic_info}, True, rollout,
                   rollout, rewards)
    if cfg.ema.enabled:  # the actor's weights (and adapters) at the actor's stage
        ema_dtype = str(follow_chain(cfg, ROLES, "ema", "dtype", ""))
        plan.roles.append(_role("ema", actor_info, ema_dtype, trainable=False, lora=_lora(r.actor.lora),
                                current=_current(plan.roles[0].current.stage, False, r.ema.offload_params),
                                follows="actor", note="built at the actor's stage"))
        plan.keys["ema"] = RoleKeys(None, "roles.ema.offload_params")
    return [plan]


def rlhf_grpo(cfg: Any, assume: Mapping[str, str] | None = None,
              configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    """Actor, a frozen ref (none when ``grpo.kl_coef`` is 0) and the reward-model roles; no critic. A
    rollout is ``rollout_batch_size`` prompts x ``n_samples_per_prompt`` rows per rank, generated and
    scored in one batch; the update runs on ``roles.actor.micro_batch_size`` rows at a time."""
    from .rlhf_grpo import ROLES

    gr, g, d, a = cfg.grpo, cfg.generation, cfg.data, cfg.roles.actor
    info = _lm_model(cfg, a.model, "actor", assume, configs_dir)
    prompt, new = int(d.max_prompt_len), int(g.max_new_tokens)
    rows = int(gr.rollout_batch_size) * int(gr.n_samples_per_prompt)
    rows_gen = max(rows, int(cfg.eval.batch_size) if cfg.eval.size else 0)
    note = (f"rollout: {gr.rollout_batch_size} prompts x {gr.n_samples_per_prompt} samples = {rows} rows of "
            f"({prompt} + {new}) tokens per rank, generation mode {g.mode}; updates on {int(a.micro_batch_size)} "
            "rows per forward/backward")
    return [_policy("rlhf_grpo", note, cfg, ROLES, {"actor": info}, float(gr.kl_coef) > 0, rows, rows_gen,
                    _reward_roles(cfg, ROLES, rows_gen, assume, configs_dir)[0])]


def rlhf_dpo(cfg: Any, assume: Mapping[str, str] | None = None,
             configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    """A trainable policy and a frozen ref (by default from the same folder); each micro batch is
    ``roles.actor.micro_batch_size`` pairs = twice as many rows (chosen and rejected)."""
    from .rlhf_dpo import ROLES

    a, d, dpo = cfg.roles.actor, cfg.data, cfg.dpo
    info = _lm_model(cfg, a.model, "actor", assume, configs_dir)
    ref_path = model_path(cfg, ROLES, "ref")
    ref_info = info if ref_path == str(a.model) else _lm_model(cfg, ref_path, "ref", assume, configs_dir)
    seq, rows = int(d.max_prompt_len) + int(d.max_response_len), 2 * int(a.micro_batch_size)
    ref_rows, label = (2 * int(dpo.precompute_batch_size), "precompute") if dpo.precompute_ref \
        else (rows, "reference forward")
    phases = {"actor": lm_role_phases(cfg, ROLES, "actor", info, train=(rows, seq), generate=_eval_generation(cfg)),
              "ref": lm_role_phases(cfg, ROLES, "ref", ref_info, forward=(ref_rows, seq), label=label)}
    return [declared_roles(cfg, ROLES, {"actor": info, "ref": ref_info}, phases, title="rlhf_dpo",
                           notes=[f"micro batch {a.micro_batch_size} pairs = {rows} rows of {seq} tokens"
                                  + ("; ref log-probs precomputed before training" if dpo.precompute_ref else "")],
                           actor={"full_gather": ("generation",)}, ref=gather_options(cfg, "ref", label))]


def rlhf_e2e(cfg: Any, assume: Mapping[str, str] | None = None,
             configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    """The steps rlhf_e2e runs one after another (SFT, reward model unless step 3 is DPO, then PPO, GRPO or
    DPO per ``algorithm``), each planned on its own."""
    from .rlhf_e2e import BASE_MODEL, FINAL_STEP, steps

    common = [f"seed={cfg.seed}", f"backend={cfg.backend}"]
    base = str(cfg.model.pretrained)
    # the reward model starts from the SFT export (same architecture as the base) or its own base
    rm_base = base if cfg.reward.init_from_sft else (str(cfg.model.reward_pretrained) or base)
    models = {"sft": [f"{BASE_MODEL['rlhf_sft']}={base}"] if base else [],
              "reward": [f"{BASE_MODEL['rlhf_reward']}={rm_base}"] if rm_base else [],
              str(cfg.algorithm): FINAL_STEP[str(cfg.algorithm)][2](base, rm_base)}
    out = []
    for section, recipe, _ in steps(cfg):
        sec = cfg[section]
        sub = load_config(recipe, str(sec.config) or None, [*common, *models[section], *sec.overrides],
                          configs_dir=configs_dir)
        for item in recipe_plans(recipe, sub, assume, configs_dir):
            item.title = f"rlhf_e2e step {recipe} (config {sec.config or 'defaults'})"
            item.overrides_key = f"{section}.overrides"
            out.append(item)
    return out


def distill(cfg: Any, assume: Mapping[str, str] | None = None,
            configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    """A frozen teacher and a trainable student; the teacher's logits stay alive through the student's step."""
    from .distill import ROLES

    r, d, tiny = cfg.roles, cfg.data, cfg.tiny
    # "" = the tiny SFT model the recipe trains first (the RLHF recipes' tiny OPT) / a random tiny student
    teacher_info = _lm_model(cfg, r.teacher.model, "teacher", assume, configs_dir)
    student_info = _lm_model(cfg, r.student.model, "student", assume, configs_dir,
                             (int(tiny.student_hidden), int(tiny.student_layers), int(cfg.seed) + 1))
    batch, seq = int(r.student.micro_batch_size), int(d.max_prompt_len) + int(d.max_response_len)
    vocab, tdtype = P.transformer_dims(teacher_info.config).vocab, str(r.teacher.dtype)
    teacher_logits = batch * seq * vocab * (P.DTYPE_BYTES[tdtype] + 4)  # its logits and log-softmax
    student = lm_role_phases(cfg, ROLES, "student", student_info, train=(batch, seq), generate=_eval_generation(cfg))
    phases = {"teacher": lm_role_phases(cfg, ROLES, "teacher", teacher_info, forward=(batch, seq),
                                         generate=_eval_generation(cfg)),
              "student": [(label, n + (teacher_logits if label == "train step" else 0)) for label, n in student]}
    return [declared_roles(cfg, ROLES, {"teacher": teacher_info, "student": student_info}, phases, title="distill",
                           notes=[f"sequences of {seq} tokens, micro batch {batch}; the student's train step holds "
                                  "the teacher's logits too"],
                           teacher={"full_gather": ("generation", "forward") if r.teacher.gather_forward
                                    else ("generation",), "gather_hint": "roles.teacher.gather_forward=false"},
                           student={"full_gather": ("generation",)})]


def gan(cfg: Any, assume: Mapping[str, str] | None = None,
        configs_dir: str | Path = CONFIGS_DIR) -> list[RecipePlan]:
    import torch
    from multiengine.pipelines.gan import MLP
    from multiengine.recipes import gan as recipe

    with torch.device("meta"):
        infos = {r.name: module_info(r.name, MLP(**recipe._shape(cfg, r.name))) for r in recipe.ROLES}
    return [declared_roles(cfg, recipe.ROLES, infos, title="gan",
                           notes=["two MLPs of gan.width x gan.depth; activations are negligible"])]

"""The planner's answers for real model sizes, as the tables of docs/planning.md.

Shipped GPU configs go through `multiengine plan`'s own per-recipe code (recipes/plans.py); the diffusion
transformers (SD3, FLUX), which no shipped config covers yet, are described here as role lists with the same
formulas. Then every shipped GPU config is planned as written. Computed, not run: no weights are loaded and
no GPU is needed.

    python -m benchmarks.plan_tables              # markdown tables + benchmarks/results/plan_tables.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from multiengine.engines import planner as P

GPU = 80 * P.GIB
HOST = 1 * P.TIB  # per 8-GPU node
LAYOUTS = ((8, 1), (64, 8))  # (GPUs, nodes)


def _recipe(recipe: str, config: str, overrides: list[str] = (), assume: dict[str, str] | None = None):
    from multiengine.recipes import plans
    from multiengine.recipes.config import load_config

    items = plans.recipe_plans(recipe, load_config(recipe, config, list(overrides)), assume)
    return [(item.title, item.roles) for item in items]


def _frozen_encoder(name: str, info: P.ModelInfo, batch: int, tokens: int, dtype: str = "bf16") -> P.RoleRequest:
    dims = P.transformer_dims(info.config)
    act = P.transformer_activation_bytes(dims, batch=batch, seq=tokens, dtype=dtype, trainable=False)
    return P.RoleRequest(name, params=info.params, dtype=dtype, numels=tuple(info.numels), hidden_size=info.hidden_size,
                         phases=(("encode", act),), current=P.Choice(3), source=info.source)


def _vae(info: P.ModelInfo, batch: int, res: int, dtype: str = "bf16") -> P.RoleRequest:
    c0 = int(info.config["block_out_channels"][0])
    act = P.conv_frozen_activation_bytes(batch=batch, height=res, width=res, channels=c0, dtype=dtype)
    return P.RoleRequest("vae", params=info.params, dtype=dtype, numels=tuple(info.numels),
                         hidden_size=info.hidden_size, phases=(("encode", act),), current=P.Choice(3),
                         source=info.source)


def dit_scenario(pipeline: str, *, res: int, batch: int, text_tokens: dict[str, int], lora: int | None = None,
                 targets: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0")) -> list[P.RoleRequest]:
    """A flow-matching fine-tune of a diffusion transformer: transformer trainable (full or LoRA), gradient
    checkpointing; vae and every text encoder frozen; bf16 everywhere."""
    from multiengine.engines.known_models import known_pipeline_info

    parts = known_pipeline_info(pipeline)
    tr = parts["transformer"]
    seq = P.dit_tokens(tr.config, height=res, width=res, text_tokens=sum(text_tokens.values()))
    act = P.transformer_activation_bytes(P.dit_dims(tr.config), batch=batch, seq=seq, dtype="bf16", trainable=True,
                                         gradient_checkpointing=True)
    numels, trainable, params = list(tr.numels), tr.params, tr.params
    if lora:
        adapters = P.lora_tensors(tr.tensors, lora, targets)
        numels += adapters
        params += sum(adapters)
        trainable = sum(adapters)
    roles = [P.RoleRequest("transformer", params=params, dtype="bf16", trainable_params=trainable,
                           numels=tuple(numels), hidden_size=tr.hidden_size, lora=bool(lora),
                           phases=(("train step", act),), current=P.Choice(3), source=tr.source)]
    roles.append(_vae(parts["vae"], batch, res))
    for name in sorted(n for n in parts if n.startswith("text_encoder")):
        roles.append(_frozen_encoder(name, parts[name], batch, text_tokens[name]))
    return roles


SCENARIOS: dict[str, Any] = {
    "SD 1.5 full fine-tune (sd_finetune/sd15_full: 512 px, batch 1, checkpointing, fp32 EMA)":
        lambda: _recipe("sd_finetune", "sd15_full"),
    "SD 1.5 LoRA rank 4 (sd_finetune/sd15_lora: 512 px, batch 1)":
        lambda: _recipe("sd_finetune", "sd15_lora"),
    "SDXL full fine-tune (sd_finetune/sd15_full with the SDXL base: 1024 px, batch 1, checkpointing, fp32 EMA)":
        lambda: _recipe("sd_finetune", "sd15_full", ["model.pretrained=stabilityai/stable-diffusion-xl-base-1.0",
                                                     "data.resolution=1024"]),
    "SD3-medium full fine-tune (1024 px, batch 1, checkpointing; CLIP-L, CLIP-G, T5-XXL frozen)":
        lambda: [("sd3", dit_scenario("stabilityai/stable-diffusion-3-medium-diffusers", res=1024, batch=1,
                                      text_tokens={"text_encoder": 77, "text_encoder_2": 77,
                                                   "text_encoder_3": 256}))],
    "FLUX.1-dev LoRA rank 16 on to_q/to_k/to_v/to_out.0 (1024 px, batch 1, checkpointing; CLIP-L, T5-XXL frozen)":
        lambda: [("flux-lora", dit_scenario("black-forest-labs/FLUX.1-dev", res=1024, batch=1, lora=16,
                                            text_tokens={"text_encoder": 77, "text_encoder_2": 512}))],
    "FLUX.1-dev full fine-tune (1024 px, batch 1, checkpointing; CLIP-L, T5-XXL frozen)":
        lambda: [("flux-full", dit_scenario("black-forest-labs/FLUX.1-dev", res=1024, batch=1,
                                            text_tokens={"text_encoder": 77, "text_encoder_2": 512}))],
    "PPO, OPT-1.3B actor + OPT-350M critic (rlhf_ppo/opt1.3b_opt350m as shipped)":
        lambda: _recipe("rlhf_ppo", "opt1.3b_opt350m"),
    "PPO, OPT-13B actor + OPT-350M critic (rlhf_ppo/opt1.3b_opt350m with --assume actor=facebook/opt-13b)":
        lambda: _recipe("rlhf_ppo", "opt1.3b_opt350m", assume={"actor": "facebook/opt-13b"}),
    "GRPO, Llama-3-8B-shaped actor + ref + OPT-350M reward model (rlhf_grpo/opt1.3b with --assume "
    "actor=meta-llama/Meta-Llama-3-8B: 4 prompts x 4 samples per GPU, 256 + 256 tokens)":
        lambda: _recipe("rlhf_grpo", "opt1.3b", assume={"actor": "meta-llama/Meta-Llama-3-8B"}),
}


def shipped_gpu_configs() -> list[tuple[str, str]]:
    """(recipe, config) of every shipped config except the tiny ones, for the recipes the planner knows."""
    from multiengine.recipes import plans
    from multiengine.recipes.config import list_recipes

    return [(r, n) for r, names in list_recipes().items() if r in plans.PLANNERS
            for n in names if not n.startswith("tiny")]


def as_written() -> list[dict[str, Any]]:
    """Each shipped GPU config (each step of an rlhf_e2e config) planned on every layout: the per-GPU total at
    the config's own placements, whether that fits, and the chooser's total."""
    rows = []
    for recipe, name in shipped_gpu_configs():
        for step, roles in _recipe(recipe, name):
            row = {"config": f"{recipe}/{name}", "step": step, "layouts": {}}
            for gpus, nodes in LAYOUTS:
                p = P.plan(roles, P.Budget(world_size=gpus, gpu_bytes=GPU, gpus_per_node=gpus // nodes,
                                           host_bytes=HOST))
                row["layouts"][gpus] = {"current_total": p.current_total, "current_fits": p.current_fits,
                                        "chosen_total": p.total, "fits": p.fits}
            rows.append(row)
    return rows


def run_all() -> list[dict[str, Any]]:
    out = []
    for title, build in SCENARIOS.items():
        for step, roles in build():
            plans = {gpus: P.plan(roles, P.Budget(world_size=gpus, gpu_bytes=GPU, gpus_per_node=gpus // nodes,
                                                  host_bytes=HOST)) for gpus, nodes in LAYOUTS}
            out.append({"title": title, "step": step, "roles": roles, "plans": plans})
    return out


def _gib(n: int) -> str:
    return f"{n / P.GIB:.1f}"


def markdown(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        lines += [f"### {r['title']}", ""]
        header = "| role | parameters | trainable |"
        rule = "|---|---:|---:|"
        for gpus, _ in LAYOUTS:
            header += f" {gpus} x 80 GB: placement | GiB/GPU (+host) |"
            rule += "---|---:|"
        lines += [header, rule]
        for i, req in enumerate(r["roles"]):
            row = (f"| {req.name} | {P.fmt_count(req.params)} | "
                   f"{P.fmt_count(req.trainable_params) if req.trainable else 'frozen'} |")
            for gpus, _ in LAYOUTS:
                o = r["plans"][gpus].roles[i].chosen
                host = f" (+{_gib(o.states.host)})" if o.states.host else ""
                row += f" {o.choice.label} | {_gib(o.states.accelerator)}{host} |"
            lines.append(row)
        def verdict(ok: bool | None) -> str:
            return "fits" if ok else "DOES NOT FIT"

        for label, get in (("peak transient", lambda p: f"{_gib(p.transient)} ({p.transient_role} "
                                                          f"{p.transient_phase})"),
                           ("total per GPU", lambda p: f"**{_gib(p.total)}** {verdict(p.fits)}"),
                           ("as written", lambda p: "-" if p.current_total is None else
                            f"{_gib(p.current_total)} {verdict(p.current_fits)}")):
            row = f"| {label} | | |"
            for gpus, _ in LAYOUTS:
                row += f" {get(r['plans'][gpus])} | |"
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def as_written_markdown(rows: list[dict[str, Any]]) -> str:
    header = "| config | step |" + "".join(f" {g} x 80 GB as written | {g} x 80 GB chosen |" for g, _ in LAYOUTS)
    lines = [header, "|---|---|" + "---:|---:|" * len(LAYOUTS)]
    for row in rows:
        step = row["step"].split()[2] if row["step"].startswith("rlhf_e2e step") else ""
        line = f"| `{row['config']}` | {step} |"
        for gpus, _ in LAYOUTS:
            x = row["layouts"][gpus]
            line += (f" {_gib(x['current_total'])} {'fits' if x['current_fits'] else 'DOES NOT FIT'} |"
                     f" {_gib(x['chosen_total'])} |")
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    from benchmarks.common import write_results

    results = run_all()
    written = as_written()
    text = (markdown(results) + "\n### Every shipped GPU config as written (GiB per GPU)\n\n"
            + as_written_markdown(written))
    print(text)

    def brief(p: P.Plan) -> dict[str, Any]:
        data = p.to_dict()
        for role in data["roles"].values():
            role.pop("options")  # every placement of every role: `multiengine plan --json` shows them
        return data

    payload = [{"title": r["title"], "step": r["step"],
                "plans": {str(g): brief(p) for g, p in r["plans"].items()}} for r in results]
    path = write_results("plan_tables", {"scenarios": payload, "as_written": written},
                         command="python -m benchmarks.plan_tables " + " ".join(sys.argv[1:]))
    print(f"\nwrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()

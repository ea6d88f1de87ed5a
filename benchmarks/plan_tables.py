"""The planner's answers for real model sizes, as the tables of docs/planning.md.

Every scenario is a shipped GPU config (or one with a stated override) through `multiengine plan`'s own
per-recipe code (each recipe class's `plan`); then every shipped GPU config is planned as written. Computed, not run:
no weights are loaded and no GPU is needed.

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
    from multiengine.recipes.language.config import load_config, load_recipe

    items = load_recipe(recipe).plan(load_config(recipe, config, list(overrides)), assume)
    return [(item.title, item.roles) for item in items]


SCENARIOS: dict[str, Any] = {
    "SD 1.5 full fine-tune (sd_finetune/sd15_full: 512 px, batch 1, checkpointing, fp32 EMA)":
        lambda: _recipe("sd_finetune", "sd15_full"),
    "SD 1.5 LoRA rank 4 (sd_finetune/sd15_lora: 512 px, batch 1)":
        lambda: _recipe("sd_finetune", "sd15_lora"),
    "SDXL full fine-tune (sd_finetune/sdxl_full: 1024 px, batch 1, checkpointing, fp32 EMA)":
        lambda: _recipe("sd_finetune", "sdxl_full"),
    "SD3-medium full fine-tune (sd_finetune/sd3_medium_full: 1024 px, batch 1, checkpointing; CLIP-L, CLIP-G, "
    "T5-XXL frozen, 77 T5 tokens)":
        lambda: _recipe("sd_finetune", "sd3_medium_full"),
    "FLUX.1-dev LoRA rank 16 on the FLUX targets (sd_finetune/flux_dev_lora: 1024 px, batch 1, checkpointing; "
    "CLIP-L, T5-XXL frozen, 512 T5 tokens)":
        lambda: _recipe("sd_finetune", "flux_dev_lora"),
    "FLUX.1-dev full fine-tune (sd_finetune/flux_dev_lora with roles.transformer.lora.r=0: 1024 px, batch 1, "
    "checkpointing)":
        lambda: _recipe("sd_finetune", "flux_dev_lora", ["roles.transformer.lora.r=0"]),
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
    from multiengine.recipes.language.config import list_recipes, load_recipe

    return [(r, n) for r, names in list_recipes().items() if hasattr(load_recipe(r), "plan")
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

"""rlhf_sft, rlhf_reward, rlhf_dpo, rlhf_grpo and rlhf_ppo on tiny mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE: 4 experts, top 2), every role at ZeRO-3 and fp32, in one 2-rank launch; 2-3 steps each on a folder of
split files whose prompts differ in length (left padding in every generate) and, the ranks drawing other rows, in
the experts they route to. Each family's PPO scores with its own reward export (OLMoE, which transformers gives
no sequence-classification class: its causal-LM folder with a fresh head, the critic not exported). Then an SFT of
the Mixtral actor on the built-in task and a GRPO from its export, whose judge must rise; Qwen2-MoE's GRPO once more
with ``generation.router_replay=rollout``. Then: Mixtral's SFT and LoRA GRPO at ZeRO-2; Qwen3-MoE's PPO with
replay (ref too); on-policy distillation of a 32-wide OLMoE student from the OLMoE model, replayed; Qwen2-MoE's
replayed GRPO, 4 steps with a step-2 checkpoint and resumed from it; Qwen3-MoE's GRPO in bf16 with and without
replay.

Before each export, on both ranks, the trained engine's greedy answers to fixed prompts and its log-probs of them
(a causal-LM role), or its scores of fixed sequences (a reward model or critic), are recorded: the test compares
the exports loaded in plain transformers with them.

argv: out_dir, a JSON file {family: base folder, "olmoe_student": the student's folder, "data": folder of split
files, "dense": module folder}.
"""

import json
import os
import sys

import torch
from common import dump, finish, link_into
from multiengine.pipelines.rlhf.generation import GenerationSettings, generate
from multiengine.pipelines.rlhf.scoring import lm_logprobs, scoring_mode, sequence_scores
from multiengine.recipes.language.config import checked_config, load_recipe

out = sys.argv[1]
F = json.load(open(sys.argv[2]))
sys.path.insert(0, F["dense"])  # packing_env-style reward function module (distinct words), written by the test
QUIET = ["checkpoint.every=0", "plot=false", "tensorboard=false", "eval.every=0", "seed=0"]
EVAL = ["eval.size=16", "eval.batch_size=8"]
SOURCE = f"data.source={F['data']}"
DATA = [SOURCE, "generation.max_new_tokens=4", "data.max_prompt_len=24"]
# prompts of 2, 4, 7 and 1 words: left-padded in one batch
PROMPTS = ["list 3 fruits :", "apple pear plum mango :", "give 2 tools hammer saw drill wrench :", "tiger :"]
SCORED = ["list 3 fruits : apple pear plum", "name 2 colors : red red", "give 4 tools : hammer saw", "tiger : cat"]
# the roles each recipe exports whose numbers the test compares with plain transformers
EXPORTED = {"rlhf_sft": ("actor",), "rlhf_dpo": ("actor",), "rlhf_grpo": ("actor",), "rlhf_ppo": ("actor", "critic"),
            "rlhf_reward": ("reward",)}
ROLES = {"rlhf_sft": ("actor",), "rlhf_reward": ("reward",), "rlhf_dpo": ("actor", "ref"),
         "rlhf_grpo": ("actor", "ref"), "rlhf_ppo": ("actor", "critic", "ref", "reward"),
         "distill": ("teacher", "student")}
RECORD: dict = {}


@torch.no_grad()
def record(registry, tokenizer, roles) -> dict:
    """The trained roles' numbers (collective): greedy answers and their log-probs, or scores."""
    result = {}
    for role in roles:
        if role in ("reward", "critic"):
            tokenizer.padding_side = "right"
            batch = tokenizer(SCORED, return_tensors="pt", padding=True)
            tokenizer.padding_side = "left"
            with scoring_mode(registry, role) as engine:
                scores = sequence_scores(engine, batch["input_ids"], batch["attention_mask"]).float()
            result[role] = {"input_ids": batch["input_ids"].tolist(),
                            "attention_mask": batch["attention_mask"].tolist(), "scores": scores.tolist()}
            continue
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        answers = generate(registry, ids, mask, GenerationSettings(max_new_tokens=6).greedy(), tokenizer.eos_token_id,
                           tokenizer.pad_token_id, role=role)
        eos = (answers == tokenizer.eos_token_id).long()
        answer_mask = (eos.cumsum(1) - eos) == 0  # up to and with the first EOS
        seq, seq_mask = torch.cat([ids, answers], 1), torch.cat([mask, answer_mask.long()], 1)
        with scoring_mode(registry, role) as engine:
            logprobs = lm_logprobs(engine, seq, seq_mask, ids.shape[1])[0].float() * answer_mask
        result[role] = {"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "answers": answers.tolist(),
                        "answer_mask": answer_mask.long().tolist(), "logprobs": logprobs.tolist()}
    return result


def recording(recipe: str):
    """The recipe's class, its export preceded by :func:`record` of the roles it exports."""
    cls = load_recipe(recipe)
    if not getattr(cls, "_moe_recorded", False):
        original = cls.export

        def export(self):
            RECORD.clear()
            RECORD.update(record(self.registry, self.tokenizer, EXPORTED.get(self.name, ())))
            return original(self)

        cls.export, cls._moe_recorded = export, True
    return cls


def run(name: str, recipe: str, *overrides: str, links: dict | None = None, stage: int = 3,
        dtype: str = "fp32") -> None:
    folder = os.path.join(out, name)
    if links:
        link_into(folder, links)
    settings = [f"roles.{r}.{k}" for r in ROLES[recipe] for k in (f"stage={stage}", f"dtype={dtype}")]
    cfg = checked_config(recipe, "tiny", [f"output_dir={folder}", *QUIET, *settings, *overrides])
    recording(recipe).main(cfg)
    torch.distributed.barrier()  # rank 0 writes summary.json and metrics.jsonl
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    exports = {}
    for role in summary["export"] or {}:
        with open(os.path.join(folder, "export", role, "config.json")) as f:
            exports[role] = {"path": os.path.join(folder, "export", role), "class": json.load(f)["architectures"][0]}
    RESULTS[name] = {"metrics": summary["metrics"], "stages": {k: v["stage"] for k, v in summary["roles"].items()},
                     "requested": {k: v["requested_stage"] for k, v in summary["roles"].items()},
                     "step_keys": sorted({k for s in steps for k in s}),
                     "steps": sum(any(k.startswith("train/") for k in s) for s in steps),
                     "last_moe": {k: v for s in steps for k, v in s.items() if k.startswith("train/moe/")},
                     "exports": exports, "record": dict(RECORD)}


RESULTS: dict = {}
DENSE = "reward.functions=[moe_env:distinct_words]"
for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
    base = F[family]
    run(f"{family}/sft", "rlhf_sft", f"roles.actor.model={base}", "max_steps=2", *DATA, *EVAL)
    reward = base  # OLMoE: a fresh head on its body (no *ForSequenceClassification class to export)
    if family != "olmoe":
        run(f"{family}/reward", "rlhf_reward", f"roles.reward.model={base}", "max_steps=3", SOURCE)
        reward = os.path.join(out, family, "reward", "export", "reward")
    run(f"{family}/dpo", "rlhf_dpo", f"roles.actor.model={base}", "max_steps=2", *DATA, *EVAL)
    run(f"{family}/grpo", "rlhf_grpo", f"roles.actor.model={base}", "max_steps=2", "grpo.rollout_batch_size=4",
        DENSE, *DATA, *EVAL)
    run(f"{family}/ppo", "rlhf_ppo", f"roles.actor.model={base}", f"roles.reward.model={reward}", "max_steps=2",
        "ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=4", "roles.critic.micro_batch_size=4",
        "ppo.epochs=1", *DATA, *EVAL, *(["export.critic=false"] if family == "olmoe" else []))

# the judge: the Mixtral actor fine-tuned on the built-in task, then GRPO from its export
BUILTIN = ["eval.size=64", "eval.batch_size=32"]
run("judge/sft", "rlhf_sft", f"roles.actor.model={F['mixtral']}", "max_steps=120", "roles.actor.lr=3e-3", *BUILTIN)
actor = os.path.join(out, "judge", "sft", "export", "actor")
run("judge/grpo", "rlhf_grpo", f"roles.actor.model={actor}", "max_steps=16", *BUILTIN,
    links={"tiny": os.path.join(out, "judge", "sft", "tiny")})
# qwen2_moe/grpo again with router replay: in fp32 the rollout routes as the trainer would, so nothing may change
run("replay/grpo", "rlhf_grpo", f"roles.actor.model={F['qwen2_moe']}", "max_steps=2", "grpo.rollout_batch_size=4",
    "generation.router_replay=rollout", DENSE, *DATA, *EVAL)

# ZeRO-2: Mixtral's SFT, and its GRPO with LoRA adapters on the actor (the ref: the base, also at stage 2)
run("zero2/sft", "rlhf_sft", f"roles.actor.model={F['mixtral']}", "max_steps=2", *DATA, *EVAL, stage=2)
run("zero2/grpo", "rlhf_grpo", f"roles.actor.model={F['mixtral']}", "max_steps=2", "grpo.rollout_batch_size=4",
    "roles.actor.lora.r=4", DENSE, *DATA, *EVAL, stage=2)
# PPO with router replay in the actor's and the ref's passes, scored by Qwen3-MoE's reward export
run("replay/ppo", "rlhf_ppo", f"roles.actor.model={F['qwen3_moe']}",
    f"roles.reward.model={os.path.join(out, 'qwen3_moe', 'reward', 'export', 'reward')}", "max_steps=2",
    "ppo.rollout_batch_size=8", "roles.actor.micro_batch_size=4", "roles.critic.micro_batch_size=4", "ppo.epochs=1",
    "generation.router_replay=rollout", "generation.replay_ref=true", *DATA, "eval.size=0")
# on-policy distillation: an OLMoE teacher, a smaller OLMoE student sampling every step, its routing replayed
run("replay/distill", "distill", f"roles.teacher.model={F['olmoe']}", f"roles.student.model={F['olmoe_student']}",
    "max_steps=2", "distill.on_policy_fraction=1.0", "generation.router_replay=rollout", *DATA,
    "data.max_response_len=8", "eval.size=0")
# resume: Qwen2-MoE's GRPO with router replay, 4 steps with a checkpoint at step 2, then steps 3-4 again from it
RESUME = [f"roles.actor.model={F['qwen2_moe']}", "max_steps=4", "grpo.rollout_batch_size=4",
          "generation.router_replay=rollout", DENSE, *DATA, "eval.size=0"]
run("resume/full", "rlhf_grpo", *RESUME, "checkpoint.every=2", "checkpoint.keep_last=2")
run("resume/resumed", "rlhf_grpo", *RESUME,
    f"resume_from={os.path.join(out, 'resume', 'full', 'checkpoints', 'step_00000002')}")
# bf16 GRPO on Qwen3-MoE with and without router replay: the rollout's log-prob mismatch of each
for replay in ("off", "rollout"):
    run(f"bf16/{replay}", "rlhf_grpo", f"roles.actor.model={F['qwen3_moe']}", "max_steps=2",
        "grpo.rollout_batch_size=4", f"generation.router_replay={replay}", DENSE, *DATA, "eval.size=0",
        dtype="bf16")
dump(RESULTS)
finish()

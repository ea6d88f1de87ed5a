"""Knowledge distillation: a frozen teacher and a trainable student (any stage, optional LoRA), each its own engine;
forward KL, reverse KL or JSD with a temperature, optionally mixed with the hard-label loss; on-policy (GKD) on a
share of the steps, where the student samples the responses and the teacher scores every token of them.

    multiengine run distill --config tiny --nproc-per-node 2
    multiengine run distill --config tiny --nproc-per-node 2 distill.loss=jsd roles.teacher.offload_params=true
    multiengine run distill --config tiny --nproc-per-node 2 distill.on_policy_fraction=0.5 distill.loss=reverse_kl

The tiny config distils the RLHF tiny SFT model (trained here first, under output_dir/teacher) into a smaller
random tiny model. Reports the student's held-out cross-entropy and judge score beside the teacher's; exports
export/student. docs/rlhf.md and docs/rlhf-variants.md.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch
from multiengine.engines import barrier, mean_over_ranks, moe
from multiengine.engines import planner as P
from multiengine.engines.settings import Range, section, setting
from multiengine.pipelines.checks import role_tokenizer
from multiengine.pipelines.distill import (
    DistillSettings,
    check_vocab,
    heldout_cross_entropy,
    on_policy_batch,
    prompts_of_demonstrations,
    role_logits,
    student_samples,
)
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import ResponseData, SFTCollator, load_stage, training_batches
from multiengine.pipelines.rlhf.evaluation import EvalSettings, policy_answers
from multiengine.pipelines.rlhf.generation import RolloutGenerationSettings, position_ids_from_mask
from multiengine.pipelines.rlhf.roles import add_lm_role, add_rollout, export_role, role_folder, tiny_assets
from multiengine.pipelines.rlhf.rollout import sampling_seed
from multiengine.recipes import common
from multiengine.recipes.language import plans
from multiengine.recipes.language.config import Key, RecipeConfigError
from multiengine.recipes.language.lifecycle import Recipe, RunConfig
from multiengine.recipes.language.roles import Role


@dataclass(frozen=True)
class DistillTiny(tiny.TinySettings):
    student_hidden: int = setting(32, "width of the random tiny student (roles.student.model=\"\")", Range(8))
    student_layers: int = setting(1, "layers of the random tiny student", Range(1))
    student_heads: int = setting(0, "attention heads of the random tiny student (0 = width / 16; vLLM on CPU needs "
                                    "head size >= 32)", Range(0))


@dataclass(frozen=True)
class DistillConfig(RunConfig):
    output_dir: str = setting("outputs/distill", "everything the run writes goes under this folder")
    max_steps: int = setting(300, "optimizer steps of the student", Range(1))
    tiny: DistillTiny = section(DistillTiny, "the random tiny models: the OPT the tiny teacher is fine-tuned from, "
                                             "and the student")
    teacher_sft: common.StepRun = section(common.StepRun, "how the tiny teacher is trained (rlhf_sft) when "
                                                          "roles.teacher.model is empty")
    data: ResponseData = section(ResponseData, "demonstrations: prompt + response, messages or text rows "
                                               "(docs/data.md)")
    distill: DistillSettings = section(DistillSettings, "the distillation loss (the same per-token divergence on "
                                                        "demonstrations and on the student's samples)")
    generation: RolloutGenerationSettings = section(RolloutGenerationSettings, "sampling of evaluation answers and "
                                                    "of the student's on-policy responses")
    eval: EvalSettings = section(EvalSettings, "held-out cross-entropy and sampled answers to the prompts of the "
                                               "evaluation rows (the teacher's once)", every=100, greedy=False)
    export: common.ExportSettings = section(common.ExportSettings, "export/student")


def shared_logits(teacher: str, student: str, teacher_tokenizer: Any, student_tokenizer: Any) -> int:
    """How many leading logits teacher and student share (``check_vocab`` on their folders' logit sizes and
    tokenizers), or a config error naming both models, both sizes and the fix."""
    from transformers import AutoConfig

    sizes = [AutoConfig.from_pretrained(str(path)).vocab_size for path in (teacher, student)]
    try:
        return check_vocab(sizes[1], sizes[0], student_tokenizer, teacher_tokenizer)
    except ValueError as err:
        raise RecipeConfigError(
            f"roles.teacher.model ({teacher}: {sizes[0]} logits) and roles.student.model ({student}: {sizes[1]} "
            f"logits) do not share one vocabulary, which token-level distillation needs: {err}") from None


class Distill(Recipe):
    name = "distill"
    # one tokenizer for both roles (token-level distillation): the student's empty tokenizer is the teacher's
    roles = (Role("teacher", "the frozen teacher", sequences=True, defaults={
                  "stage": 3, "dtype": "fp32",
                  "model": Key("", "a causal-LM folder or hub name; \"\" = train the tiny SFT model under "
                                   "output_dir/teacher first (teacher_sft)"),
                  "tokenizer": Key("", "the tokenizer of both roles; \"\" = the teacher folder's own")}),
             Role("student", "the trainable student", trainable=True, tokenizer_of="teacher", sequences=True,
                  routed=True, omit=("token_budget",), why=common.TOKEN_BUDGET_WHY, defaults={
                  **common.RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-3, "scheduler": "cosine",
                  "warmup_steps": 20, "micro_batch_size": 16,
                  "model": Key("", "a causal-LM folder or hub name; \"\" = a random tiny model with the teacher's "
                                   "tokenizer (tiny.student_hidden wide, tiny.student_layers deep)")}),
             Role("rollout", common.ROLLOUT_ROLE_HELP.format(of="student") + " (distill.on_policy_fraction > 0)",
                  follows="student", rollout=True))
    Config = DistillConfig
    renamed = common.old_keys("student", "model.student", **{
        "model.teacher": "roles.teacher.model", "model.tokenizer": "roles.teacher.tokenizer",
        "model.student_hidden": "tiny.student_hidden", "model.student_layers": "tiny.student_layers",
        "distill.jsd_beta": "distill.beta"})
    headline = (("loss", "held-out cross-entropy of the student", False), common.JUDGE_HEADLINE)
    postfix_keys = ("loss", "divergence")
    plot_panels = [("distillation loss", ["train/loss", "train/divergence"]),
                   ("held-out cross-entropy", ["eval/loss", "eval/teacher_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/teacher_judge"])]

    @classmethod
    def validate(cls, cfg: DistillConfig, world_size: int = 1) -> None:
        """Teacher and student folders, one vocabulary for both (the same tokenizer; logit sizes may differ by
        padding), the demonstrations (with prompts, for on-policy steps) and evaluation rows; on ``world_size`` ranks,
        a micro batch of training rows per rank (for the student, and for the SFT run that trains a missing
        teacher)."""
        teacher, student, d = cfg.roles.teacher, cfg.roles.student, cfg.distill
        common.check_lockstep(cfg, "distill's on-policy steps")
        tok = common.check_role(cfg, "teacher")
        own = common.check_role(cfg, "student", student.tokenizer_path(), tok)
        if student.model and teacher.model:  # a tiny teacher trained at run time is checked when the models are built
            shared_logits(teacher.model, student.model, tok, own)
        report = common.check_data(cfg, "sft", tok, tokenizer_key="roles.teacher.tokenizer")
        if d.on_policy_fraction > 0 and report and not {"prompt", "messages"} & set(report["columns"]["train"]):
            raise RecipeConfigError(f"distill.on_policy_fraction={d.on_policy_fraction}: the student samples answers "
                                    "to the demonstrations' prompts, and text rows have none; use prompt + response or "
                                    "messages rows, or distill.on_policy_fraction=0")
        common.check_sft_run(cfg, "teacher_sft", "teacher", world_size, report)
        t = cfg.tiny
        common.check_rollout(cfg, cfg.data.max_prompt_len + cfg.generation.max_new_tokens, "student",
                             (t.student_hidden, t.student_layers, t.student_heads))
        # one stream of micro batches per rank (grad_accum draws it again)
        common.check_stage_batches(report, world_size, key="roles.student.micro_batch_size",
                                   value=student.micro_batch_size)

    @classmethod
    def plan(cls, cfg: DistillConfig, assume: Any = None) -> list[plans.RecipePlan]:
        """A frozen teacher and a trainable student; the teacher's logits stay alive through the student's step."""
        r, d, t = cfg.roles, cfg.data, cfg.tiny
        # "" = the tiny SFT model the recipe trains first (the RLHF recipes' tiny OPT) / a random tiny student
        teacher_info = common.lm_info(cfg, r.teacher.model, "teacher", assume)
        student_info = common.lm_info(cfg, r.student.model, "student", assume,
                                      (t.student_hidden, t.student_layers, cfg.seed + 1, t.student_heads))
        batch, seq = r.student.micro_batch_size, d.max_prompt_len + d.max_response_len
        vocab = P.transformer_dims(teacher_info.config).vocab
        teacher_logits = batch * seq * vocab * (P.DTYPE_BYTES[r.teacher.dtype] + 4)  # its logits and log-softmax
        student = plans.lm_role_phases(r.student, student_info, train=(batch, seq),
                                       generate=common.eval_generation(cfg))
        phases = {"teacher": plans.lm_role_phases(r.teacher, teacher_info, forward=(batch, seq),
                                                  generate=common.eval_generation(cfg)),
                  "student": [(label, n + (teacher_logits if label == "train step" else 0)) for label, n in student]}
        gathered = ("generation", "forward") if r.teacher.gather_forward else ("generation",)
        return [plans.declared_roles(cfg, {"teacher": teacher_info, "student": student_info}, phases, title="distill",
                                     notes=[f"sequences of {seq} tokens, micro batch {batch}; the student's train "
                                            "step holds the teacher's logits too"],
                                     teacher={**plans.gather_options(r.teacher), "full_gather": gathered},
                                     student={"full_gather": ("generation",)})]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        teacher, student = cfg.roles.teacher, cfg.roles.student
        common.check_lockstep(cfg, "distill's on-policy steps")  # also for runs that skipped validate
        self.replay = cfg.generation.router_replay == "rollout"  # the on-policy steps record the student's routing
        # 1. the teacher and student folders (tiny ones built here on first use) and their tokenizer
        assets = tiny_assets(registry, self.path("tiny"), cfg, student.model, teacher.model)
        teacher_path = teacher.model or common.sft_model(cfg, cfg.teacher_sft, self.path("teacher"), assets)
        self.teacher_path, self.tokenizer = role_folder(teacher, assets, teacher_path)
        self.student_path = student.model or self._tiny_student(assets["tokenizer"])
        own = role_tokenizer(student.tokenizer_path(), self.student_path, self.tokenizer)
        self.vocab = shared_logits(self.teacher_path, self.student_path, self.tokenizer, own)
        # 2. the two roles: a frozen teacher, a trainable student, each at its own placement
        add_lm_role(registry, teacher, self.teacher_path, cfg.seed)
        add_lm_role(registry, student, self.student_path, cfg.seed, total_steps=cfg.max_steps)
        registry.build()
        add_rollout(registry, cfg, self.student_path, cfg.data.max_prompt_len + cfg.generation.max_new_tokens,
                    "student")
        # 3. data: demonstrations (prompt + response), evaluation rows never trained on (held-out loss, prompts)
        data = load_stage(registry, cfg.data, cfg.seed, "sft", assets)
        collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = training_batches(registry, cfg.data, cfg.seed, data, collate,
                                                      student.micro_batch_size)
        # the student's and the teacher's answers to the evaluation prompts (generation.*: also the on-policy steps')
        self.answers = policy_answers(registry, data.eval, self.tokenizer, cfg.generation, cfg.eval,
                                      cfg.data.max_prompt_len, "student")
        self.teacher_answers = replace(self.answers, role="teacher")
        self.teacher_eval: dict[str, Any] = {}

    def _tiny_student(self, tokenizer_dir: str) -> str:
        t, path = self.cfg.tiny, self.path("student_init")
        if self.registry.is_main and not os.path.isfile(os.path.join(path, "config.json")):
            tiny.build_tiny_causal_lm(path, tokenizer_dir, hidden=t.student_hidden, layers=t.student_layers,
                                      seed=self.cfg.seed + 1, heads=t.student_heads)
        barrier()
        return path

    def _loss(self, batch: dict[str, torch.Tensor], micro: int, on_policy: bool
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Teacher and student logits of the same tokens (the demonstration, or the student's own answer to its
        prompt) and the divergence (+ hard-label CE offline) on the response."""
        registry, tok, d = self.registry, self.tokenizer, self.cfg.distill
        if not on_policy:
            teacher = role_logits(registry, "teacher", batch, self.vocab)  # frozen role: no graph
            with moe.tapped(registry["student"]) as tap:
                student = role_logits(registry, "student", batch, self.vocab)
            loss, parts = d.offline_loss(student, teacher, batch["labels"])
            aux, figures = moe.aux_term(registry["student"], tap, batch["labels"] != -100)  # an MoE router's
            return loss + aux, {**parts, **{k: torch.tensor(v) for k, v in figures.items()}}
        prompt_ids, prompt_mask = prompts_of_demonstrations(batch["input_ids"], batch["attention_mask"],
                                                            batch["labels"], tok.pad_token_id)
        # seeded by (seed, step, micro batch, rank) alone: a resumed run samples the same answers
        seed = sampling_seed(self.cfg.seed, self.step * registry["student"].gradient_accumulation_steps() + micro,
                             registry.rank)
        rollout = student_samples(registry, "student", prompt_ids, prompt_mask, self.answers.sampled,
                                  tok.eos_token_id, tok.pad_token_id, seed, self.replay)
        seqs = {"input_ids": rollout["sequences"], "attention_mask": rollout["attention_mask"]}
        positions = position_ids_from_mask(rollout["attention_mask"])  # left-padded prompts
        teacher = role_logits(registry, "teacher", seqs, self.vocab, positions)  # the same forwards on every rank
        # the student on its answers, routed as they were sampled with generation.router_replay=rollout
        with moe.tapped(registry["student"], rollout["routing"]) as tap:
            student = role_logits(registry, "student", seqs, self.vocab, positions)
        action = rollout["action_mask"]
        loss = d.sampled_loss(student, teacher, rollout["context_length"], action)
        C = rollout["context_length"]
        aux, figures = moe.aux_term(registry["student"], tap, torch.nn.functional.pad(action, (C, 0)))
        return loss + aux, {"divergence": loss.detach(), "sampled_length": action.sum(-1).float().mean(),
                            **{k: torch.tensor(v) for k, v in figures.items()}}

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        student = registry["student"]
        # GKD's lambda: one decision per step from (seed, step) alone, the same on every rank and after a resume
        on_policy = on_policy_batch(self.cfg.seed, self.step, self.cfg.distill.on_policy_fraction)
        totals: dict[str, list[float]] = {}
        for micro in range(student.gradient_accumulation_steps()):
            # next micro batch (prompt + response + EOS, labels -100 on the prompt and padding); the loss; backward
            # through the student's engine; its optimizer steps at the accumulation boundary
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            loss, parts = self._loss(batch, micro, on_policy)
            student.backward(loss)
            student.step()
            for key, value in {"loss": loss, **parts}.items():
                totals.setdefault(key, []).append(value.item())
        return mean_over_ranks({**{k: statistics.fmean(v) for k, v in totals.items()}, "lr": student.get_lr()[0],
                                "on_policy": float(on_policy)})

    def evaluate(self, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = {"loss": heldout_cross_entropy(self.registry, "student", self.heldout, self.vocab)}
        result.update(self.answers())
        if not self.teacher_eval:  # the teacher does not change: once is enough
            judged = self.teacher_answers()
            self.teacher_eval = {"teacher_loss": heldout_cross_entropy(self.registry, "teacher", self.heldout,
                                                                       self.vocab),
                                 **{f"teacher_{k}": v for k, v in judged.items() if k != "samples"}}
        result.update(self.teacher_eval)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"teacher_eval": self.teacher_eval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher_eval = dict(state.get("teacher_eval", {}))

    def export(self) -> dict[str, Any]:
        return export_role(self.registry, self.cfg.export, self.path("export"), self.tokenizer, "student")

    def summary_metrics(self) -> dict[str, Any]:
        metrics = {f"teacher/{k[len('teacher_'):]}": v for k, v in self.teacher_eval.items() if v is not None}
        metrics.update(self.eval_figures(("loss", "judge", "response_length", "greedy/judge")))
        steps = [m["on_policy"] for m in self.step_metrics if "on_policy" in m]
        metrics["train/on_policy_share"] = statistics.fmean(steps) if steps else None
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": {"teacher": self.teacher_path, "student": self.student_path}}


RECIPE = Distill

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

import logging
import os
import statistics
from dataclasses import replace
from typing import Any

import torch
from multiengine.engines import barrier, mean_over_ranks
from multiengine.engines.recipe_config import Choice, Key, Range, RecipeConfigError, split_keys
from multiengine.engines.recipe_lifecycle import COMMON_KEYS, Recipe
from multiengine.engines.role_schema import Role, lora_spec, old_keys, optim_spec, placement, role_keys, tokenizer_path
from multiengine.pipelines.distill import (
    DIVERGENCES,
    check_vocab,
    distillation_loss,
    heldout_cross_entropy,
    on_policy_batch,
    prompts_of_demonstrations,
    role_logits,
    sampled_distill_loss,
    student_samples,
)
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.data import SFTCollator
from multiengine.pipelines.rlhf.roles import actor_spec, ref_spec
from multiengine.pipelines.rlhf.rollout import sampling_seed
from multiengine.recipes import common, plans
from multiengine.recipes.common import DATA_KEYS, GENERATION_KEYS, RLHF_TRAINABLE, TINY_KEYS

logger = logging.getLogger(__name__)

# One tokenizer for both roles (token-level distillation): the student's empty tokenizer is the teacher's.
ROLES = (
    Role("teacher", "the frozen teacher", keys={
        "stage": 3, "dtype": "fp32",
        "model": Key("", "a causal-LM folder or hub name; \"\" = train the tiny SFT model under output_dir/teacher "
                         "first (teacher_sft)"),
        "tokenizer": Key("", "the tokenizer of both roles; \"\" = the teacher folder's own")}),
    Role("student", "the trainable student", trainable=True, tokenizer_of="teacher", keys={
        **RLHF_TRAINABLE, "stage": 2, "dtype": "fp32", "lr": 2e-3, "scheduler": "cosine", "warmup_steps": 20,
        "micro_batch_size": 16,
        "model": Key("", "a causal-LM folder or hub name; \"\" = a random tiny model with the teacher's tokenizer "
                         "(tiny.student_hidden wide, tiny.student_layers deep)")}),
)
KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/distill", "everything the run writes goes under this folder"),
    "max_steps": Key(300, "optimizer steps of the student"),
    "roles": role_keys(ROLES),
    "tiny": Key({
        **TINY_KEYS.default,
        "student_hidden": Key(32, "width of the random tiny student (roles.student.model=\"\")"),
        "student_layers": Key(1, "layers of the random tiny student"),
    }, "the random tiny models: the OPT the tiny teacher is fine-tuned from, and the student"),
    "teacher_sft": common.run_keys("how the tiny teacher is trained (rlhf_sft) when roles.teacher.model is empty"),
    "data": Key({
        **DATA_KEYS,
        "max_prompt_len": common.PROMPT_LEN,
        "max_response_len": Key(16, "response tokens kept, EOS included"),
        "heldout_size": Key(128, "evaluation rows scored for the held-out cross-entropy (0 = all of them)"),
    }, "demonstrations: prompt + response, messages or text rows (docs/data.md)"),
    "distill": Key({
        "loss": Key("forward_kl", "forward_kl | reverse_kl | jsd", Choice(*DIVERGENCES)),
        "temperature": Key(1.0, "softens both distributions; the loss is multiplied by its square"),
        "alpha": Key(1.0, "weight of the distillation term; 1 - alpha goes to the hard-label cross-entropy",
                     Range(0, 1)),
        "beta": Key(0.5, "the JSD's teacher weight, in (0, 1) (GKD's beta; forward_kl is beta 0, reverse_kl 1)",
                    Range(0, 1)),
        "on_policy_fraction": Key(0.0, "GKD's lambda: the share of steps whose responses the student samples itself "
                                       "(generation.*) for the teacher to score; 0 = offline, 1 = always", Range(0, 1)),
    }, "the distillation loss (the same per-token divergence on demonstrations and on the student's samples)"),
    "generation": Key(dict(GENERATION_KEYS), "sampling of evaluation answers and of the student's on-policy "
                                             "responses"),
    "eval": common.eval_keys("held-out cross-entropy and sampled answers to the prompts of the evaluation rows (the "
                             "teacher's once)", every=100, greedy=False),
    "export": common.export_keys("student"),
}
DEFAULTS, HELP = split_keys(KEYS)
RENAMED = old_keys("student", model="model.student", extra={
    "model.teacher": "roles.teacher.model", "model.tokenizer": "roles.teacher.tokenizer",
    "model.student_hidden": "tiny.student_hidden", "model.student_layers": "tiny.student_layers",
    "distill.jsd_beta": "distill.beta"})


def validate(cfg: Any, world_size: int = 1) -> None:
    """Teacher and student folders, one vocabulary for both (``check_vocab``: the same tokenizer; logit sizes may
    differ by padding), the loss settings, the demonstrations (with prompts, for on-policy steps) and evaluation
    rows; on ``world_size`` ranks, a micro batch of training rows per rank (for the student, and for the SFT run
    that trains a missing teacher)."""
    teacher, student, d = cfg.roles.teacher, cfg.roles.student, cfg.distill
    if d.loss == "jsd" and not 0.0 < d.beta < 1.0:
        raise RecipeConfigError(f"distill.beta={d.beta} with distill.loss=jsd: the JSD's teacher weight must be in "
                                "(0, 1); its ends are distill.loss=forward_kl (beta 0) and reverse_kl (beta 1)")
    tok = common.check_role(cfg, "teacher")
    own = common.check_role(cfg, "student", tokenizer_path(cfg, ROLES, "student"), tok)
    if student.model and teacher.model:  # a tiny teacher trained at run time is checked when the models are built
        shared_logits(teacher.model, student.model, tok, own)
    report = common.check_data(cfg, "sft", tok, tokenizer_key="roles.teacher.tokenizer")
    if d.on_policy_fraction > 0 and report and not {"prompt", "messages"} & set(report["columns"]["train"]):
        raise RecipeConfigError(f"distill.on_policy_fraction={d.on_policy_fraction}: the student samples answers to "
                                "the demonstrations' prompts, and text rows have none; use prompt + response or "
                                "messages rows, or distill.on_policy_fraction=0")
    common.check_sft_run(cfg, "teacher_sft", "teacher", world_size, report)
    # one stream of micro batches per rank (grad_accum draws it again)
    common.check_stage_batches(report, world_size, key="roles.student.micro_batch_size", value=student.micro_batch_size)


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
    headline = (("loss", "held-out cross-entropy of the student", False), common.JUDGE_HEADLINE)
    postfix_keys = ("loss", "divergence")
    plot_panels = [("distillation loss", ["train/loss", "train/divergence"]),
                   ("held-out cross-entropy", ["eval/loss", "eval/teacher_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/teacher_judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the teacher and student folders (tiny ones built here on first use) and their tokenizer
        teacher, student = cfg.roles.teacher, cfg.roles.student
        assets = common.tiny_assets(self, student.model, teacher.model)
        teacher_path = teacher.model or common.sft_model(self, cfg.teacher_sft, self.path("teacher"),
                                                         common.data_overrides(cfg.data, assets.get("data")),
                                                         assets["model"])
        self.teacher_path, self.tokenizer = common.role_folder(self, "teacher", assets, teacher_path)
        self.student_path = student.model or self._tiny_student(assets["tokenizer"])
        own = common.role_tokenizer(tokenizer_path(cfg, ROLES, "student"), self.student_path, self.tokenizer)
        self.vocab = shared_logits(self.teacher_path, self.student_path, self.tokenizer, own)

        # 2. the two roles: a frozen teacher, a trainable student, each at its own placement
        registry.add(ref_spec(self.teacher_path, placement(cfg, ROLES, "teacher"), name="teacher"))
        registry.add(actor_spec(self.student_path, placement(cfg, ROLES, "student"),
                                optim_spec(cfg, "student", cfg.max_steps), micro_batch_size=student.micro_batch_size,
                                grad_accum=student.grad_accum, lora=lora_spec(cfg, "student"),
                                gradient_checkpointing=student.gradient_checkpointing, seed=cfg.seed, name="student"))
        registry.build()

        # 3. data: demonstrations (prompt + response), evaluation rows never trained on (held-out loss, prompts)
        data = common.load_data(self, "sft", assets)
        collate = SFTCollator(self.tokenizer, cfg.data.max_prompt_len, cfg.data.max_response_len)
        self.batches, self.heldout = common.training_batches(self, data, collate, student.micro_batch_size)
        # the student's and the teacher's answers to the evaluation prompts (generation.*: also the on-policy steps')
        self.answers = common.policy_answers(self, data.eval, self.tokenizer, role="student")
        self.teacher_answers = replace(self.answers, role="teacher")
        self.teacher_eval: dict[str, Any] = {}

    def _tiny_student(self, tokenizer_dir: str) -> str:
        cfg = self.cfg
        path = self.path("student_init")
        if self.registry.is_main and not os.path.isfile(os.path.join(path, "config.json")):
            tiny.build_tiny_causal_lm(path, tokenizer_dir, hidden=cfg.tiny.student_hidden,
                                      layers=cfg.tiny.student_layers, seed=cfg.seed + 1)
        barrier()
        return path

    def _logits(self, role: str, batch: dict[str, torch.Tensor], position_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        return role_logits(self.registry, role, batch, self.vocab, position_ids)

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.cfg.distill
        teacher = self._logits("teacher", batch)  # frozen role: no graph
        student = self._logits("student", batch)
        return distillation_loss(student, teacher, batch["labels"], d.loss, d.temperature, d.alpha, d.beta)

    def _on_policy_loss(self, batch: dict[str, torch.Tensor], micro: int) -> tuple[torch.Tensor, dict[str, Any]]:
        from multiengine.pipelines.rlhf.generation import position_ids_from_mask

        cfg, registry, tok = self.cfg, self.registry, self.tokenizer
        prompt_ids, prompt_mask = prompts_of_demonstrations(batch["input_ids"], batch["attention_mask"],
                                                            batch["labels"], tok.pad_token_id)
        # seeded by (seed, step, micro batch, rank) alone: a resumed run samples the same answers
        seed = sampling_seed(cfg.seed, self.step * self.registry["student"].gradient_accumulation_steps() + micro,
                             registry.rank)
        rollout = student_samples(registry, "student", prompt_ids, prompt_mask, self.answers.sampled,
                                  tok.eos_token_id, tok.pad_token_id, seed)
        seqs = {"input_ids": rollout["sequences"], "attention_mask": rollout["attention_mask"]}
        positions = position_ids_from_mask(rollout["attention_mask"])  # left-padded prompts
        teacher = self._logits("teacher", seqs, positions)  # the same forwards on every rank (ZeRO-3)
        student = self._logits("student", seqs, positions)
        d, action = cfg.distill, rollout["action_mask"]
        loss = sampled_distill_loss(student, teacher, rollout["context_length"], action, d.loss, d.temperature,
                                    d.beta)
        return loss, {"divergence": loss.detach(), "sampled_length": action.sum(-1).float().mean()}

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        student = registry["student"]
        # GKD's lambda: one decision per step from (seed, step) alone, the same on every rank and after a resume
        on_policy = on_policy_batch(self.cfg.seed, self.step, self.cfg.distill.on_policy_fraction)
        totals: dict[str, list[float]] = {}
        for micro in range(student.gradient_accumulation_steps()):
            # 1. next micro batch: prompt + response + EOS, labels -100 on the prompt and padding
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            # 2. teacher and student logits of the same tokens (the demonstration, or the student's own answer to
            #    its prompt); divergence (+ hard-label CE offline) on the response
            loss, parts = self._on_policy_loss(batch, micro) if on_policy else self._loss(batch)
            # 3. backward through the student's engine; 4. its optimizer steps at the accumulation boundary
            student.backward(loss)
            student.step()
            for key, value in {"loss": loss, **parts}.items():
                totals.setdefault(key, []).append(value.item())
        # 5. means over micro batches and ranks
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
        return common.export_role(self, self.tokenizer, role="student")

    def summary_metrics(self) -> dict[str, Any]:
        metrics = {f"teacher/{k[len('teacher_'):]}": v for k, v in self.teacher_eval.items() if v is not None}
        metrics.update(self.eval_figures(("loss", "judge", "response_length", "greedy/judge")))
        steps = [m["on_policy"] for m in self.step_metrics if "on_policy" in m]
        metrics["train/on_policy_share"] = statistics.fmean(steps) if steps else None
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": {"teacher": self.teacher_path, "student": self.student_path}}


main = Distill.main
plan = plans.distill  # what `multiengine plan` sees of this recipe

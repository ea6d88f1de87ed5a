"""Knowledge distillation: a frozen teacher (any stage, ZeRO-3 with optional parameter offload) and a
trainable student (any stage), each its own engine; forward KL, reverse KL or JSD with a temperature,
optionally mixed with the hard-label loss.

    multiengine run distill --config tiny --nproc-per-node 2
    multiengine run distill --config tiny --nproc-per-node 2 distill.loss=jsd roles.teacher.offload_params=true

The tiny config distils the RLHF tiny SFT model (trained here on first use, as rlhf_e2e does, under
output_dir/teacher) into a smaller random tiny model, on the built-in task's demonstrations. Reports the
student's held-out cross-entropy and the judge's score of its answers before and after, beside the
teacher's. Writes metrics.jsonl, summary.json, curves.png and export/student under output_dir.
Written on the public API only: see docs/adding-a-workflow.md for a walk through it.
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

import torch
from multiengine.engines import Placement, barrier, frozen_role, mean_over_ranks, save_role, trainable_role
from multiengine.pipelines.distill import DIVERGENCES, distillation_loss
from multiengine.pipelines.rlhf import tiny
from multiengine.pipelines.rlhf.evaluation import evaluate_policy
from multiengine.pipelines.rlhf.generation import GenerationSettings
from multiengine.pipelines.rlhf.roles import load_causal_lm
from multiengine.pipelines.rlhf.runs import builtin_judge
from multiengine.recipes.common import (
    COMMON_HELP,
    DATA_DEFAULTS,
    RLHF_BETAS,
    check_data,
    check_model,
    check_sft_run_batches,
    check_stage_batches,
    check_tokenizer,
    config_error,
    data_overrides,
    demonstrations,
    evaluation_prompts,
    load_data,
    optim_spec,
    placement,
    recipe_checks,
    role_tokenizer,
    sft_model,
    tiny_assets,
    uses_builtin_data,
)
from multiengine.engines.recipe_config import Choice, Range, RecipeConfigError
from multiengine.recipes.lifecycle import COMMON_DEFAULTS, Recipe

logger = logging.getLogger(__name__)

KEYS: dict[str, Any] = {
    **COMMON_KEYS,
    "output_dir": Key("outputs/distill", "everything the run writes goes under this folder"),
    "max_steps": Key(300, "optimizer steps of the student"),
    "model": Key({
        "teacher": Key("", "a causal-LM folder; \"\" = train the tiny SFT model under output_dir/teacher first"),
        "student": Key("", "a causal-LM folder; \"\" = a random tiny model (same tokenizer, student_hidden wide)"),
        "tokenizer": Key("", "the tokenizer of both; \"\" = the teacher folder's own"),
        "student_hidden": Key(32, "width of the random tiny student"),
        "student_layers": Key(1, "layers of the random tiny student"),
    }, "teacher and student (one tokenizer: token-level distillation)"),
    "teacher_sft": Key({
        "config": Key("tiny", "a shipped rlhf_sft config"),
        "overrides": Key([], "key=value overrides for it"),
    }, "how the tiny teacher is trained (rlhf_sft) when model.teacher is empty"),
    "data": Key({
        **DATA_DEFAULTS,
        "max_prompt_len": Key(16, "prompt tokens kept (a longer prompt loses its beginning)"),
        "max_response_len": Key(16, "response tokens kept, EOS included"),
        "heldout_size": Key(128, "evaluation rows scored for the held-out cross-entropy (0 = all of them)"),
    }, "demonstrations: prompt + response, messages or text rows (docs/data.md)"),
    "distill": Key({
        "loss": Key("forward_kl", "forward_kl | reverse_kl | jsd"),
        "temperature": Key(1.0, "softens both distributions; the loss is multiplied by its square"),
        "alpha": Key(1.0, "weight of the distillation term; 1 - alpha goes to the hard-label cross-entropy"),
        "jsd_beta": Key(0.5, "the JSD's teacher weight, in (0, 1)"),
    }, "the distillation loss"),
    "train": Key({
        "micro_batch_size": Key(16, "rows per rank per forward/backward"),
        "grad_accum": Key(1, "micro batches per optimizer step"),
        "lr": Key(2e-3, "peak learning rate"),
        "weight_decay": Key(0.0, "AdamW weight decay"),
        "scheduler": Key("cosine", "a transformers scheduler name"),
        "warmup_steps": Key(20, "linear warm-up steps"),
        "max_grad_norm": Key(1.0, "gradient clipping (0 = none)"),
    }, "the student's optimizer and batches"),
    "roles": Key({
        "teacher": Key({
            "stage": Key(3, "ZeRO stage 0-3"),
            "dtype": Key("fp32", "fp32 | bf16 | fp16 (GPU only)"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "gather_forward": Key(False, "at ZeRO-3, one collective per forward instead of one per layer"),
        }, "the frozen teacher"),
        "student": Key({
            "stage": Key(2, "ZeRO stage 0-3"),
            "dtype": Key("fp32", "fp32 | bf16 | fp16 (GPU only)"),
            "offload_params": Key(False, "ZeRO-3 parameter offload to CPU"),
            "offload_optimizer": Key(False, "optimizer state offload to CPU"),
        }, "the trainable student"),
    }, "placement of each role"),
    "generation": Key({
        "max_new_tokens": Key(8, "tokens generated per answer"),
        "temperature": Key(1.0, "sampling temperature"),
    }, "sampling of evaluation answers"),
    "eval": Key({
        "every": Key(100, "also every N steps (always before and after)"),
        "size": Key(256, "evaluation prompts (split evenly over ranks); 0 = none"),
        "batch_size": Key(32, "prompts per generation batch"),
        "judge": Key(True, "the built-in task's programmatic judge (only for its prompts)"),
        "seed": Key(1234, "sampling seed of evaluation answers"),
    }, "held-out cross-entropy and sampled answers to the prompts of the evaluation rows"),
    "export": Key({
        "enabled": Key(True, "export/student"),
    }, "what the run writes under output_dir/export"),
}
CHECKS = recipe_checks(DEFAULTS, {
    "distill.loss": Choice(*DIVERGENCES), "distill.temperature": Range(0, min_exclusive=True),
    "distill.alpha": Range(0, 1), "distill.jsd_beta": Range(0, 1, min_exclusive=True, max_exclusive=True),
})
HELP = dict(COMMON_HELP)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Teacher and student folders, the tokenizer against both vocabularies (and the student's own tokenizer,
    if it has one, equal to it), the demonstrations and evaluation rows; on ``world_size`` ranks, a micro batch
    of training rows per rank (for the student, and for the SFT run that trains a missing teacher)."""
    from multiengine.pipelines.rlhf.retokenize import vocabularies_match

    check_model("model.teacher", cfg.model.teacher)
    check_model("model.student", cfg.model.student)
    tok = check_tokenizer("model.tokenizer", cfg.model.tokenizer, "model.teacher", cfg.model.teacher)
    if cfg.model.student:
        own = check_tokenizer("model.tokenizer", cfg.model.tokenizer, "model.student", cfg.model.student, tok)
        if tok is not None and own is not None and not cfg.model.tokenizer and not vocabularies_match(tok, own):
            raise config_error(ValueError(
                f"model.teacher ({cfg.model.teacher}) and model.student ({cfg.model.student}) have different "
                "tokenizers: token-level distillation compares next-token distributions over one vocabulary; use a "
                "student with the teacher's tokenizer (or set model.tokenizer if both really share one)"))
    report = check_data(cfg, "sft", tok, tokenizer_key="model.tokenizer")
    if not cfg.model.teacher:
        check_sft_run_batches(cfg.teacher_sft, report, world_size, "teacher_sft", "teacher")
    # demonstrations(): one stream of micro batches per rank (grad_accum draws it again)
    check_stage_batches(report, world_size, key="train.micro_batch_size", value=cfg.train.micro_batch_size)


class Distill(Recipe):
    name = "distill"
    headline = (("loss", "held-out cross-entropy of the student", False),
                ("judge", "judge score of sampled answers (built-in task)", True))
    postfix_keys = ("loss", "divergence")
    plot_panels = [("distillation loss", ["train/loss", "train/divergence"]),
                   ("held-out cross-entropy", ["eval/loss", "eval/teacher_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/teacher_judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        # 1. the teacher and student folders (tiny ones built here on first use) and their tokenizer
        assets = tiny_assets(self, uses_builtin_data(cfg.data) or not (cfg.model.student and cfg.model.teacher))
        builtin = assets.get("data", "")
        self.teacher_path = cfg.model.teacher or sft_model(self, cfg.teacher_sft, self.path("teacher"),
                                                            data_overrides(cfg.data, builtin or None), assets["model"])
        self.student_path = cfg.model.student or self._tiny_student(assets["tokenizer"])
        tiny_tok = role_tokenizer("", assets["tokenizer"]) if assets else None
        self.tokenizer = role_tokenizer(cfg.model.tokenizer, self.teacher_path, tiny_tok, what="model.teacher")
        self._check_vocabularies()

        # 2. the two roles: a frozen teacher, a trainable student, each at its own placement
        t = cfg.train
        teacher, student = placement(cfg.roles.teacher, trainable=False), placement(cfg.roles.student)
        registry.add(frozen_role("teacher", lambda: load_causal_lm(self.teacher_path, _dtype(teacher)), teacher))
        registry.add(trainable_role("student", lambda: load_causal_lm(self.student_path, _dtype(student)), student,
                                    optim_spec(t, cfg.max_steps, betas=RLHF_BETAS), micro_batch_size=t.micro_batch_size,
                                    grad_accum=t.grad_accum, seed=cfg.seed))
        registry.build()

        # 3. data: demonstrations (prompt + response), evaluation rows never trained on (held-out loss, prompts)
        data = load_data(self, "sft", default_source=builtin)
        self.batches, self.heldout = demonstrations(self, data, self.tokenizer, t.micro_batch_size)
        self.eval_prompts = evaluation_prompts(self, data.eval, self.tokenizer)
        self.judge = builtin_judge([p for b in self.eval_prompts for p in b["prompts"]], cfg.eval.judge)
        self.generation = GenerationSettings(max_new_tokens=cfg.generation.max_new_tokens, do_sample=True,
                                             temperature=cfg.generation.temperature)
        self.teacher_eval: dict[str, Any] = {}

    def _tiny_student(self, tokenizer_dir: str) -> str:
        cfg = self.cfg
        path = self.path("student_init")
        if self.registry.is_main and not os.path.isfile(os.path.join(path, "config.json")):
            tiny.build_tiny_causal_lm(path, tokenizer_dir, hidden=cfg.model.student_hidden,
                                      layers=cfg.model.student_layers, seed=cfg.seed + 1)
        barrier()
        return path

    def _check_vocabularies(self) -> None:
        from transformers import AutoConfig

        sizes = {name: AutoConfig.from_pretrained(path).vocab_size
                 for name, path in (("teacher", self.teacher_path), ("student", self.student_path))}
        if sizes["teacher"] != sizes["student"]:
            raise RecipeConfigError(
                f"model.teacher has a vocabulary of {sizes['teacher']} tokens and model.student one of "
                f"{sizes['student']}: token-level distillation needs the same tokenizer for both.")

    def _logits(self, role: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.registry[role](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False)
        return out.logits

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.cfg.distill
        teacher = self._logits("teacher", batch)  # frozen role: no graph
        student = self._logits("student", batch)
        return distillation_loss(student, teacher, batch["labels"], d.loss, d.temperature, d.alpha, d.jsd_beta)

    def train_step(self) -> dict[str, float]:
        registry = self.registry
        student = registry["student"]
        totals: dict[str, list[float]] = {"loss": [], "divergence": [], "ce": []}
        for _ in range(student.gradient_accumulation_steps()):
            # 1. next micro batch: prompt + response + EOS, labels -100 on the prompt and padding
            batch = {k: v.to(registry.device) for k, v in next(self.batches).items()}
            # 2. teacher and student logits of the same tokens; divergence (+ hard-label CE) on the response
            loss, parts = self._loss(batch)
            # 3. backward through the student's engine; 4. its optimizer steps at the accumulation boundary
            student.backward(loss)
            student.step()
            totals["loss"].append(loss.item())
            for key, value in parts.items():
                totals[key].append(value.item())
        # 5. means over micro batches and ranks
        return mean_over_ranks({**{k: statistics.fmean(v) for k, v in totals.items()}, "lr": student.get_lr()[0]})

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids.cpu(), skip_special_tokens=True)

    @torch.no_grad()
    def _heldout(self, role: str) -> float | None:
        if not self.heldout:
            return None
        import torch.nn.functional as F

        module = self.registry.role(role).module
        was_training = module.training
        module.eval()
        total = count = 0.0
        for batch in self.heldout:
            batch = {k: v.to(self.registry.device) for k, v in batch.items()}
            logits = self._logits(role, batch)[:, :-1].float()
            target = batch["labels"][:, 1:]
            mask = target != -100
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.clamp(min=0).reshape(-1),
                                 reduction="none").view(target.shape)
            total += float((ce * mask).sum())
            count += float(mask.sum())
        module.train(was_training)
        sums = mean_over_ranks({"total": total, "count": count})
        return sums["total"] / max(sums["count"], 1.0)

    def _judged(self, role: str) -> dict[str, Any]:
        if not self.eval_prompts:
            return {}
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        return evaluate_policy(self.registry, self.eval_prompts, self.generation, eos, pad, self.decode, role=role,
                               judge=self.judge, seed=self.cfg.eval.seed)

    def evaluate(self, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = {"loss": self._heldout("student")}
        result.update(self._judged("student"))
        if not self.teacher_eval:  # the teacher does not change: once is enough
            judged = self._judged("teacher")
            self.teacher_eval = {"teacher_loss": self._heldout("teacher"),
                                 **{f"teacher_{k}": v for k, v in judged.items() if k != "samples"}}
        result.update(self.teacher_eval)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"teacher_eval": self.teacher_eval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.teacher_eval = dict(state.get("teacher_eval", {}))

    def export(self) -> dict[str, Any]:
        if not self.cfg.export.enabled:
            return {}
        return {"student": save_role(self.registry, "student", self.path("export", "student"),
                                     tokenizer=self.tokenizer)}

    def summary_metrics(self) -> dict[str, Any]:
        metrics = {f"teacher/{k[len('teacher_'):]}": v for k, v in self.teacher_eval.items() if v is not None}
        metrics.update(self.eval_figures(("loss", "judge", "response_length")))
        return metrics

    def summary_extra(self) -> dict[str, Any]:
        return {"paths": {"teacher": self.teacher_path, "student": self.student_path}}


def _dtype(p: Placement) -> torch.dtype:
    from multiengine.engines import torch_dtype

    return torch_dtype(p.dtype)


main = Distill.main

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
from multiengine.pipelines.rlhf.runs import builtin_judge, resolve_tokenizer
from multiengine.recipes.common import (
    RLHF_BETAS,
    demonstrations,
    evaluation_prompts,
    optim_spec,
    placement,
    sft_model,
    tiny_assets,
)
from multiengine.recipes.config import RecipeConfigError
from multiengine.recipes.lifecycle import Recipe, with_common

logger = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = with_common({
    "output_dir": "outputs/distill",
    "max_steps": 300,  # optimizer steps of the student
    "model": {
        "teacher": "",  # a causal-LM folder; "" = train the tiny SFT model under output_dir/teacher first
        "student": "",  # a causal-LM folder; "" = a random tiny model (same tokenizer, student_hidden wide)
        "student_hidden": 32,
        "student_layers": 1,
    },
    "teacher_sft": {"config": "tiny", "overrides": []},  # how the tiny teacher is trained (rlhf_sft)
    "data": {
        "source": "",  # folder of {sft,eval}.jsonl, a file, or a hub name; "" = the built-in task
        "train_split": "train",
        "eval_split": "test",
        "max_prompt_len": 16,
        "max_response_len": 16,
        "heldout_size": 128,  # the last rows of the data, never trained on
    },
    "distill": {
        "loss": "forward_kl",  # forward_kl | reverse_kl | jsd
        "temperature": 1.0,
        "alpha": 1.0,  # weight of the distillation term; 1 - alpha goes to the hard-label cross-entropy
        "jsd_beta": 0.5,
    },
    "train": {"micro_batch_size": 16, "grad_accum": 1, "lr": 2e-3, "weight_decay": 0.0, "scheduler": "cosine",
              "warmup_steps": 20, "max_grad_norm": 1.0},
    "roles": {
        "teacher": {"stage": 3, "dtype": "fp32", "offload_params": False, "gather_forward": False},
        "student": {"stage": 2, "dtype": "fp32", "offload_params": False, "offload_optimizer": False},
    },
    "generation": {"max_new_tokens": 8, "temperature": 1.0},
    "eval": {"every": 100, "size": 256, "batch_size": 32, "judge": True, "seed": 1234},
    "export": {"enabled": True},
})


class Distill(Recipe):
    name = "distill"
    postfix_keys = ("loss", "divergence")
    plot_panels = [("distillation loss", ["train/loss", "train/divergence"]),
                   ("held-out cross-entropy", ["eval/loss", "eval/teacher_loss"]),
                   ("judge score (built-in task)", ["eval/judge", "eval/teacher_judge"])]

    def build(self) -> None:
        cfg, registry = self.cfg, self.registry
        if cfg.distill.loss not in DIVERGENCES:
            raise RecipeConfigError(f"distill.loss={cfg.distill.loss!r}; use one of {list(DIVERGENCES)}.")
        # 1. the teacher and student folders (tiny ones built here on first use) and their tokenizer
        assets = tiny_assets(self, not (cfg.data.source and cfg.model.student and cfg.model.teacher))
        source = cfg.data.source or assets["data"]
        self.teacher_path = cfg.model.teacher or sft_model(self, cfg.teacher_sft, self.path("teacher"), source,
                                                            assets["model"])
        self.student_path = cfg.model.student or self._tiny_student(assets["tokenizer"])
        self.tokenizer = resolve_tokenizer(self.teacher_path, assets.get("tokenizer", ""))
        self._check_vocabularies()

        # 2. the two roles: a frozen teacher, a trainable student, each at its own placement
        t = cfg.train
        teacher, student = placement(cfg.roles.teacher, trainable=False), placement(cfg.roles.student)
        registry.add(frozen_role("teacher", lambda: load_causal_lm(self.teacher_path, _dtype(teacher)), teacher))
        registry.add(trainable_role("student", lambda: load_causal_lm(self.student_path, _dtype(student)), student,
                                    optim_spec(t, cfg.max_steps, betas=RLHF_BETAS), micro_batch_size=t.micro_batch_size,
                                    grad_accum=t.grad_accum, seed=cfg.seed))
        registry.build()

        # 3. data: demonstrations (prompt + response), a held-out tail, evaluation prompts
        self.batches, self.heldout = demonstrations(self, source, self.tokenizer, t.micro_batch_size)
        self.eval_prompts = evaluation_prompts(self, source, self.tokenizer)
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

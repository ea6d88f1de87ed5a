"""Packed passes equal padded ones on 2 ranks (real DeepSpeed, fp32) for tiny Llama, Qwen2 and Gemma at ZeRO-2 and
ZeRO-3: the scoring passes, an RL update's losses, weights and gradients (workers/packed_passes.py), and they do not
when positions run on across a packed row; a token-budget update runs as many micro-batches on each rank and gives
the fixed-size path's weights; every RLHF recipe and distill gives the same per-step metrics packed and padded
(workers/packed_recipes.py). One launch for all."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import PPO_PLAIN, assert_keys_read, launch_jobs

pytestmark = pytest.mark.distributed
FAMILIES = ("llama", "qwen2", "gemma")
TOL = 1e-5


def long_tailed_data(folder: Path, seed: int = 0) -> Path:
    """Split files (sft, reward, ppo, eval .jsonl) in the built-in task's words with long-tailed lengths: most
    prompts and answers a few words, one in four 8-14 words (prompts 14-20), so short sequences share packed rows."""
    from multiengine.pipelines.rlhf import tiny

    rng = random.Random(seed)
    words = [w for topic in tiny.TOPICS.values() for w in topic]

    def text(short: tuple[int, int], long: tuple[int, int] = (8, 14)) -> str:
        return " ".join(rng.choices(words, k=rng.randint(*(long if rng.random() < 0.25 else short))))

    def row() -> dict[str, str]:
        return {"prompt": text((2, 4), (14, 20)) + " :", "response": text((1, 3)), "chosen": text((1, 3)),
                "rejected": text((1, 3))}

    folder.mkdir()
    for split, n, keys in (("sft", 256, ("prompt", "response")), ("reward", 256, ("prompt", "chosen", "rejected")),
                           ("ppo", 256, ("prompt",)), ("eval", 64, ("prompt", "response", "chosen", "rejected"))):
        rows = [row() for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({k: r[k] for k in keys}) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("packing")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok", chat_template=True)
    folders = {f: {"base": str(tiny.build_tiny_causal_lm(root / f, root / "tok", hidden=32, family=f)),
                   "student": str(tiny.build_tiny_causal_lm(root / f"{f}_small", root / "tok", hidden=16, layers=1,
                                                            family=f, seed=1))}
               for f in FAMILIES}
    # a reward model and critic on another (sub-word) tokenizer: the rollout's rows re-encoded for them
    tiny.train_bpe_tokenizer(tiny.task_vocabulary() * 3, root / "bpe_tok")
    bpe = str(tiny.build_tiny_causal_lm(root / "gemma_bpe", root / "bpe_tok", hidden=32, family="gemma", seed=2))
    data = str(long_tailed_data(root / "data"))
    (root / "folders.json").write_text(json.dumps({**folders, "bpe": bpe, "data": data}))
    (root / "bases.json").write_text(json.dumps({f: v["base"] for f, v in folders.items()}))
    return launch_jobs(root / "out", {"registry": ("packed_passes", str(root / "bases.json")),
                                      "recipes": ("packed_recipes", str(root / "folders.json"))})


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_passes_and_update_equal_padded(runs, family, stage):
    for rank, r in enumerate(runs["registry"]):
        case = r["families"][f"{family}/zero{stage}"]
        gaps = case["packed"]
        assert set(gaps) >= {"logprobs", "ref_logprobs", "values", "scores", "loss/policy_loss", "loss/value_loss",
                             "weights/actor", "gradient/actor", "weights/critic", "gradient/critic"}
        assert max(gaps.values()) < TOL, (rank, gaps)
        assert case["packed_rows"][0] < 8  # the rank's 8 rows did pack into fewer


@pytest.mark.parametrize("family", FAMILIES)
def test_the_comparison_fails_when_positions_do_not_restart(runs, family):
    for r in runs["registry"]:
        gaps = r["families"][f"{family}/zero2"]["running"]
        for key in ("logprobs", "ref_logprobs", "values", "scores", "loss/policy_loss", "loss/value_loss",
                    "gradient/actor", "gradient/critic"):
            assert gaps[key] > 10 * TOL, (key, gaps)  # the comparison fails by more than 10x


@pytest.mark.parametrize("budget", (24, 64))
@pytest.mark.parametrize("stage", (2, 3))
def test_token_budget_agrees_on_micro_batches_and_equals_fixed_size(runs, stage, budget):
    ranks = [r["budget"][f"zero{stage}/{budget}"] for r in runs["registry"]]
    # alone, rank 0's short rows fit one or two micro-batches of the budget and rank 1's long ones need 8 (one a
    # row) or 3: more micro-batches a step than grad_accum (4), or fewer
    alone = [b["alone"] for b in ranks]
    assert alone[0] < alone[1] == {24: 8, 64: 3}[budget], alone
    for role in ("actor", "critic"):
        for b in ranks:
            assert b["optimizer_steps"]["fixed"][role] == b["optimizer_steps"]["budget"][role] == 2
            assert b["micro_per_step"]["fixed"][role] == [4, 4]  # grad_accum
            # every rank as many as the rank that needs most, in every step of both epochs
            assert b["micro_per_step"]["budget"][role] == [max(alone)] * 2, b["micro_per_step"]
        assert ranks[0]["micro_per_step"] == ranks[1]["micro_per_step"]
    for b in ranks:
        assert max(b["gaps"].values()) < TOL, b["gaps"]


# timing and memory figures differ from run to run
VOLATILE = ("time", "_s", "mem", "bytes", "throughput", "per_s", "tokens_per", "samples_per", "seconds", "ms_per")
# means over micro-batches (of their own means): a token budget's other micro-batches give other ones
PER_MICRO_BATCH = ("entropy", "approx_kl", "clip_frac", "clip_high_frac", "clip_low_frac", "ratio_mean", "kl_loss_kl")


def metric_gaps(a: Path, b: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[float, float, float]]:
    """Each metric key's largest relative and absolute difference over the steps of two runs' metrics.jsonl, and
    its largest magnitude."""
    rows = [[json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()] for folder in (a, b)]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] and len(rows[0]) >= 2, rows
    gaps: dict[str, tuple[float, float, float]] = {}
    for ra, rb in zip(*rows):
        assert set(ra) == set(rb), set(ra) ^ set(rb)
        for key, va in ra.items():
            if isinstance(va, (int, float)) and not any(v in key for v in VOLATILE) and \
                    key.rpartition("/")[2] not in skip:
                diff, size, old = abs(va - rb[key]), max(abs(va), abs(rb[key])), gaps.get(key, (0.0, 0.0, 0.0))
                gaps[key] = (max(old[0], diff / max(size, 1e-12)), max(old[1], diff), max(old[2], size))
    return gaps


def assert_equal_metrics(gaps: dict[str, tuple[float, float, float]]) -> None:
    """Losses equal to TOL relative, or both under 1e-6 and 1e-8 apart (zero by construction, as GRPO's policy loss
    at ratio 1 with group-centred advantages: rounding noise); other figures to TOL relative or 1e-6 absolute (a KL
    or a margin is a difference of log-probs ~20 times its size); clip fractions are counts of tokens, one of which
    may sit at the clip's edge."""
    losses = {k: g for k, g in gaps.items() if "loss" in k}
    assert losses and not {k: g for k, g in losses.items() if g[0] >= TOL and not (g[2] < 1e-6 and g[1] < 1e-8)}, \
        losses
    others = {k: g for k, g in gaps.items() if k not in losses and g[0] >= TOL and g[1] >= 1e-6}
    assert not {k for k in others if not k.endswith("clip_frac")}, others


RECIPE_RUNS = ("sft_llama_z2", "sft_qwen2_z3", "reward_llama_z3", "reward_gemma_z2", "dpo_qwen2_z2", "dpo_llama_z3",
               "grpo_gemma_z2", "grpo_llama_z3", "multiturn_qwen2_z3", "ppo_llama_z3", "ppo_qwen2_z2",
               "ppo_bpe_gemma_z3", "distill_gemma_z2", "onpolicy_llama_z3")


@pytest.mark.parametrize("name", RECIPE_RUNS)
def test_recipe_metrics_equal_packed_and_padded(runs, name):
    result = runs["recipes"][0]
    folders = {k: Path(v) for k, v in result["folders"].items()}
    assert_equal_metrics(metric_gaps(folders[f"{name}/padded"], folders[f"{name}/packed"]))
    for rank in runs["recipes"]:  # the packed run packed its passes (into fewer rows); the padded one never
        assert rank["packed"][f"{name}/padded"]["calls"] == 0
        packed = rank["packed"][f"{name}/packed"]
        assert packed["calls"] > 0 and packed["packed_rows"] < packed["rows"], packed


@pytest.mark.parametrize("name", ("sft_llama_z2", "dpo_qwen2_z2", "grpo_gemma_z2", "distill_gemma_z2"))
def test_recipe_metrics_differ_when_positions_do_not_restart(runs, name):
    folders = {k: Path(v) for k, v in runs["recipes"][0]["folders"].items()}
    gaps = metric_gaps(folders[f"{name}/padded"], folders[f"{name}/running"])
    assert max(g[0] for key, g in gaps.items() if "loss" in key) > 10 * TOL, gaps


def test_token_budget_grpo_run_equals_fixed_micro_batches(runs):
    folders = {k: Path(v) for k, v in runs["recipes"][0]["folders"].items()}
    gaps = metric_gaps(folders["grpo_llama_z3/packed"], folders["grpo_llama_z3/budget"], PER_MICRO_BATCH)
    assert {"train/policy_loss", "train/kl_loss"} <= set(gaps)
    assert_equal_metrics(gaps)


def test_every_run_reads_its_keys(runs):
    # the models are given (no SFT model is trained first); PPO runs without an EMA or pretraining rows; a multi-turn
    # run's reward is its environment's (no reward model); on-policy distill samples every batch (no labels for the
    # hard-label term)
    recipes = {"sft": "rlhf_sft", "reward": "rlhf_reward", "dpo": "rlhf_dpo", "grpo": "rlhf_grpo",
               "multiturn": "rlhf_grpo", "ppo": "rlhf_ppo", "distill": "distill", "onpolicy": "distill"}
    sft, teacher = ("actor_sft.config", "actor_sft.overrides"), ("teacher_sft.config", "teacher_sft.overrides")
    unread = {"dpo": sft, "grpo": sft, "multiturn": (*sft, "roles.reward.tokenizer"), "ppo": PPO_PLAIN,
              "distill": teacher, "onpolicy": (*teacher, "distill.alpha")}
    for key, folder in runs["recipes"][0]["folders"].items():
        if not key.endswith("/padded"):
            kind = key.split("_")[0]
            assert_keys_read(Path(folder), recipes[kind], unread.get(kind, ()))

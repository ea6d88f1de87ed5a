"""RLHF on 2 real ranks (DeepSpeed CPU accelerator, gloo, no mocks): PPO at ZeRO-2 vs ZeRO-3, gathered vs
per-token generation, mixed placements with offload, LoRA, resume of step 3, exports that load with
transformers (and peft) alone; and the all-in-one CLI run on the embedded default, shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import GIVEN_MODELS, PPO_PLAIN, assert_keys_read, launch

pytestmark = pytest.mark.distributed

NUMERIC = ("reward/mean", "reward/std", "kl", "policy_loss", "value_loss", "approx_kl", "clip_frac", "entropy")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch("rlhf_ppo", tmp_path_factory.mktemp("rlhf_ppo"), timeout=900)


def test_zero2_and_zero3_give_the_same_step(ranks):
    for r in ranks:
        assert r["zero2"]["stages"] == {"actor": 2, "ref": 0, "critic": 2, "reward": 0}
        assert r["zero3"]["stages"] == {"actor": 3, "ref": 3, "critic": 3, "reward": 3}
        z2, z3 = r["zero2"]["steps"], r["zero3"]["steps"]
        assert len(z2) == len(z3) == 2
        for a, b in zip(z2, z3):
            assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-5)
            assert a["judge/mean"] == b["judge/mean"]  # the same sampled answers
            for key in NUMERIC:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
        # the update did something, and the second step saw a changed policy
        assert z2[1]["kl"] != 0.0 and z2[0]["policy_loss"] != z2[1]["policy_loss"]
    for a, b in zip(ranks[0]["zero2"]["steps"], ranks[1]["zero2"]["steps"]):  # metrics are global means
        assert {k: a[k] for k in NUMERIC} == pytest.approx({k: b[k] for k in NUMERIC})


def test_gathered_and_per_token_generation_agree(ranks):
    for r in ranks:
        g = r["generation"]
        assert g["tokens"]["gather"] == g["tokens"]["per_token"]
        assert g["tokens"]["gather_sampled"] == g["tokens"]["per_token_sampled"]
        assert len({t for row in g["tokens"]["gather_sampled"] for t in row}) > 5  # not a degenerate answer
        assert len(g["tokens"]["gather"]) == 8 and len(g["tokens"]["gather"][0]) >= 1
        # the actor is partitioned again afterwards: hooks re-attached, full copies released
        assert g["partitioned"]
        assert all(s < f for s, f in zip(g["shard_numel_after"], g["full_numel"]))
        assert set(g["ppo_step_s"]) == {"gather", "per_token"}


def test_mixed_placements_with_offload_ema_ptx_and_warmup(ranks):
    for r in ranks:
        m = r["mixed"]
        d = m["describe"]
        assert (d["actor"]["stage"], d["critic"]["stage"], d["ref"]["stage"]) == (3, 2, 3)
        assert d["reward"]["requested_stage"] == 2 and d["reward"]["stage"] == 0
        assert d["ref"]["offload"]["device"] == "cpu" and d["actor"]["offload"]["device"] == "none"
        assert d["ema"]["stage"] == 3
        assert 0.4 < m["memory"]["actor"]["params_local"] / m["memory"]["actor"]["params_total"] < 0.6
        assert m["memory"]["critic"]["params_local"] == m["memory"]["critic"]["params_total"]
        first, second = m["steps"]
        assert "policy_loss" not in first and "value_loss" in first  # critic warm-up step
        assert "policy_loss" in second and "ptx_loss" not in second  # ptx is part of the actor loss
        assert m["kl_coef"] != 0.1  # the adaptive controller moved
        assert m["checkpointing"] == {"actor": True, "critic": True}  # switched back on after generation
    m0 = ranks[0]["mixed"]
    assert m0["actor_change_warmup"] == 0.0
    assert m0["actor_change_after"] > 1e-6
    # EMA: between the weights before and after (decay 0.992 of a copy of the start)
    assert 0 < m0["ema_minus_before"] < m0["actor_change_after"]


def test_lora_trains_only_adapters_and_ref_is_the_base(ranks):
    lora = ranks[0]["lora"]
    assert lora["trainable"]["actor"] and all("lora_" in n for n in lora["trainable"]["actor"])
    assert all("lora_" in n or n.startswith("value_head") for n in lora["trainable"]["critic"])
    assert any(n.startswith("value_head") for n in lora["trainable"]["critic"])
    assert lora["base_change"] == 0.0
    assert lora["lora_change"] > 1e-4
    assert lora["matched"] == lora["ref_tensors"]  # every ref tensor has its frozen twin in the actor
    assert lora["base_vs_ref"] == 0.0


def test_resume_of_step3_continues_identically(ranks):
    for r in ranks:
        full, resumed = r["resume"]["full"], r["resume"]["resumed"]
        assert full["start"] == 0 and resumed["start"] == 2
        assert len(full["steps"]) == len(resumed["steps"]) == 4
        assert resumed["steps"][:2] == full["steps"][:2]  # restored from the checkpoint's client state
        for a, b in zip(full["steps"][2:], resumed["steps"][2:]):
            for key in (*NUMERIC, "kl_coef", "judge/mean"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert resumed["prompts"] == full["prompts"]
        assert resumed["kl_coef"] == pytest.approx(full["kl_coef"], rel=1e-9)
        assert resumed["lr"] == pytest.approx(full["lr"], rel=1e-9)
        assert resumed["eval_after"] == pytest.approx(full["eval_after"])
    for run in ("full", "resumed"):
        assert_keys_read(ranks[0]["resume"][run]["out_dir"], "rlhf_ppo", GIVEN_MODELS)


FRESH = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
from multiengine.pipelines.rlhf.models import ScalarHeadModel

p = json.loads(sys.argv[1])
out = {}
probe = torch.tensor(p["probe"])
model = AutoModelForCausalLM.from_pretrained(p["actor"]).eval()
tok = AutoTokenizer.from_pretrained(p["actor"])
with torch.no_grad():
    out["logits"] = model(input_ids=probe).logits[0, -1].tolist()
    gen = model.generate(input_ids=probe, attention_mask=torch.ones_like(probe), max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
out["generated"] = tok.decode(gen[0, probe.shape[1]:])
out["n_generated"] = int(gen.shape[1] - probe.shape[1])
critic = ScalarHeadModel.from_pretrained(p["critic"]).eval()
with torch.no_grad():
    out["values"] = critic(probe, torch.ones_like(probe)).tolist()
merged = AutoModelForCausalLM.from_pretrained(p["lora_actor"]).eval()
base = AutoModelForCausalLM.from_pretrained(p["base"])
adapted = PeftModel.from_pretrained(base, p["lora_adapter"]).eval()
with torch.no_grad():
    out["merged_logits"] = merged(input_ids=probe).logits[0, -1].tolist()
    out["adapter_logits"] = adapted(input_ids=probe).logits[0, -1].tolist()
    out["base_logits"] = AutoModelForCausalLM.from_pretrained(p["base"])(input_ids=probe).logits[0, -1].tolist()
lora_critic = ScalarHeadModel.from_pretrained(p["lora_critic"]).eval()
with torch.no_grad():
    out["lora_critic_values"] = lora_critic(probe, torch.ones_like(probe)).tolist()
print(json.dumps(out))
"""


def test_exports_load_with_transformers_and_peft_in_a_fresh_process(ranks):
    r = ranks[0]
    e, lora = r["export"], r["lora"]
    base = os.path.join(os.path.dirname(os.path.dirname(e["actor"]["model"])), "assets", "model")
    paths = {"actor": e["actor"]["model"], "critic": e["critic"]["model"], "probe": e["probe"],
             "lora_actor": lora["export_actor"]["model"], "lora_adapter": lora["export_actor"]["adapter"],
             "lora_critic": lora["export_critic"]["model"], "base": base}
    assert os.path.isfile(os.path.join(paths["lora_adapter"], "adapter_config.json"))
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the ZeRO-3 export holds the full trained weights: same outputs as the gathered live model
    assert out["logits"] == pytest.approx(e["logits"], abs=1e-4)
    assert out["values"][0] == pytest.approx(e["values"][0], abs=1e-4)
    assert out["n_generated"] >= 1
    # LoRA: merged weights == base + adapter (peft), == the trained live model, != the base
    assert out["merged_logits"] == pytest.approx(out["adapter_logits"], abs=1e-4)
    assert out["merged_logits"] == pytest.approx(lora["twin_logits"], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(out["merged_logits"], out["base_logits"])) > 1e-3
    assert len(out["lora_critic_values"][0]) == len(e["probe"][0])


CLI = [sys.executable, "-m", "multiengine.recipes.language.cli"]


def test_e2e_cli_on_the_embedded_default_shortened(tmp_path):
    """The three recipes chained by rlhf_e2e, from the CLI, with the tiny config cut to a few steps."""
    out = tmp_path / "e2e"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*CLI, "run", "rlhf_e2e", "--config", "tiny", "--nproc-per-node", "2", f"output_dir={out}", "max_steps=3",
         "sft.overrides=[max_steps=20,eval.every=0,eval.size=32]",
         "reward.overrides=[max_steps=20,eval.every=0,data.heldout_size=64]",
         "ppo.overrides=[eval.every=0,eval.size=32,checkpoint.every=2,ppo.rollout_batch_size=8,"
         "roles.actor.micro_batch_size=4,roles.critic.micro_batch_size=4,roles.actor.lora.r=8]"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # step 3 is PPO: neither GRPO's nor DPO's step, and step 2 starts from step 1's model (reward.init_from_sft);
    # step 3 is given steps 1 and 2's models
    assert_keys_read(out, "rlhf_e2e", ("grpo.config", "grpo.overrides", "dpo.config", "dpo.overrides",
                                       "model.reward_pretrained"))
    assert_keys_read(out / "ppo", "rlhf_ppo", (*GIVEN_MODELS, *PPO_PLAIN))
    text = proc.stdout + proc.stderr
    assert "rlhf_e2e: rlhf_sft ran (no finished run to reuse); rlhf_reward ran" in text
    assert "rlhf_ppo: per-role memory on rank 0" in text and "rlhf_e2e: per-role memory" not in text  # no roles
    summary = json.loads((out / "summary.json").read_text())
    figures = summary["figures"]
    for key in ("sft/judge", "reward/heldout_accuracy", "ppo/judge_before", "ppo/judge_after", "ppo/kl_after",
                "ppo/generation_s_mean", "ppo/experience_s_mean", "ppo/train_s_mean"):
        assert figures[key] is not None, key
    ppo = summary["steps"]["ppo"]
    # each step's export fed the next
    assert ppo["paths"]["actor"] == summary["steps"]["sft"]["export"]["actor"]["model"]
    assert ppo["paths"]["reward"] == ppo["paths"]["critic"] == summary["steps"]["reward"]["export"]["reward"]["model"]
    assert summary["steps"]["reward"]["model_path"] == ppo["paths"]["actor"]  # reward model from the SFT model
    assert ppo["metrics"]["steps"] == 3
    assert {"stage", "params_local"} <= set(ppo["memory"]["per_rank"][0]["roles"][0])
    assert len(ppo["memory"]["per_rank"]) == 2 and ppo["memory"]["per_rank"][1]["peak_rss_bytes"] > 0
    lines = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "train/kl" in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    for key in ("train/reward/mean", "train/reward/std", "train/kl", "train/entropy", "train/clip_frac",
                "train/approx_kl", "train/value_loss", "train/policy_loss", "train/response_length",
                "train/gen/tokens_per_s", "train/time/step_s", "train/time/generation_s",
                "train/time/experience_s", "train/time/train_s"):
        assert key in train[0], key
    # every 2 steps, and the final step
    assert (out / "ppo" / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (out / "ppo" / "export" / "actor" / "adapter" / "adapter_config.json").is_file()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "curves.png").is_file()

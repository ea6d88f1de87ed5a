"""A Hugging Face sequence-classification reward model (TRL's format) as reward and critic at ZeRO-3 on 2 ranks,
and its gathered export loading with AutoModelForSequenceClassification in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import GIVEN_MODELS, PPO_PLAIN, assert_keys_read, launch_jobs

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    out = tmp_path_factory.mktemp("seqcls")
    return {**launch_jobs(out, {"run": ("seqcls_roles",), "ppo_reencode": ("ppo_reencode",)}), "out": out}


def test_sequence_classification_reward_and_critic_at_zero3(jobs):
    ranks = jobs["run"]
    for r in ranks:
        for name in ("reward", "critic"):
            role = r[name]
            # body and score head partitioned over the 2 ranks, loaded by transformers under ZeRO-3
            assert role["head_partitioned"] and role["head_numel"] == 64 and role["head_local"] == 32
            assert role["body_local"] < 0.6 * role["body_total"]
            # the Hugging Face class's scores (last non-pad token, right padding)
            assert role["max_score_diff"] < 1e-4, (name, role)
        # the critic trains at ZeRO-3 exactly as the same model does on one process without DeepSpeed
        assert r["critic_losses"] == pytest.approx(r["plain_losses"], rel=1e-4)
        assert r["critic_losses"][-1] < r["critic_losses"][0]
    assert ranks[0]["critic_losses"] == pytest.approx(ranks[1]["critic_losses"])
    code = (
        "import json, torch\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"r = json.load(open({str(jobs['out'] / 'run' / 'rank0.json')!r}))\n"
        "m, info = AutoModelForSequenceClassification.from_pretrained(r['export'], output_loading_info=True)\n"
        "with torch.no_grad():\n"
        "    s = m.eval()(input_ids=torch.tensor(r['ids']), attention_mask=torch.tensor(r['mask'])).logits\n"
        "print(json.dumps({'scores': s.squeeze(-1).tolist(), 'missing': sorted(info['missing_keys']),"
        " 'unexpected': sorted(info['unexpected_keys'])}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["missing"] == [] and got["unexpected"] == []
    assert got["scores"] == pytest.approx(ranks[0]["expected"], abs=1e-5)


def test_ppo_recipe_with_a_reward_model_on_another_tokenizer(jobs):
    """rlhf_ppo with a word-level actor and a TRL-style sequence-classification reward model whose tokenizer is
    sub-word BPE: reward (ZeRO-3) and critic (ZeRO-3, from the same folder) read the actor's texts re-encoded."""
    ranks = jobs["ppo_reencode"]
    for r in ranks:
        assert r["reencoded"] == {"reward": True, "critic": True}
        assert r["stages"] == {"reward": 3, "critic": 3}
        assert r["reward_vocab"] != r["actor_vocab"]
        # the rollout's scores are exactly a direct scoring of the same texts in the reward model's encoding ...
        assert r["score_diff"] < 1e-5, r
        # ... and not what the actor's token ids would have scored
        assert r["raw_diff"] > 1e-2, r
        assert r["critic_rows_equal"] and r["critic_index_ok"] and r["values_finite"]
        assert len(r["steps"]) == 2 and all(s["value_loss"] == s["value_loss"] for s in r["steps"])
        assert r["critic_head_moved"] > 0
    assert ranks[0]["scores"] != ranks[1]["scores"]  # each rank scored its own prompts
    assert_keys_read(jobs["out"] / "ppo_reencode" / "run", "rlhf_ppo", (*GIVEN_MODELS, *PPO_PLAIN))
    code = (
        "import json\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"r = json.load(open({str(jobs['out'] / 'ppo_reencode' / 'rank0.json')!r}))\n"
        "m, info = AutoModelForSequenceClassification.from_pretrained(\n"
        "    r['export']['critic'], output_loading_info=True)\n"
        "tok = AutoTokenizer.from_pretrained(r['export']['critic'])\n"
        "print(json.dumps({'missing': sorted(info['missing_keys']), 'vocab': len(tok),\n"
        "                  'embed': m.config.vocab_size}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # the critic's export carries its own (BPE) tokenizer, not the actor's
    assert got["missing"] == [] and got["vocab"] == ranks[0]["reward_vocab"] == got["embed"]

"""The model families users bring (Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, GPT-2, OPT, GPT-NeoX, and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) through the registry at ZeRO-3 on 2 ranks, in one launch:
a trainable actor, then a frozen ref and a frozen sequence-classification reward model built after it (OLMoE has no
such class in transformers: a ScalarHeadModel on its body, as the recipes build one from a causal-LM folder)."""

from __future__ import annotations

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed
LORA = ("qwen3", "qwen3_moe")  # these families' actors train LoRA adapters only
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "opt", "gpt_neox",
            "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    import torch
    from multiengine.pipelines.rlhf import tiny
    from transformers import AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as SEQCLS

    root = tmp_path_factory.mktemp("families")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok", chat_template=True)
    folders = {}
    for family in tiny.TINY_FAMILIES:
        causal = tiny.build_tiny_causal_lm(root / family, root / "tok", hidden=64, layers=2, seed=0, family=family)
        seqcls = None
        if family in SEQCLS:
            torch.manual_seed(1)  # the new score head: the same values in the plain copy and every rank
            rm = AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1)
            rm.config.pad_token_id = 0
            seqcls = str(root / f"{family}_rm")
            rm.save_pretrained(seqcls)
        folders[family] = {"causal": str(causal), "seqcls": seqcls, "lora": family in LORA}
    (root / "folders.json").write_text(json.dumps(folders))
    ranks = launch("model_families", root / "out", str(root / "folders.json"))
    return folders, ranks


def test_every_family_is_covered(families):
    folders, ranks = families
    assert set(FAMILIES) <= set(folders)
    assert [f for f in FAMILIES if folders[f]["seqcls"] is None] == ["olmoe"]
    assert set(ranks[0]) == set(folders) == set(ranks[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_at_zero3_with_roles_built_after_it(families, family):
    folders, ranks = families
    for rank in ranks:
        r = rank[family]
        seqcls = folders[family]["seqcls"] is not None
        assert r["classes"]["reward"].endswith("ForSequenceClassification") if seqcls else \
            r["classes"]["reward"] == "ScalarHeadModel"
        # loaded partitioned, the weights are the folder's: every role equals a plain copy of it
        assert r["ref_error"] < 1e-4 and r["actor_error"] < 1e-4 and r["reward_error"] < 1e-4, r
        assert r["actor_changed"] > 1e-4 and r["loss"] == r["loss"]
        assert r["generated"] == 4
        for role in ("actor", "ref", "reward"):  # each rank holds about half of every role
            assert r["local"][role] <= 0.5 * r["total"][role] + 1000, (role, r)
        assert not r["plain_partitioned"]
        if family in LORA:
            assert r["classes"]["actor"] == "PeftModelForCausalLM" and 0 < r["trainable"] < 0.2 * r["total"]["actor"]
        else:
            assert r["trainable"] == r["total"]["actor"]
    assert ranks[0][family]["loss"] == ranks[1][family]["loss"]

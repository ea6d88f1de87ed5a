"""Mixture-of-experts actors at ZeRO-3 on 2 ranks whose tokens reach different experts (workers/moe_experts.py), in
one launch: every tiny MoE family with the ranks forced to disjoint experts, and a toy model that keeps one module
per expert, which only the registry's leaf modules (engines.moe.set_leaf_modules) keep from hanging. A hang fails
the launch's timeout."""

from __future__ import annotations

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from multiengine.pipelines.rlhf import tiny

    root = tmp_path_factory.mktemp("moe_experts")
    tiny.train_tokenizer(tiny.task_vocabulary(), root / "tok")
    folders = {f: str(tiny.build_tiny_causal_lm(root / f, root / "tok", hidden=32, layers=2, family=f))
               for f in tiny.MOE_FAMILIES}
    (root / "folders.json").write_text(json.dumps(folders))
    return launch("moe_experts", root / "out", str(root / "folders.json"), timeout=600)


def test_every_moe_family_and_the_toy_ran(ranks):
    assert set(ranks[0]) == set(ranks[1]) == {"toy", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}


@pytest.mark.parametrize("family", ["toy", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_disjoint_experts_forward_backward_step(ranks, family):
    for rank, forced in zip(ranks, ([0, 1], [2, 3])):
        r = rank[family]["forced"]
        assert r["experts"] == [forced, forced], (family, r)  # both layers, only the imposed experts
        assert r["replayed"] == 16 and r["loss"] == r["loss"]
        assert rank[family]["routers"] == 2 and rank[family]["changed"] > 1e-4
        # each expert was trained by one rank's tokens only, and both ranks' updates agree
        assert min(rank[family]["expert_changed"]) > 1e-6, rank[family]
    assert ranks[0][family]["expert_changed"] == ranks[1][family]["expert_changed"]
    assert ranks[0][family]["forced"]["loss"] != ranks[1][family]["forced"]["loss"]  # each rank's own rows


def test_fused_experts_get_no_leaf_modules_beyond_deepspeeds_defaults(ranks):
    # DeepSpeed's zero_optimization.leaf_module names the Mixtral and Qwen MoE blocks by default; fused experts need
    # nothing (set_leaf_modules adds none), so OLMoE's block is gathered per module
    defaults = {"mixtral": ["MixtralSparseMoeBlock"], "qwen2_moe": ["Qwen2MoeSparseMoeBlock"],
                "qwen3_moe": ["Qwen3MoeSparseMoeBlock"], "olmoe": []}
    for rank in ranks:
        assert {family: rank[family]["leaves"] for family in defaults} == defaults


def test_per_expert_modules_are_leaves_and_train_with_their_own_routing(ranks):
    for rank in ranks:
        assert rank["toy"]["leaves"] == ["ToyMoeBlock"]
    own = [rank["toy"]["own"] for rank in ranks]
    assert own[0]["experts"][0] != own[1]["experts"][0]  # the ranks' layer-0 gathers differ
    assert all(len(o["experts"][0]) == 2 and o["replayed"] == 0 and o["loss"] == o["loss"] for o in own)

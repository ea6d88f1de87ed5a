"""Planning mixtures of experts: total and active parameters, the experts' share and ZeRO-3 gathers from
safetensors headers and live models (hand-derived), the activations of top_k experts, the built-in Qwen3-30B-A3B
(published: 30.5B total, 3.3B active) and its shipped GRPO config; validate refuses the vLLM engine for an MoE."""

from __future__ import annotations

import json

import pytest
import torch
from multiengine.engines import planner as P

# tiny Qwen2-MoE: vocab 64, width 32, 2 layers, 2 heads (1 key/value head, head size 16), 4 experts of width 8,
# top 2, a shared expert of width 12
V, H, L, E, K, W, S = 64, 32, 2, 4, 2, 8, 12
ATTENTION = (H * H + H) + 2 * (H // 2 * H + H // 2) + H * H  # q (bias), k and v (1 kv head, bias), o
ROUTED = E * 3 * H * W  # per layer: gate_up [E, 2W, H] + down [E, H, W]
SHARED = 3 * H * S  # per layer: the shared expert's gate, up and down (its 1 x H gate is dense)
LAYER = ATTENTION + 2 * H + E * H + ROUTED + SHARED + H  # + 2 norms, router, shared expert gate
TOTAL = L * LAYER + 2 * V * H + H  # + embeddings, untied head, final norm


def _tiny_qwen2_moe():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2_moe", vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=2,
                                  num_key_value_heads=1, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=W,
                                  shared_expert_intermediate_size=S, intermediate_size=16, max_position_embeddings=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_counts_of_a_saved_tiny_moe_are_the_hand_derived_ones(tmp_path):
    model = _tiny_qwen2_moe()
    model.save_pretrained(tmp_path)  # experts saved one tensor per expert ("experts.0.gate_proj.weight", ...)
    info = P.model_info(tmp_path)
    assert info.params == TOTAL == sum(p.numel() for p in model.parameters()) == 19_296
    expected = P.MoeCounts(experts=E, top_k=K, total=TOTAL, routed=L * ROUTED, shared=L * SHARED, layers=L,
                           block=ROUTED)
    assert info.moe == expected
    assert expected.active == TOTAL - L * ROUTED + L * ROUTED * K // E == 16_224
    assert expected.expert_share == pytest.approx(6144 / 19_296)
    # the live model fuses each layer's experts into one module: the same counts (memory_report's)
    from multiengine.engines.memory import moe_params

    assert moe_params(model) == expected
    dense = P.model_info(tmp_path).without("model.layers.0.mlp.experts.").without("model.layers.1.mlp.experts.")
    assert dense.moe is None  # no expert tensors: counted as dense


def test_activations_size_top_k_experts_and_the_shared_one():
    d = P.transformer_dims(_tiny_qwen2_moe().config.to_dict())
    assert (d.intermediate, d.mlp, d.extra_per_layer) == (K * W + S, "gated", 2 * K * H + 2 * E)
    dense = P.transformer_dims({"model_type": "qwen2", "hidden_size": H, "num_hidden_layers": L,
                                "intermediate_size": 16, "num_attention_heads": 2})
    assert (dense.intermediate, dense.extra_per_layer) == (16, 0)


def test_zero3_gathers_a_whole_expert_block():
    block = 600_000_000  # more than stage3_max_live_parameters (3e7): gathered whole all the same
    moe = P.MoeCounts(experts=128, top_k=8, total=10**10, routed=48 * block, shared=0, layers=48, block=block)
    req = P.RoleRequest("ref", 10**10, "bf16", hidden_size=2048, phases=(("forward", 0),), moe=moe)
    prefetch = int(0.9 * 2048 * 2048)
    assert P.cost_role(req, P.Choice(3), 8).transient == 2 * (block + prefetch)
    dense = P.RoleRequest("ref", 10**10, "bf16", hidden_size=2048, phases=(("forward", 0),))
    assert P.cost_role(dense, P.Choice(3), 8).transient == 2 * (P.STAGE3_MAX_LIVE_PARAMETERS + prefetch)
    text = moe.describe("bf16")
    assert "top 8 of 128" in text and "1.12 GiB per layer" in text and "53.64 GiB per forward" in text


def test_built_in_qwen3_30b_a3b_counts():
    from multiengine.engines import known_models as K3

    info = K3.known_model_info("Qwen/Qwen3-30B-A3B")
    experts = 128 * 3 * 2048 * 768  # per layer
    attention = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128  # q, o; k, v (4 kv heads of 128); q and k norms
    layer = attention + 2 * 2048 + 128 * 2048 + experts  # + 2 norms, router
    assert info.params == 48 * layer + 2 * 151_936 * 2048 + 2048 == 30_532_122_624  # published: 30.5B
    moe = info.moe
    assert (moe.experts, moe.top_k, moe.layers, moe.block, moe.routed) == (128, 8, 48, experts, 48 * experts)
    assert moe.active == info.params - 48 * experts * 120 // 128 == 3_353_032_704  # published: 3.3B activated
    assert round(moe.expert_share, 3) == 0.950
    d = P.transformer_dims(info.config)
    assert (d.intermediate, d.kv_hidden) == (8 * 768, 512)


def test_shipped_grpo_config_plans_the_moe_actor(capsys, tmp_path):
    from multiengine.recipes.language import cli

    code = cli.main(["plan", "rlhf_grpo", "--config", "qwen3_30b_a3b", "--gpus", "8", "--gpu-mem", "80GiB", "--json"])
    result = json.loads(capsys.readouterr().out)[0]
    assert code == 0 and result["current"]["fits"]
    moe = result["roles"]["actor"]["moe"]
    assert (moe["total_params"], moe["active_params"]) == (30_532_122_624, 3_353_032_704)
    assert result["roles"]["ref"]["moe"] == moe and result["roles"]["reward"]["moe"] is None
    assert cli.main(["plan", "rlhf_grpo", "--config", "qwen3_30b_a3b", "--gpus", "8", "--gpu-mem", "80GiB"]) == 0
    assert "3,353,032,704 active parameters per token" in capsys.readouterr().out


def test_validate_refuses_the_vllm_engine_for_an_moe_actor(tmp_path):
    from multiengine.engines.settings import SettingsError
    from multiengine.pipelines.rlhf import tiny
    from multiengine.recipes.language.config import load_config, validate_config
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny.train_tokenizer(tiny.task_vocabulary(), tmp_path / "moe")
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tok), hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, architectures=["Qwen3MoeForCausalLM"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    cfg = load_config("rlhf_grpo", "tiny", [f"output_dir={tmp_path}/out", f"roles.actor.model={tmp_path}/moe",
                                            "generation.engine=vllm"])
    with pytest.raises(SettingsError) as err:
        validate_config("rlhf_grpo", cfg)
    text = str(err.value)
    assert text.count("\n") == 0 and "config key 'generation.engine'" in text
    assert "qwen3_moe" in text and "fix: generation.engine=hf" in text
    validate_config("rlhf_grpo", load_config("rlhf_grpo", "tiny", [f"output_dir={tmp_path}/out",
                                                                   f"roles.actor.model={tmp_path}/moe"]))  # hf runs it


def test_memory_report_counts_the_active_parameters():
    from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config

    registry = EngineRegistry(backend="deepspeed")
    registry.add(RoleSpec("ref", _tiny_qwen2_moe, eval_ds_config(stage=3, dtype="bf16")))
    registry.add(RoleSpec("dense", lambda: torch.nn.Linear(8, 8), eval_ds_config(stage=0, dtype="bf16")))
    rows = {row["role"]: row for row in registry.build().memory_report()}
    ref, dense = rows["ref"], rows["dense"]
    assert (ref["params_total"], ref["params_active"]) == (TOTAL, 16_224)
    assert ref["expert_share"] == pytest.approx(L * ROUTED / TOTAL)
    assert "MoE top 2 of 4: 16,224 active, experts 32% of the weights" in ref["note"]
    assert (dense["params_active"], dense["expert_share"], dense["note"]) == (72, 0.0, "")

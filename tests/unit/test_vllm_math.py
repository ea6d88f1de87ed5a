"""The pure parts of vLLM rollouts (engines/vllm_rollout.py, losses.py): the sync's units and names, the truncated
importance-sampling weights, the log-prob mismatch, and validate's refusals that need no engine."""

from __future__ import annotations

import math

import pytest
import torch
from multiengine.engines.settings import SettingsError
from multiengine.engines.vllm_rollout import RolloutEngineError, VLLMSettings, check_supported, sync_unit, weight_plan
from multiengine.pipelines.rlhf.losses import PolicyLossInputs, logprob_mismatch, truncated_is_weights
from multiengine.recipes.language.config import load_config, validate_config


def test_a_sync_unit_is_a_whole_decoder_layer_else_the_module():
    assert sync_unit("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert sync_unit("model.layers.3.mlp.gate_proj.weight") == "model.layers.3"  # fused with up_proj in vLLM
    assert sync_unit("model.decoder.layers.11.fc1.bias") == "model.decoder.layers.11"
    assert sync_unit("model.embed_tokens.weight") == "model.embed_tokens"
    assert sync_unit("lm_head.weight") == "lm_head"


def _tiny_llama(tie: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))


def test_the_plan_streams_checkpoint_names_layer_by_layer_with_the_tied_head_under_its_own_name():
    plan = weight_plan(_tiny_llama(tie=True))
    assert list(plan) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert [n for n, *_ in plan["lm_head"]] == ["lm_head.weight"]
    assert plan["lm_head"][0][2] is plan["model.embed_tokens"][0][2]  # the same tensor, sent under both names
    layer = {n for n, *_ in plan["model.layers.0"]}
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight"} <= layer


def test_a_lora_actor_streams_merged_weights_under_the_base_names():
    from multiengine.engines.vllm_rollout import stream_weights
    from peft import LoraConfig, get_peft_model

    base = _tiny_llama(tie=False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    names = {n for units in weight_plan(model).values() for n, *_ in units}
    assert names == set(dict(_tiny_llama(tie=False).named_parameters()))  # no lora_, no base_layer
    streamed = dict(stream_weights(model))
    merged = model.merge_and_unload()
    for name, tensor in merged.named_parameters():
        torch.testing.assert_close(streamed[name], tensor.detach())


def test_truncated_is_weights_are_the_capped_probability_ratio():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.2, -1.0, -3.0]])
    w = truncated_is_weights(old, rollout, cap=2.0)
    # exp(0.2), exp(-1), exp(2.5) = 12.18 capped at 2
    assert w.tolist()[0] == pytest.approx([math.exp(0.2), math.exp(-1.0), 2.0], rel=1e-6)
    assert not w.requires_grad


def test_the_weights_scale_each_tokens_policy_loss():
    per_token = torch.ones(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    x = PolicyLossInputs(per_token, per_token, per_token, mask, "token_mean", weights=torch.tensor([[0.5, 2.0, 9.0]]))
    assert float(x.reduce(per_token)) == pytest.approx((0.5 + 2.0) / 2)


def test_the_mismatch_is_the_mean_absolute_gap_over_actions():
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(logprob_mismatch(old, rollout, mask)) == pytest.approx((0.5 + 1.0 + 0.25) / 3)


def test_the_rollout_roles_defaults_are_the_engines():
    from multiengine.recipes.language.roles import RolloutRole

    role, engine = RolloutRole(), VLLMSettings()
    assert (role.kv_cache_gb, role.gpu_memory_utilization, role.sleep) == \
        (engine.kv_cache_gb, engine.gpu_memory_utilization, engine.sleep)


def test_what_vllm_cannot_run_on_cpu_is_refused_before_anything_starts():
    with pytest.raises(RolloutEngineError, match="head size 16") as err:
        check_supported({"hidden_size": 64, "num_attention_heads": 4}, VLLMSettings())
    assert err.value.what == "head_size"
    with pytest.raises(RolloutEngineError, match="needs GPUs"):
        check_supported({"hidden_size": 64, "num_attention_heads": 2}, VLLMSettings(tensor_parallel_size=2))


@pytest.mark.parametrize(("overrides", "key"), [
    (["generation.engine=vllm"], "tiny.heads"),  # the tiny OPT's head size 16
    (["generation.engine=vllm", "tiny.heads=2", "roles.rollout.max_model_len=10"], "roles.rollout.max_model_len"),
    (["generation.engine=vllm", "tiny.heads=2", "roles.rollout.tensor_parallel_size=2"],
     "roles.rollout.tensor_parallel_size"),
    (["generation.engine=vllm", "tiny.heads=2", "roles.rollout.gpu_memory_utilization=0.5"],
     "roles.rollout.gpu_memory_utilization"),  # GPU only
    (["roles.rollout.kv_cache_gb=2"], "roles.rollout.kv_cache_gb"),  # generation.engine=hf: no rollout engine
    (["grpo.rollout_is_cap=2"], "grpo.rollout_is_cap"),
])
def test_validate_refuses_a_rollout_setting_naming_the_key(overrides, key, tmp_path):
    with pytest.raises(SettingsError) as err:
        cfg = load_config("rlhf_grpo", "tiny", [f"output_dir={tmp_path}", *overrides])
        validate_config("rlhf_grpo", cfg)
    assert str(err.value).count("\n") == 0 and key in str(err.value)

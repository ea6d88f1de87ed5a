"""engines/moe: the load-balancing loss against transformers', router taps (recording, replay, packed passes), the
auxiliary term in the trained loss, generation of MoE configs that ask for router logits, and router replay's
effect on the rollout-vs-trainer log-prob mismatch in bf16."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from multiengine.engines import moe, packing

FAMILIES = {
    "mixtral": dict(num_local_experts=4),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, head_dim=8),
    "olmoe": dict(num_experts=4),
}


def tiny(family: str, seed: int = 0, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **{**FAMILIES.get(family, {}),
                                                                                       **extra})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def batch(rows: int = 3, width: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", FAMILIES)
def test_load_balancing_loss_is_transformers(family):
    model = tiny(family)
    ids, mask = batch()
    shape = moe.moe_shape(model.config)
    assert shape is not None and (shape.experts, shape.top_k) == (4, 2) and shape.aux_coef > 0
    assert len(moe.routers(model)) == 2
    lbl = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    with torch.no_grad(), moe.tapped(model) as tap:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    for m in (mask, None):
        ours = moe.load_balancing_loss(tap.logits, 2, m)
        theirs = lbl(out.router_logits, 4, 2, m)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    assert 1.0 < float(ours) < 4.0  # E * sum f_e P_e: top-2 of 4 experts, near balance for a random router


def test_dense_models_have_no_routers():
    model = tiny("llama")
    assert moe.moe_shape(model.config) is None and moe.routers(model) == []
    assert moe.router_logits_off(model) == {}
    with moe.tapped(model) as tap:
        assert tap is None
    assert moe.aux_term(model, None, None) == (0.0, {})


def test_the_auxiliary_term_is_the_one_transformers_adds_to_its_loss():
    # transformers' loss with output_router_logits: cross-entropy + coef x the aux loss over the attention mask;
    # aux_term over the same mask, added to the same cross-entropy, gives it (and its gradient)
    model = tiny("qwen3_moe").train()
    engine = types.SimpleNamespace(module=model, router_aux_coef=model.config.router_aux_loss_coef)
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    theirs = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True).loss
    with moe.tapped(model) as tap:
        ce = model(input_ids=ids, attention_mask=mask, labels=labels, **moe.router_logits_off(model)).loss
    term, figures = moe.aux_term(engine, tap, mask)
    assert float(ce + term) == pytest.approx(float(theirs), rel=1e-6)
    assert float(term) == pytest.approx(model.config.router_aux_loss_coef * figures["moe/aux_loss"], rel=1e-6)
    assert figures["moe/load_max"] >= 1.0 >= figures["moe/load_min"]
    (ce + term).backward()
    router = moe.routers(model)[0]
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    engine.router_aux_coef = 0.0  # the key at 0: off, figures still reported
    assert moe.aux_term(engine, tap, mask)[0] == 0.0


def test_replay_imposes_the_given_experts_and_the_router_still_learns():
    model = tiny("mixtral").train()
    ids, mask = batch()
    forced = torch.full((3, 10, 2, 2), -1, dtype=torch.int16)
    forced[..., 0], forced[..., 1] = 3, 1  # every token to experts 3 and 1
    forced[2, 5:] = -1  # these route as the router chooses
    with moe.tapped(model, forced) as tap:
        out = model(input_ids=ids, attention_mask=mask).logits
    used = tap.chosen((3, 10))
    assert (used[forced >= 0] == forced[forced >= 0].long()).all()
    assert tap.replayed == 3 * 10 - 5
    out.sum().backward()  # the weights of the imposed experts come from the router's own logits
    assert moe.routers(model)[0].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="3 MoE layers"):
        moe.RouterTap(model, torch.zeros(3, 10, 3, 2, dtype=torch.int16))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_packed_passes_map_routing_and_masks_through_the_packing(family):
    # a tap over a packed pass: the routing recorded on the padded rows, the aux loss over the same tokens and the
    # chosen experts read back in the padded layout equal the padded pass's
    model = tiny(family)
    ids, mask = batch(4, 12)
    padded = types.SimpleNamespace(module=model, packed_sequences=False)
    packed = types.SimpleNamespace(module=model, packed_sequences=True)

    with torch.no_grad(), moe.tapped(model) as tap:
        ref = packing.lm_forward(_Engine(padded), ids, mask)
    recorded, aux = tap.chosen((4, 12)), tap.aux_loss(mask)
    trained = mask.clone()
    trained[:, :6] = 0  # the tokens with a loss
    aux_trained = tap.aux_loss(trained)
    with torch.no_grad(), moe.tapped(model, recorded.masked_fill(mask.bool()[..., None, None] == 0, -1)) as tap:
        out = packing.lm_forward(_Engine(packed), ids, mask)
    assert tap.replayed == int(mask.sum())
    assert (tap.chosen((4, 12))[mask.bool()] == recorded[mask.bool()]).all()
    assert float(tap.aux_loss(mask)) == pytest.approx(float(aux), rel=1e-5)
    assert float(tap.aux_loss(trained)) == pytest.approx(float(aux_trained), rel=1e-5)
    assert torch.allclose(out[mask.bool()], ref[mask.bool()], atol=1e-5)


class _Engine:
    """A module called as an engine (packing reads ``packed_sequences``; moe unwraps ``module``)."""

    def __init__(self, ns):
        self.module, self.packed_sequences = ns.module, ns.packed_sequences

    def __call__(self, **kw):
        return self.module(**kw)


def test_generate_records_routing_and_works_when_the_config_asks_for_router_logits():
    # output_router_logits: true in the config makes transformers' own loss fail on the cached decoding step
    model = tiny("qwen3_moe", output_router_logits=True)
    ids, mask = batch(3, 6)
    with pytest.raises(RuntimeError, match="must match"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad(), moe.tapped(model, record=True) as tap:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             pad_token_id=0, **moe.router_logits_off(model))
    assert len(tap.passes) == 4  # the prefill, then one pass per token but the last
    routing = moe.generated_routing(tap.passes, 3, out.shape[1])
    assert routing.shape == (3, 10, 2, 2) and routing.dtype == torch.int16
    assert (routing[:, -1] == -1).all() and (routing[:, :-1] >= 0).all()
    # the recorded routing is what a full pass over the sequences chooses (fp32: no flips)
    full = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
    with torch.no_grad(), moe.tapped(model) as tap:
        model(input_ids=out, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0),
              **moe.router_logits_off(model))
    chosen = tap.chosen((3, 10))[:, :-1][full[:, :-1].bool()]
    assert (chosen.sort(-1).values == routing[:, :-1][full[:, :-1].bool()].long().sort(-1).values).all()


def mismatch(family: str, replay: bool, **sizes) -> tuple[float, float, int]:
    """Mean and max |trainer - sampler| log-prob of sampled tokens in bf16 (the sampler decodes with a KV cache,
    the trainer runs one full pass), and the tokens the trainer routed otherwise than the sampler."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"llama": {"head_dim": 32}, "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 256,
                                                      "head_dim": 32, "num_experts_per_tok": 2}}[family]
    config = AutoConfig.for_model(family, vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    B, C, T = 16, 48, 48
    ids = torch.randint(5, 512, (B, C), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, C, dtype=torch.long)
    mask[:6, :10] = 0
    torch.manual_seed(2)
    with torch.no_grad(), moe.tapped(model, record=True) as tap:
        out = model.generate(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, max_new_tokens=T,
                             min_new_tokens=T, do_sample=True, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=2, **moe.router_logits_off(model))
    seq = out.sequences
    routing = moe.generated_routing(tap.passes, B, seq.shape[1]) if tap is not None else None
    sampler = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, seq[:, C:, None]).squeeze(-1)
    full = torch.cat([mask, torch.ones(B, T, dtype=torch.long)], 1)
    with torch.no_grad(), moe.tapped(model, routing if replay else None) as tap:
        logits = model(input_ids=seq, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
    trainer = torch.log_softmax(logits[:, C - 1:-1].float(), -1).gather(-1, seq[:, C:, None]).squeeze(-1)
    flips = 0
    if routing is not None:
        used, kept = tap.chosen((B, seq.shape[1])), routing >= 0
        flips = int(((used.sort(-1).values != routing.long().sort(-1).values) & kept).any(-1)[full.bool()].sum())
    diff = (trainer - sampler).abs()
    return float(diff.mean()), float(diff.max()), flips


def test_router_replay_brings_the_mismatch_down_to_the_dense_models():
    dense_mean, dense_max, _ = mismatch("llama", False)
    own_mean, own_max, own_flips = mismatch("qwen3_moe", False)
    replay_mean, replay_max, replay_flips = mismatch("qwen3_moe", True)
    assert dense_mean > 0  # bf16: the cached decoding and the full pass differ
    assert own_flips > 0 and replay_flips == 0  # replayed routing is the recorded one, token for token
    assert replay_mean <= dense_mean * 1.1 and replay_max <= dense_max * 1.5
    assert own_mean > replay_mean and own_max > 2 * replay_max


ROUTERS = {  # every router kind transformers 5.x ships, beside FAMILIES': GPT-OSS's softmax over the top k,
    # DeepSeek-V3's sigmoid scores with a scaling factor; Qwen3-MoE without renormalising its top k
    "gpt_oss": dict(num_local_experts=4, head_dim=8, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=16),
    "deepseek_v3": dict(n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=0,
                        moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=4, n_shared_experts=1,
                        routed_scaling_factor=2.5),
    "qwen3_moe": dict(FAMILIES["qwen3_moe"], norm_topk_prob=False),
    "mixtral": FAMILIES["mixtral"],
}


@pytest.mark.parametrize("family", ROUTERS)
def test_replaying_a_models_own_routing_changes_nothing(family):
    # the weights replay gives the imposed experts are the ones the router's own forward gives them
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_experts_per_tok=2,
                                  **{"num_key_value_heads": 2, **ROUTERS[family]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, mask = batch()
    with torch.no_grad(), moe.tapped(model) as tap:
        own = model(input_ids=ids, attention_mask=mask).logits
    recorded = tap.chosen((3, 10))
    with torch.no_grad(), moe.tapped(model, recorded) as tap:
        replayed = model(input_ids=ids, attention_mask=mask).logits
    assert tap.replayed == 30
    assert torch.allclose(own, replayed, atol=1e-6)
    other = (recorded + 1) % 4  # each token to the next experts: other logits
    with torch.no_grad(), moe.tapped(model, other):
        assert not torch.allclose(own, model(input_ids=ids, attention_mask=mask).logits, atol=1e-3)

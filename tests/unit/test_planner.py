"""The memory planner: parameter counts from safetensors headers, per-rank byte formulas against
hand-derived values, activation formulas, and the placement chooser on small synthetic budgets."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from multiengine.engines import planner as P

GIB = 1024**3


# --- sizes -----------------------------------------------------------------------------------------
def test_parse_bytes():
    assert P.parse_bytes("80GiB") == 80 * GIB
    assert P.parse_bytes("80GB") == 80 * 10**9
    assert P.parse_bytes("512G") == 512 * GIB
    assert P.parse_bytes("1.5 TiB") == int(1.5 * 1024**4)
    for bad in ("80", "lots", "80 GiBs"):
        with pytest.raises(P.PlanError, match="give a number and a unit"):
            P.parse_bytes(bad, "--gpu-mem")


# --- parameter counts from files -------------------------------------------------------------------
def _tiny_opt(path, **kw):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32))
    model.save_pretrained(path, **kw)
    return model


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def test_safetensors_header_is_read_without_weights(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    header = P.read_safetensors_header(tmp_path / "x.safetensors")
    assert header["a.weight"]["dtype"] == "BF16" and header["a.weight"]["shape"] == [3, 4]
    assert header["b"]["dtype"] == "F32" and "__metadata__" not in header
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(P.PlanError, match="not a safetensors file"):
        P.read_safetensors_header(bad)
    bad.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(P.PlanError, match="not JSON"):
        P.read_safetensors_header(bad)


def test_counts_equal_the_loaded_models(tmp_path):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import AutoModelForCausalLM, CLIPTextConfig, CLIPTextModel

    opt = _tiny_opt(tmp_path / "opt")
    info = P.model_info(tmp_path / "opt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "opt")
    assert info.params == _numel(loaded) == _numel(opt)  # the tied lm_head is stored (and counted) once
    assert info.dtypes == {"F32": info.params} and info.class_name == "OPTForCausalLM"
    assert info.hidden_size == 32

    # a sharded checkpoint (index file) and a bf16 one
    _tiny_opt(tmp_path / "sharded", max_shard_size="20KB")
    assert any(p.name.endswith(".index.json") for p in (tmp_path / "sharded").iterdir())
    assert P.model_info(tmp_path / "sharded").params == info.params
    AutoModelForCausalLM.from_pretrained(tmp_path / "opt", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert P.model_info(tmp_path / "bf16").dtypes == {"BF16": info.params}

    clip = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, vocab_size=100, max_position_embeddings=16))
    clip.save_pretrained(tmp_path / "clip")
    assert P.model_info(tmp_path / "clip").params == _numel(CLIPTextModel.from_pretrained(tmp_path / "clip"))

    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=4, norm_num_groups=8)
    unet.save_pretrained(tmp_path / "unet")
    unet.save_pretrained(tmp_path / "unet", variant="fp16")  # a variant next to the plain weights
    uinfo = P.model_info(tmp_path / "unet")
    assert uinfo.params == _numel(UNet2DConditionModel.from_pretrained(tmp_path / "unet")) == _numel(unet)
    assert P.model_info(tmp_path / "unet", variant="fp16").params == uinfo.params
    assert uinfo.class_name == "UNet2DConditionModel"
    # no hidden_size in a UNet config: the widest Linear/Conv, as the registry sizes its buckets
    from multiengine.engines.config import model_hidden_size

    assert uinfo.hidden_size == model_hidden_size(unet)

    vae = AutoencoderKL(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8)
    vae.save_pretrained(tmp_path / "vae")
    assert P.model_info(tmp_path / "vae").params == _numel(AutoencoderKL.from_pretrained(tmp_path / "vae"))


def test_pipeline_components(tmp_path):
    from diffusers import StableDiffusionPipeline
    from multiengine.pipelines.diffusion.tiny import build_tiny_sd

    folder = build_tiny_sd(str(tmp_path / "sd"))
    parts = P.pipeline_info(folder)
    assert sorted(parts) == ["text_encoder", "unet", "vae"]  # tokenizer/scheduler have no weights
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    for name, info in parts.items():
        assert info.params == _numel(getattr(pipe, name)), name


def test_missing_or_weightless_folders(tmp_path):
    with pytest.raises(P.PlanError, match="does not exist"):
        P.model_info(tmp_path / "nope")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(P.PlanError, match="convert it to safetensors"):
        P.model_info(tmp_path / "bin")
    with pytest.raises(P.PlanError, match="model_index.json"):
        P.pipeline_info(tmp_path / "bin")


def test_lora_count_equals_peft(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = _tiny_opt(tmp_path / "opt")
    targets = ["q_proj", "v_proj", "fc1"]
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    info = P.model_info(tmp_path / "opt")
    assert P.lora_params(info.tensors, 4, targets) == trainable
    # hand-derived: 2 layers x (q 4(32+32) + v 4(32+32) + fc1 4(32+64))
    assert trainable == 2 * (256 + 256 + 384)


def test_persistent_params():
    assert P.persistence_threshold(64) == 640 and P.persistence_threshold(None) == 100_000
    assert P.persistent_params([10, 640, 641, 5000], 640) == 650


# --- model-state bytes -------------------------------------------------------------------------------
PSI, N = 1000, 4


@pytest.mark.parametrize("dtype,stage,oo,op,expected", [
    # bf16 (b = 2): params, grads, optimizer (fp32 master + m + v), host
    ("bf16", 0, False, False, (2000, 2000, 12000, 0)),
    ("bf16", 1, False, False, (2000, 2000, 3000, 0)),
    ("bf16", 2, False, False, (2000, 500, 3000, 0)),
    ("bf16", 3, False, False, (500, 500, 3000, 0)),
    ("bf16", 1, True, False, (2000, 2000, 0, 16 * 250 + 2 * 250)),  # stage-1 grads stay whole on the GPU
    ("bf16", 2, True, False, (2000, 0, 0, 16 * 250 + 2 * 250)),
    ("bf16", 3, True, False, (500, 0, 0, 16 * 250)),
    ("bf16", 3, True, True, (0, 0, 0, 16 * 250 + 500)),
    # fp32 (b = 4): no separate master at stage 0 (m + v = 8 bytes); ZeRO still keeps an fp32 partition copy
    ("fp32", 0, False, False, (4000, 4000, 8000, 0)),
    ("fp32", 1, False, False, (4000, 4000, 3000, 0)),
    ("fp32", 3, False, False, (1000, 1000, 3000, 0)),
])
def test_trainable_state_bytes(dtype, stage, oo, op, expected):
    s = P.state_bytes(PSI, dtype=dtype, stage=stage, world_size=N, trainable_params=PSI, offload_optimizer=oo,
                      offload_params=op)
    assert (s.params, s.grads, s.optimizer, s.host) == expected
    assert s.accelerator == sum(expected[:3])


def test_frozen_lora_persistent_and_padding():
    frozen = {st: P.state_bytes(PSI, dtype="bf16", stage=st, world_size=N) for st in (0, 1, 2, 3)}
    assert [(f.params, f.grads, f.optimizer) for f in frozen.values()] == [(2000, 0, 0)] * 3 + [(500, 0, 0)]
    off = P.state_bytes(PSI, dtype="bf16", stage=3, world_size=N, offload_params=True)
    assert (off.params, off.host) == (0, 500)
    # persistent parameters stay whole (on the GPU even with parameter offload)
    assert P.state_bytes(PSI, dtype="bf16", stage=3, world_size=N, persistent=100).params == 2 * (250 + 100)
    assert P.state_bytes(PSI, dtype="bf16", stage=3, world_size=N, persistent=100, offload_params=True).params == 200
    # DeepSpeed pads every tensor to ceil(n/N) at stage 3
    assert P.state_bytes(1000, dtype="bf16", stage=3, world_size=N, numels=[3, 997]).params == 2 * (1 + 250)
    # LoRA: the frozen base is partitioned like parameters, grads and optimizer cover the adapters only
    lora = P.state_bytes(PSI, dtype="bf16", stage=2, world_size=N, trainable_params=10)
    assert (lora.params, lora.grads, lora.optimizer) == (2000, 2 * 3, 12 * 3)
    with pytest.raises(P.PlanError, match="offload_params needs stage 3"):
        P.state_bytes(PSI, dtype="bf16", stage=2, world_size=N, offload_params=True)
    with pytest.raises(P.PlanError, match="offload_optimizer needs a trainable role"):
        P.state_bytes(PSI, dtype="bf16", stage=3, world_size=N, offload_optimizer=True)


def test_state_bytes_match_a_measured_deepspeed_run():
    """Bytes DeepSpeed 0.19 allocated per rank for a tiny OPT (141,184 parameters, 1,792 of them below
    the persistence threshold) on 2 CPU ranks after one AdamW step (registry.memory_report()), less
    AdamW's 4-byte step counters (36 tensors at stage 0, one flat group at stages 1-3)."""
    measured = {  # (dtype, stage): (param_bytes, grad_bytes, optimizer_bytes)
        ("fp32", 0): (564736, 564736, 1129616 - 144), ("fp32", 1): (564736, 564736, 847108 - 4),
        ("fp32", 2): (564736, 282368, 847108 - 4), ("fp32", 3): (289536, 282368, 847108 - 4),
        ("bf16", 0): (282368, 282368, 1694352 - 144), ("bf16", 1): (282368, 282368, 847108 - 4),
        ("bf16", 2): (282368, 141184, 847108 - 4), ("bf16", 3): (144768, 141184, 847108 - 4),
    }
    for (dtype, stage), expected in measured.items():
        s = P.state_bytes(141184, dtype=dtype, stage=stage, world_size=2, trainable_params=141184,
                          persistent=1792 if stage == 3 else 0)
        assert (s.params, s.grads, s.optimizer) == expected, (dtype, stage)


# --- activations -------------------------------------------------------------------------------------
def test_transformer_activation_formula_hand_derived():
    d = P.TransformerDims(hidden=4, layers=2, intermediate=16, vocab=10)  # GELU, MHA
    layer = 7 * 4 + 2 * 4 + 2 * 16  # = 68 elements per token
    args = dict(batch=1, seq=1, dtype="bf16")
    assert P.transformer_activation_bytes(d, trainable=True, **args) == 2 * (2 * layer) + 2 * 2 * 4
    assert P.transformer_activation_bytes(d, trainable=True, logits=True, **args) == 2 * 2 * layer + 16 + 10 * 10
    ckpt = P.transformer_activation_bytes(d, trainable=True, gradient_checkpointing=True, **args)
    assert ckpt == 2 * 4 * 2 + 2 * layer + 16
    assert P.transformer_activation_bytes(d, trainable=False, logits=True, **args) == 2 * layer + 16 + 10 * 6
    assert P.transformer_activation_bytes(d, trainable=True, batch=3, seq=5, dtype="fp32") == 15 * (4 * 2 * layer + 32)
    assert P.kv_cache_bytes(d, batch=1, seq=3, dtype="bf16") == 2 * 2 * 1 * 3 * 4 * 2
    llama = P.TransformerDims(hidden=8, layers=1, intermediate=16, kv_hidden=4, mlp="gated", rms_norm=True, rotary=True)
    assert P._layer_elements(llama, 2) == 7 * 8 + 2 * 4 + 4 * 16 + 2 * 8 + (8 + 4)
    assert P._layer_elements(llama, 4) == 7 * 8 + 2 * 4 + 4 * 16 + (8 + 4)  # no fp32 copies of fp32 activations


def test_transformer_dims_from_configs():
    from multiengine.engines.known_models import MODELS

    opt = P.transformer_dims(MODELS["facebook/opt-1.3b"].config)
    assert (opt.hidden, opt.layers, opt.intermediate, opt.mlp, opt.kv_hidden) == (2048, 24, 8192, "relu", None)
    llama = P.transformer_dims(MODELS["meta-llama/Meta-Llama-3-8B"].config)
    assert (llama.mlp, llama.kv, llama.rms_norm, llama.rotary, llama.vocab) == ("gated", 1024, True, True, 128256)
    t5 = P.transformer_dims(MODELS["google/t5-v1_1-xxl"].config)
    assert (t5.hidden, t5.intermediate, t5.mlp, t5.rms_norm) == (4096, 10240, "gated", True)


def test_activation_formulas_track_a_meta_device_count():
    """The formulas against the bytes autograd saves (benchmarks/activation_probe.py) on small models."""
    from transformers import LlamaConfig, OPTConfig

    from benchmarks.activation_probe import probe_causal_lm, probe_unet

    unet = {"sample_size": 16, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
            "block_out_channels": [32, 64, 64], "down_block_types": ["CrossAttnDownBlock2D"] * 2 + ["DownBlock2D"],
            "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 2, "cross_attention_dim": 32,
            "attention_head_dim": 8, "norm_num_groups": 8}
    counted = probe_unet(unet, batch=2, latent=16)
    formula = P.unet_activation_bytes(unet, batch=2, latent_height=16, latent_width=16, dtype="bf16")
    assert 0.9 < formula / counted < 1.1
    for config in (OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=256, num_attention_heads=4,
                             word_embed_proj_dim=64),
                   LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)):
        counted = probe_causal_lm(config, batch=2, seq=32)
        dims = P.transformer_dims(config.to_dict())
        formula = P.transformer_activation_bytes(dims, batch=2, seq=32, dtype="bf16", trainable=True, logits=True)
        formula -= 4 * 2 * 32 * dims.vocab  # the probe stops before the log-softmax's gradient
        assert 0.85 < formula / counted < 1.15, config.model_type


# --- the chooser -------------------------------------------------------------------------------------
def _roles(**kw):
    actor = P.RoleRequest("actor", params=10**9, dtype="bf16", trainable_params=10**9, current=P.Choice(2),
                          phases=(("train step", GIB),))
    ref = P.RoleRequest("ref", params=10**9, dtype="bf16", current=P.Choice(0), phases=(("forward", GIB // 4),))
    return [actor, ref]


def _budget(gib, world=8, **kw):
    return P.Budget(world_size=world, gpu_bytes=int(gib * GIB), **kw)


def _cost(roles, choices, world=8):
    budget = _budget(1000, world)
    options = [P.cost_role(r, c, world) for r, c in zip(roles, choices)]
    return P._totals(options, budget)[3]


def test_plenty_of_memory_keeps_everything_whole():
    p = P.plan(_roles(), _budget(80))
    assert p.fits and p.placements() == {"actor": P.Choice(0), "ref": P.Choice(0)}
    assert p.current_fits and "fits" in p.message
    # per GPU total = states + the largest transient + fixed, plus the margin
    states = 16 * 10**9 + 2 * 10**9
    transient = max(GIB, GIB // 4, 4 * 10**9)  # the fp32 gradients of the stage-0 step are the largest
    base = states + transient + P.CUDA_CONTEXT_BYTES + P.NCCL_BYTES
    assert p.total == base + int(base * P.FRAGMENTATION_MARGIN)


def test_the_lowest_stage_that_fits_is_chosen():
    roles = _roles()
    s0 = _cost(roles, [P.Choice(0), P.Choice(0)])
    s1 = _cost(roles, [P.Choice(1), P.Choice(0)])
    assert s1 < s0
    p = P.plan(roles, P.Budget(world_size=8, gpu_bytes=s1 + 1))
    assert p.fits and p.placements() == {"actor": P.Choice(1), "ref": P.Choice(0)}  # not stage 2/3, ref not sharded
    # a little less: the actor's stage 2 (same traffic as 1) before sharding the frozen ref
    p = P.plan(roles, P.Budget(world_size=8, gpu_bytes=s1 - 1))
    assert p.fits and p.placements()["actor"] == P.Choice(2) and p.placements()["ref"] == P.Choice(0)


def test_offload_only_when_no_sharding_fits():
    roles = _roles()
    all3 = _cost(roles, [P.Choice(3), P.Choice(3)])
    p = P.plan(roles, P.Budget(world_size=8, gpu_bytes=all3 + 1))
    assert p.fits and not any(c.offload_optimizer or c.offload_params for c in p.placements().values())
    p = P.plan(roles, P.Budget(world_size=8, gpu_bytes=all3 - 1))
    assert p.fits and p.placements()["actor"].offload_optimizer and not p.placements()["actor"].offload_params
    # the host must hold what is offloaded: 8 ranks x 16·Ψ/N bytes
    p = P.plan(roles, P.Budget(world_size=8, gpu_bytes=all3 - 1, host_bytes=10**9))
    assert not p.fits and "host memory" in p.message


def test_cannot_fit_names_the_biggest_role():
    roles = _roles() + [P.RoleRequest("reward", params=10**8, dtype="bf16", current=P.Choice(0))]
    p = P.plan(roles, _budget(2, world=1))
    assert not p.fits
    assert "does not fit" in p.message and "biggest role is 'actor'" in p.message
    # the reported placement is the leanest one
    assert p.placements()["actor"] == P.Choice(3, offload_optimizer=True, offload_params=True)
    assert p.current_fits is False


def test_followers_take_their_leaders_placement():
    actor, ref = _roles()
    ema = P.RoleRequest("ema", params=10**9, dtype="bf16", current=P.Choice(2), follows="actor")
    te2 = P.RoleRequest("te2", params=10**8, dtype="bf16", current=P.Choice(0), follows="ref", follows_all=True)
    roles = [actor, ref, ema, te2]
    for gib in (80, 20, 8):
        p = P.plan(roles, _budget(gib))
        chosen = p.placements()
        leader = chosen["actor"].stage
        assert chosen["ema"].stage == (0 if leader in (1, 2) else leader), gib
        assert chosen["te2"] == chosen["ref"], gib
    with pytest.raises(P.PlanError, match="follows 'nobody'"):
        P.plan([actor, P.RoleRequest("x", params=1, dtype="bf16", follows="nobody")], _budget(80))


def test_full_gather_phase_adds_the_whole_model_at_stage_3():
    ref = P.RoleRequest("ref", params=10**9, dtype="bf16", phases=(("forward", 0),), full_gather=("forward",))
    opt = P.cost_role(ref, P.Choice(3), 8)
    assert opt.states.params + opt.transient == 2 * 10**9  # the whole model is on every rank while it runs
    layerwise = P.cost_role(P.RoleRequest("ref", params=10**9, dtype="bf16", phases=(("forward", 0),)),
                            P.Choice(3), 8)
    assert layerwise.transient == 2 * (P.STAGE3_MAX_LIVE_PARAMETERS + int(5e7))


def test_plan_to_dict_is_json():
    p = P.plan(_roles(), _budget(80))
    data = json.loads(json.dumps(p.to_dict()))
    assert data["fits"] and data["roles"]["actor"]["chosen"]["stage"] == 0
    assert data["per_gpu"]["total"] == p.total
    assert "role actor" in P.format_plan(p)


def test_plan_text_names_lora_on_trainable_and_frozen_roles():
    # an EMA of a LoRA model carries the adapters but trains nothing: no "0 trainable" count
    roles = [P.RoleRequest("actor", params=1000, dtype="bf16", trainable_params=40, lora=True),
             P.RoleRequest("ema", params=1000, dtype="bf16", lora=True), P.RoleRequest("ref", params=960, dtype="bf16")]
    heads = [x for x in P.format_plan(P.plan(roles, _budget(80))).splitlines() if x.startswith("role ") and ":" in x]
    assert heads == ["role actor: 1,000 parameters (1.00K), bf16, trainable, LoRA, 40 trainable",
                     "role ema: 1,000 parameters (1.00K), bf16, frozen, with LoRA adapters",
                     "role ref: 960 parameters (960), bf16, frozen"]


def test_built_in_architectures_match_published_counts():
    from multiengine.engines import known_models as K

    published = {  # parameter totals of the released checkpoints
        "facebook/opt-350m": 331_196_416, "facebook/opt-1.3b": 1_315_758_080, "facebook/opt-13b": 12_853_473_280,
        "meta-llama/Meta-Llama-3-8B": 8_030_261_248, "openai/clip-vit-large-patch14": 123_060_480,
        "google/t5-v1_1-xxl": 4_762_310_656,
    }
    for name, count in published.items():
        assert K.known_model_info(name).params == count, name
    assert K.known_model_info("meta-llama/Llama-3.1-8B").params == published["meta-llama/Meta-Llama-3-8B"]
    pipelines = {
        "stable-diffusion-v1-5/stable-diffusion-v1-5": {"unet": 859_520_964, "vae": 83_653_863,
                                                        "text_encoder": 123_060_480},
        "stabilityai/stable-diffusion-xl-base-1.0": {"unet": 2_567_463_684, "text_encoder_2": 694_659_840},
        "stabilityai/stable-diffusion-3-medium-diffusers": {"transformer": 2_028_328_000},
        "black-forest-labs/FLUX.1-dev": {"transformer": 11_901_408_320, "text_encoder_2": 4_762_310_656},
    }
    for name, parts in pipelines.items():
        infos = K.known_pipeline_info(name)
        for component, count in parts.items():
            assert infos[component].params == count, (name, component)
    with pytest.raises(P.PlanError, match="not a built-in model"):
        K.known_model_info("acme/unknown-7b")

"""Tiny SDXL / SD3 / FLUX folders built offline: family detection, consistent components, and loading and
generating in their diffusers pipelines in a fresh process (no project code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from multiengine.pipelines.diffusion.data import shapes_captions
from multiengine.pipelines.diffusion.families import (
    FAMILIES,
    family_of_pipeline,
    family_roles,
    model_family,
)
from multiengine.pipelines.diffusion.tiny import build_t5_tokenizer, build_tiny


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny(family, str(root / family), seed=0, resolution=32) for family in FAMILIES}


def _index(path: str) -> dict:
    with open(os.path.join(path, "model_index.json")) as f:
        return json.load(f)


def test_model_family_and_roles(folders):
    for family, path in folders.items():
        assert model_family(path) == family
        roles = family_roles(family)
        index = _index(path)
        assert index["_class_name"] == roles.pipeline
        for component in (roles.denoiser, "vae", *roles.text_encoders, *roles.tokenizers, "scheduler"):
            assert index[component][0], (family, component)
        assert roles.frozen == ("vae", *roles.text_encoders)
    assert family_roles("sd3").text_encoders == ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert family_roles("flux").tokenizers == ("tokenizer", "tokenizer_2")
    assert family_roles("sdxl").denoiser == "unet" and family_roles("flux").denoiser == "transformer"
    assert [family_roles(f).objective for f in FAMILIES] == ["ddpm", "ddpm", "flow", "flow"]
    assert family_of_pipeline("StableDiffusionControlNetPipeline") == "sd"


def test_model_family_errors(tmp_path, folders):
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        model_family(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(ValueError, match="KandinskyPipeline.*supported pipelines: .*FluxPipeline"):
        model_family(str(tmp_path))
    index = _index(folders["sd3"])
    index["text_encoder_3"] = [None, None]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"\['text_encoder_3'\]"):
        model_family(str(tmp_path))
    with pytest.raises(ValueError, match="family='sd2'"):
        family_roles("sd2")
    with pytest.raises(ValueError, match="family='sd2'"):
        build_tiny("sd2", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="multiple of 4"):
        build_tiny("sd3", str(tmp_path / "y"), resolution=30)


def test_components_fit_together(folders):
    from diffusers import AutoencoderKL, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import AutoConfig

    cfg = lambda path, sub: AutoConfig.from_pretrained(path, subfolder=sub)  # noqa: E731
    sd3, flux = folders["sd3"], folders["flux"]
    t = SD3Transformer2DModel.load_config(sd3, subfolder="transformer")
    vae = AutoencoderKL.load_config(sd3, subfolder="vae")
    assert t["in_channels"] == vae["latent_channels"] == 16 and vae["shift_factor"] == 0.0
    clip_l, clip_g, t5 = cfg(sd3, "text_encoder"), cfg(sd3, "text_encoder_2"), cfg(sd3, "text_encoder_3")
    assert t["joint_attention_dim"] == t5.d_model >= clip_l.hidden_size + clip_g.hidden_size
    assert t["pooled_projection_dim"] == clip_l.projection_dim + clip_g.projection_dim
    f = FluxTransformer2DModel.load_config(flux, subfolder="transformer")
    assert f["in_channels"] == 4 * AutoencoderKL.load_config(flux, subfolder="vae")["latent_channels"]
    assert f["joint_attention_dim"] == cfg(flux, "text_encoder_2").d_model
    assert f["pooled_projection_dim"] == cfg(flux, "text_encoder").hidden_size and f["guidance_embeds"]
    assert sum(f["axes_dims_rope"]) == f["attention_head_dim"]


def test_t5_tokenizer(tmp_path, folders):
    from transformers import AutoTokenizer, T5EncoderModel, T5TokenizerFast

    tok = T5TokenizerFast.from_pretrained(build_t5_tokenizer(str(tmp_path / "t5")))
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a red square on a white background").input_ids
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "a red square on a white background"
    batch = tok(shapes_captions()[:2], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
    assert batch.input_ids.shape == (2, 24) and (batch.input_ids[:, -1] == tok.pad_token_id).all()
    assert tok.convert_ids_to_tokens(ids[:3]) == ["\u2581a", "\u2581red", "\u2581square"]  # one piece per word
    odd = tok("Zebra, 42 héllo").input_ids  # unseen words fall back to characters; non-ASCII ones are <unk>
    assert max(odd) < len(tok) and odd.count(tok.unk_token_id) == 1
    assert tok.decode(odd, skip_special_tokens=True) == "Zebra, 42 hllo"
    # the folder's tokenizer and encoder agree on the vocabulary, and AutoTokenizer finds the T5 class
    loaded = AutoTokenizer.from_pretrained(folders["sd3"], subfolder="tokenizer_3")
    encoder = T5EncoderModel.from_pretrained(folders["sd3"], subfolder="text_encoder_3")
    assert encoder.config.vocab_size == len(loaded) and type(loaded).__name__.startswith("T5Tokenizer")
    with torch.no_grad():
        out = encoder(loaded(["a blue circle"], return_tensors="pt").input_ids)[0]
    assert out.shape[-1] == 64 and torch.isfinite(out).all()


def test_idempotent(folders):
    path = folders["flux"]
    weights = os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert build_tiny("flux", path) == path and os.stat(weights).st_mtime_ns == before
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".tiny_")]


FRESH = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from diffusers import DiffusionPipeline

    out = {}
    for family, path in json.loads(sys.argv[1]).items():
        pipe = DiffusionPipeline.from_pretrained(path)
        kwargs = {"max_sequence_length": 32} if family in ("sd3", "flux") else {}
        run = lambda seed: pipe("a red square on a white background", num_inference_steps=2, height=32, width=32,
                                generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs).images
        a, b, c = run(0), run(0), run(1)
        out[family] = {"class": type(pipe).__name__, "shape": list(a.shape), "finite": bool(np.isfinite(a).all()),
                       "same": bool((a == b).all()), "differs": bool((a != c).any())}
    print("RESULT" + json.dumps(out))
    """
)


def test_folders_generate_with_diffusers_alone_in_a_fresh_process(folders):
    paths = {f: folders[f] for f in ("sdxl", "sd3", "flux")}
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(paths)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"),
                          cwd=os.path.dirname(folders["sd"]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    expected = {"sdxl": "StableDiffusionXLPipeline", "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
    for family, cls in expected.items():
        r = out[family]
        assert r["class"] == cls and r["shape"] == [1, 32, 32, 3], (family, r)
        assert r["finite"] and r["same"] and r["differs"], (family, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_exist_in_the_tiny_denoisers(folders, family):
    """diffusers' default LoRA target modules of each family match modules of its tiny denoiser (peft)."""
    from multiengine.pipelines.diffusion.models import load_component
    from peft import LoraConfig

    roles = family_roles(family)
    model = load_component(folders[family], roles.denoiser)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian",
                                 target_modules=list(roles.lora_targets)))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    for target in roles.lora_targets:
        assert any(n == target or n.endswith("." + target) for n in adapted), (family, target)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


def test_sdxl_embeddings_and_time_ids_equal_the_pipeline(folders):
    """DiffusionObjective on the tiny SDXL: prompt embeddings, pooled embedding and micro-conditioning as
    StableDiffusionXLPipeline builds them."""
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline
    from multiengine.engines import EngineRegistry, RoleSpec, eval_ds_config, train_ds_config
    from multiengine.pipelines.diffusion.models import load_component
    from multiengine.pipelines.diffusion.training import DiffusionObjective, prompt_input_ids

    path = folders["sdxl"]
    registry = EngineRegistry(backend="torch")
    registry.add(RoleSpec("unet", lambda: load_component(path, "unet"), train_ds_config(stage=0, dtype="fp32"),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    for name in family_roles("sdxl").frozen:
        registry.add(RoleSpec(name, lambda name=name: load_component(path, name), eval_ds_config(dtype="fp32")))
    registry.build()
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    objective = DiffusionObjective(registry, ["text_encoder", "text_encoder_2"], scheduler, resolution=32)
    pipe = StableDiffusionXLPipeline.from_pretrained(path)
    captions = shapes_captions()[:2]
    ids = prompt_input_ids([pipe.tokenizer, pipe.tokenizer_2], captions)
    hidden, pooled = objective.encode_prompts([ids["input_ids"], ids["input_ids_2"]])
    with torch.no_grad():
        ref, _, ref_pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
    torch.testing.assert_close(hidden, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-6)
    batch = {"original_sizes": torch.tensor([[40, 48], [32, 32]]), "crop_top_lefts": torch.tensor([[4, 8], [0, 0]])}
    expected = torch.stack([pipe._get_add_time_ids((40, 48), (4, 8), (32, 32), torch.float32, 32)[0],
                            pipe._get_add_time_ids((32, 32), (0, 0), (32, 32), torch.float32, 32)[0]])
    torch.testing.assert_close(objective.time_ids(batch, 2), expected)

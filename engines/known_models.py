"""Built-in architectures for planning models that are not on this machine (hub names in shipped configs).

Each entry is the model's published ``config.json`` values (the keys that change its size), so the
parameter count comes from building the real class on PyTorch's meta device: shapes only, no weights,
no download. The published totals are in tests/unit/test_planner.py. transformers and diffusers are
imported only when an entry is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .planner import ModelInfo, PlanError, TensorEntry


@dataclass(frozen=True)
class KnownModel:
    library: str  # "transformers" | "diffusers"
    class_name: str
    config: dict[str, Any]
    stored_dtype: str = "F32"  # how the published weights are stored (safetensors dtype name)
    source: str = ""  # where the config values come from

    def info(self, name: str) -> ModelInfo:
        return _build(name, self)


def _opt(hidden: int, layers: int, heads: int, ffn: int, proj: int, before: bool = True) -> KnownModel:
    return KnownModel("transformers", "OPTForCausalLM", {
        "model_type": "opt", "vocab_size": 50272, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "ffn_dim": ffn, "max_position_embeddings": 2048,
        "word_embed_proj_dim": proj, "do_layer_norm_before": before, "activation_function": "relu",
    }, "F16", "config.json of the facebook/opt-* checkpoints")


_CLIP_L = {"model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
           "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77,
           "hidden_act": "quick_gelu", "projection_dim": 768}
_CLIP_G = {"model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120,
           "num_hidden_layers": 32, "num_attention_heads": 20, "max_position_embeddings": 77,
           "hidden_act": "gelu", "projection_dim": 1280}
_T5_XXL = {"model_type": "t5", "vocab_size": 32128, "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_layers": 24,
           "num_heads": 64, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
           "is_encoder_decoder": False}
_SD_VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [128, 256, 512, 512],
           "layers_per_block": 2, "latent_channels": 4, "norm_num_groups": 32, "sample_size": 512}
_VAE_16 = dict(_SD_VAE, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, sample_size=1024)
_SD15_UNET = {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
              "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
              "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
              "block_out_channels": [320, 640, 1280, 1280], "cross_attention_dim": 768, "attention_head_dim": 8,
              "norm_num_groups": 32}
_SDXL_UNET = {"sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
              "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
              "block_out_channels": [320, 640, 1280], "transformer_layers_per_block": [1, 2, 10],
              "attention_head_dim": [5, 10, 20], "cross_attention_dim": 2048, "use_linear_projection": True,
              "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
              "projection_class_embeddings_input_dim": 2816, "norm_num_groups": 32}
_SD3_MEDIUM = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
               "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
               "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192}
_FLUX_DEV = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
             "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
             "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]}
_LLAMA3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "rms_norm_eps": 1e-5}
_QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                  "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6}

MODELS: dict[str, KnownModel] = {
    "facebook/opt-350m": _opt(1024, 24, 16, 4096, 512, before=False),
    "facebook/opt-1.3b": _opt(2048, 24, 32, 8192, 2048),
    "facebook/opt-13b": _opt(5120, 40, 40, 20480, 5120),
    "meta-llama/Meta-Llama-3-8B": KnownModel("transformers", "LlamaForCausalLM", _LLAMA3_8B, "BF16",
                                             "config.json of meta-llama/Meta-Llama-3-8B"),
    "Qwen/Qwen3-30B-A3B": KnownModel("transformers", "Qwen3MoeForCausalLM", _QWEN3_30B_A3B, "BF16",
                                     "config.json of Qwen/Qwen3-30B-A3B"),
    "openai/clip-vit-large-patch14": KnownModel("transformers", "CLIPTextModel", _CLIP_L, "F32",
                                                "text_config of openai/clip-vit-large-patch14 (CLIP-L)"),
    "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k": KnownModel(
        "transformers", "CLIPTextModelWithProjection", _CLIP_G, "F32", "SDXL's text_encoder_2 config (CLIP-G)"),
    "google/t5-v1_1-xxl": KnownModel("transformers", "T5EncoderModel", _T5_XXL, "F32",
                                     "config.json of google/t5-v1_1-xxl, encoder only (as SD3/FLUX load it)"),
}
ALIASES = {
    "meta-llama/Meta-Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.1-8B": "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
    "Qwen/Qwen3-30B-A3B-Base": "Qwen/Qwen3-30B-A3B",
    "runwayml/stable-diffusion-v1-5": "stable-diffusion-v1-5/stable-diffusion-v1-5",
    "CompVis/stable-diffusion-v1-4": "stable-diffusion-v1-5/stable-diffusion-v1-5",
}


def _diffusers(cls: str, config: dict[str, Any], dtype: str, source: str) -> KnownModel:
    return KnownModel("diffusers", cls, config, dtype, source)


def _te(config: dict[str, Any], projection: bool, dtype: str = "F32") -> KnownModel:
    cls = "CLIPTextModelWithProjection" if projection else "CLIPTextModel"
    return KnownModel("transformers", cls, config, dtype, "CLIP-L" if config is _CLIP_L else "CLIP-G")


PIPELINES: dict[str, dict[str, KnownModel]] = {
    "stable-diffusion-v1-5/stable-diffusion-v1-5": {
        "unet": _diffusers("UNet2DConditionModel", _SD15_UNET, "F32", "SD 1.5 unet/config.json"),
        "vae": _diffusers("AutoencoderKL", _SD_VAE, "F32", "SD 1.5 vae/config.json"),
        "text_encoder": _te(_CLIP_L, projection=False),
    },
    "stabilityai/stable-diffusion-xl-base-1.0": {
        "unet": _diffusers("UNet2DConditionModel", _SDXL_UNET, "F32", "SDXL base unet/config.json"),
        "vae": _diffusers("AutoencoderKL", dict(_SD_VAE, sample_size=1024), "F32", "SDXL vae/config.json"),
        "text_encoder": _te(_CLIP_L, projection=False),
        "text_encoder_2": _te(_CLIP_G, projection=True),
    },
    "stabilityai/stable-diffusion-3-medium-diffusers": {
        "transformer": _diffusers("SD3Transformer2DModel", _SD3_MEDIUM, "F16", "SD3-medium transformer/config.json"),
        "vae": _diffusers("AutoencoderKL", _VAE_16, "F16", "SD3 vae/config.json"),
        "text_encoder": _te(_CLIP_L, projection=True, dtype="F16"),
        "text_encoder_2": _te(_CLIP_G, projection=True, dtype="F16"),
        "text_encoder_3": KnownModel("transformers", "T5EncoderModel", _T5_XXL, "F16", "T5-XXL encoder"),
    },
    "black-forest-labs/FLUX.1-dev": {
        "transformer": _diffusers("FluxTransformer2DModel", _FLUX_DEV, "BF16", "FLUX.1-dev transformer/config.json"),
        "vae": _diffusers("AutoencoderKL", _VAE_16, "BF16", "FLUX.1-dev vae/config.json"),
        "text_encoder": _te(_CLIP_L, projection=False, dtype="BF16"),
        "text_encoder_2": KnownModel("transformers", "T5EncoderModel", _T5_XXL, "BF16", "T5-XXL encoder"),
    },
}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def is_known(name: str) -> bool:
    name = canonical(name)
    return name in MODELS or name in PIPELINES


def known_names() -> list[str]:
    return sorted([*MODELS, *PIPELINES, *ALIASES])


def known_model_info(name: str) -> ModelInfo:
    """ModelInfo of a built-in single model (an LM, a text encoder)."""
    key = canonical(name)
    if key not in MODELS:
        raise PlanError(f"'{name}' is not a built-in model; built-in: {', '.join(known_names())}.")
    return _build(key, MODELS[key])


def known_pipeline_info(name: str) -> dict[str, ModelInfo]:
    """Per component ModelInfo of a built-in diffusers pipeline."""
    key = canonical(name)
    if key not in PIPELINES:
        raise PlanError(f"'{name}' is not a built-in pipeline; built-in: {', '.join(sorted(PIPELINES))}.")
    return {component: _build(f"{key}/{component}", m) for component, m in PIPELINES[key].items()}


@functools.cache
def _build_cached(name: str, library: str, class_name: str, config_items: tuple) -> ModelInfo:
    import torch

    config = _thaw(config_items)
    if library == "transformers":
        import transformers

        cfg = transformers.AutoConfig.for_model(**config)
        cls = getattr(transformers, class_name)
        with torch.device("meta"):
            model = cls(cfg)
        full_config = cfg.to_dict()
    else:
        import diffusers

        cls = getattr(diffusers, class_name)
        with torch.device("meta"):
            model = cls(**config)
        full_config = dict(model.config)
    tensors = tuple(TensorEntry(n, tuple(p.shape), "") for n, p in model.named_parameters())
    return ModelInfo(source=f"built-in: {name}", tensors=tensors, config=full_config, class_name=class_name)


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("__list__", tuple(_freeze(v) for v in value))
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and value and value[0] == "__list__":
        return [_thaw(v) for v in value[1]]
    if isinstance(value, tuple):
        return {k: _thaw(v) for k, v in value}
    return value


def _build(name: str, m: KnownModel) -> ModelInfo:
    info = _build_cached(name, m.library, m.class_name, _freeze(m.config))
    tensors = tuple(TensorEntry(t.name, t.shape, m.stored_dtype) for t in info.tensors)
    return ModelInfo(source=info.source + (f" ({m.source})" if m.source else ""), tensors=tensors,
                     config=info.config, class_name=info.class_name)


__all__ = ["ALIASES", "MODELS", "PIPELINES", "KnownModel", "canonical", "is_known", "known_model_info",
           "known_names", "known_pipeline_info"]

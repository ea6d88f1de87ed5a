"""The planner's activation formulas vs the bytes autograd really saves, counted on the meta device.

A model is built on PyTorch's meta device (shapes only), run forward on meta inputs under
``torch.autograd.graph.saved_tensors_hooks``, and every tensor saved for backward is counted once,
parameters excluded. Attention goes through a stand-in for ``scaled_dot_product_attention`` that saves
what the fused GPU kernels save (q, k, v, output and the log-sum-exp), not the s x s probabilities
PyTorch's math fallback would keep. No weights, no accelerator, a few seconds per model.

    python -m benchmarks.activation_probe            # table + benchmarks/results/activation_probe.json
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def fused_attention_stub(counter: list[int]) -> Iterator[None]:
    """scaled_dot_product_attention on meta tensors, counting what a flash/memory-efficient kernel saves."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(*args: Any, **kwargs: Any):
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")[len(args):]])[:3]
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            lse = q.shape[0] * q.shape[1] * q.shape[2] * 4 if q.dim() == 4 else 0
            counter[0] += sum(t.numel() * t.element_size() for t in (q, k, v, out)) + lse
            out.requires_grad_(True)
        return out

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def saved_bytes(model: torch.nn.Module, run: Callable[[torch.nn.Module], Any]) -> int:
    """Bytes of the activations autograd saves during ``run(model)``, each tensor once, parameters excluded."""
    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    keep: list[torch.Tensor] = []
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in seen and id(base) not in params and not isinstance(base, torch.nn.Parameter):
            seen.add(id(base))
            keep.append(base)
            total[0] += base.numel() * base.element_size()
        return t

    attention = [0]
    with fused_attention_stub(attention), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model)
    return total[0] + attention[0]


def _meta(build: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        model = build()
    return model.to(dtype).train()


def probe_unet(config: dict[str, Any], batch: int, latent: int, dtype: torch.dtype = torch.bfloat16) -> int:
    from diffusers import UNet2DConditionModel

    model = _meta(lambda: UNet2DConditionModel(**config), dtype)
    cross = config.get("cross_attention_dim", 768)
    kwargs: dict[str, Any] = {}
    if config.get("addition_embed_type") == "text_time":
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(batch, pooled, device="meta", dtype=dtype),
                                       "time_ids": torch.empty(batch, 6, device="meta", dtype=dtype)}

    def run(m: torch.nn.Module) -> Any:
        x = torch.empty(batch, config.get("in_channels", 4), latent, latent, device="meta", dtype=dtype)
        t = torch.zeros(batch, device="meta", dtype=torch.long)
        text = torch.empty(batch, 77, cross, device="meta", dtype=dtype)
        return m(x, t, text, **kwargs).sample

    return saved_bytes(model, run)


def probe_causal_lm(config: Any, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16) -> int:
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    model = _meta(lambda: AutoModelForCausalLM.from_config(config), dtype)

    def run(m: torch.nn.Module) -> Any:
        ids = torch.zeros(batch, seq, device="meta", dtype=torch.long)
        logits = m(input_ids=ids).logits
        return torch.nn.functional.log_softmax(logits.float(), dim=-1)

    return saved_bytes(model, run)


def probe_dit(class_name: str, config: dict[str, Any], batch: int, res: int, text_tokens: int,
              dtype: torch.dtype = torch.bfloat16) -> int:
    import diffusers

    model = _meta(lambda: getattr(diffusers, class_name)(**config), dtype)
    latent = res // 8

    def run(m: torch.nn.Module) -> Any:
        text = torch.empty(batch, text_tokens, config["joint_attention_dim"], device="meta", dtype=dtype)
        pooled = torch.empty(batch, config["pooled_projection_dim"], device="meta", dtype=dtype)
        t = torch.zeros(batch, device="meta", dtype=dtype)
        if class_name == "FluxTransformer2DModel":
            n = (latent // 2) ** 2
            x = torch.empty(batch, n, config["in_channels"], device="meta", dtype=dtype)
            return m(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                     img_ids=torch.zeros(n, 3, device="meta"), txt_ids=torch.zeros(text_tokens, 3, device="meta"),
                     guidance=t).sample
        x = torch.empty(batch, config["in_channels"], latent, latent, device="meta", dtype=dtype)
        return m(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=t).sample

    return saved_bytes(model, run)


def rows() -> list[list[Any]]:
    from multiengine.engines import known_models as K
    from multiengine.engines import planner as P
    from transformers import AutoConfig

    out = []
    for name, res, batch in (("stable-diffusion-v1-5/stable-diffusion-v1-5", 512, 1),
                             ("stabilityai/stable-diffusion-xl-base-1.0", 1024, 1)):
        cfg = K.PIPELINES[name]["unet"].config
        measured = probe_unet(cfg, batch, res // 8)
        formula = P.unet_activation_bytes(cfg, batch=batch, latent_height=res // 8, latent_width=res // 8,
                                          dtype="bf16", text_tokens=77)
        out.append([f"{name} unet", f"{res}px x {batch}", measured, formula])
    for name, res, batch, text in (("stabilityai/stable-diffusion-3-medium-diffusers", 1024, 1, 333),
                                   ("black-forest-labs/FLUX.1-dev", 1024, 1, 512)):
        m = K.PIPELINES[name]["transformer"]
        measured = probe_dit(m.class_name, m.config, batch, res, text)
        dims = P.dit_dims(m.config)
        tokens = P.dit_tokens(m.config, height=res, width=res, text_tokens=text)
        formula = P.transformer_activation_bytes(dims, batch=batch, seq=tokens, dtype="bf16", trainable=True)
        out.append([f"{name} transformer", f"{res}px x {batch}, {text} text tokens", measured, formula])
    for name, batch, seq in (("facebook/opt-1.3b", 4, 512), ("meta-llama/Meta-Llama-3-8B", 1, 2048)):
        m = K.MODELS[name]
        config = AutoConfig.for_model(**m.config)
        measured = probe_causal_lm(config, batch, seq)
        dims = P.transformer_dims(config.to_dict())
        # the probe's forward stops at the fp32 log-softmax: the formula's logits gradient (4·b·s·V) is not in it
        formula = P.transformer_activation_bytes(dims, batch=batch, seq=seq, dtype="bf16", trainable=True,
                                                 logits=True) - 4 * batch * seq * dims.vocab
        out.append([name, f"{batch} x {seq} tokens", measured, formula])
    return out


def main() -> None:
    from benchmarks.common import table, write_results

    data = rows()
    gib = 1024**3
    print("Activations saved for backward (bf16, no checkpointing): meta-device count vs the planner's formula\n")
    print(table(["model", "input", "counted GiB", "formula GiB", "formula/counted"],
                [[r[0], r[1], round(r[2] / gib, 2), round(r[3] / gib, 2), round(r[3] / r[2], 2)] for r in data]))
    keys = ("model", "input", "counted_bytes", "formula_bytes")
    path = write_results("activation_probe", {"rows": [dict(zip(keys, r)) for r in data]},
                         command="python -m benchmarks.activation_probe " + " ".join(sys.argv[1:]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

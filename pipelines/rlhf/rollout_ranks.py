"""Rollouts generated on rollout ranks (``roles.rollout.ranks``): the trainer's client and the rollout rank's loop.

Each trainer rank sends its prompts (each repeated ``n_samples_per_prompt`` times) to the rollout rank that serves it
(:meth:`RankLayout.server_of`) and gets back the answers and the sampler's log-probs; it scores them itself (ref,
reward sources, its own log-probs) when it trains on them. Before a batch is launched with newer weights than the
rollout ranks hold, trainer rank 0 broadcasts the actor's weights to them, one layer at a time, gathered from ZeRO-3
shards by every trainer rank together. A rollout rank runs transformers ``generate`` on its own copy of the actor
(built from the actor's folder) or a vLLM engine (``generation.engine=vllm``). Messages, in the order every trainer
rank sends them: ``start`` (folder, settings), then ``weights`` / ``generate`` as the schedule asks, then ``stop``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
from multiengine.engines import EngineRegistry
from multiengine.engines.placement import Bridge
from multiengine.engines.vllm_rollout import stream_units

from .generation import GenerationSettings, engine_generate, module_generate
from .rollout import RolloutSpec, expand_prompts, sampling_seed

logger = logging.getLogger(__name__)

__all__ = ["RemoteRollouts", "serve_rollouts"]


class RemoteRollouts:
    """A trainer rank's side: ``launch``/``land`` for a :class:`RolloutQueue`. ``start``: what a rollout rank needs
    to build its engine (``folder``: the actor's, ``dtype``, ``vllm``: VLLMSettings or None)."""

    def __init__(self, bridge: Bridge, registry: EngineRegistry, spec: RolloutSpec, n_samples: int,
                 start: dict[str, Any]) -> None:
        self.bridge, self.registry, self.spec, self.n = bridge, registry, spec, n_samples
        self.server = bridge.layout.server_of(registry.rank)
        self.published: int | None = None  # the version the rollout ranks hold (None: the folder's)
        self.sync = {"sync_s": 0.0, "sync_bytes": 0.0}  # weight broadcasts since the last take_sync
        g = spec.generation
        sampling = {k: getattr(g, k) for k in ("max_new_tokens", "temperature", "top_k", "top_p", "do_sample")}
        vllm = dataclasses.asdict(start["vllm"]) if start.get("vllm") is not None else None
        bridge.send({"kind": "start", **start, "generation": sampling, "vllm": vllm}, self.server)
        self.engine = bridge.recv(self.server)  # what the rollout rank built: engine, parameters, bytes

    def publish(self, version: int) -> None:
        """The actor's current weights to every rollout rank (collective over the trainer ranks under ZeRO-3)."""
        self.bridge.send({"kind": "weights", "version": version}, self.server)
        units = stream_units(self.registry.role(self.spec.actor).module)
        t0 = time.perf_counter()
        if self.registry.rank == 0:
            stats = self.bridge.send_weights(units)
            self.sync["sync_bytes"] += stats.bytes
        else:
            for _ in units:  # the gathers, together with rank 0
                pass
        self.sync["sync_s"] += time.perf_counter() - t0
        self.published = version

    def launch(self, batch: dict[str, Any], index: int, version: int) -> dict[str, Any]:
        if self.published != version:
            self.publish(version)
        rows = expand_prompts(batch, self.n)
        self.bridge.send({"kind": "generate", "index": index, "version": version,
                          "seed": sampling_seed(self.spec.seed, index, self.registry.rank),
                          "input_ids": rows["input_ids"].cpu(), "attention_mask": rows["attention_mask"].cpu(),
                          "ids": (self.spec.eos_token_id, self.spec.pad_token_id)}, self.server)
        return {"batch": batch, "index": index}

    def land(self, handle: dict[str, Any]) -> dict[str, Any]:
        reply = self.bridge.recv(self.server)
        assert isinstance(reply, dict)
        if reply.get("index") != handle["index"]:
            raise RuntimeError(f"rollout rank {self.server} answered batch {reply.get('index')}, expected "
                               f"{handle['index']}")
        sync, self.sync = self.sync, {"sync_s": 0.0, "sync_bytes": 0.0}
        return {**handle, "response": reply["response"], "rollout_logprobs": reply["logprobs"],
                "timings": {**reply["timings"], **sync}}

    def close(self) -> None:
        self.bridge.send({"kind": "stop"}, self.server)


def _device() -> torch.device:
    """This rollout rank's device: its GPU (LOCAL_RANK), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cuda", torch.cuda.current_device())


def _build(start: dict[str, Any]) -> tuple[Any, bool]:
    """The rollout rank's engine: a vLLM engine, or the actor's folder as a transformers model."""
    device = _device()
    if start.get("vllm") is not None:
        from multiengine.engines.vllm_rollout import VLLMRollout, VLLMSettings

        return VLLMRollout(start["folder"], VLLMSettings(**start["vllm"]), device.type), True
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[start["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(start["folder"], dtype=dtype).to(device).eval()
    return model, False


def _load(engine: Any, vllm: bool, weights: Any, version: int) -> None:
    if vllm:
        engine.load(weights, version)
        return
    params = dict(engine.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in weights:
            params[name].copy_(tensor)


def serve_rollouts(bridge: Bridge) -> int:
    """A rollout rank's whole run: build the engine from the first ``start``, then answer its trainer ranks until
    they say ``stop``. Returns the number of batches generated."""
    clients = bridge.layout.clients_of(bridge.layout.rank)
    engine, vllm, settings, served = None, False, GenerationSettings(), 0
    while True:
        messages = [bridge.recv(c) for c in clients]
        kind = messages[0]["kind"]  # type: ignore[index]
        if kind == "stop":
            if vllm:
                engine.close()
            return served
        if kind == "start":
            start = messages[0]
            settings = GenerationSettings(**start["generation"])  # type: ignore[index]
            engine, vllm = _build(start)  # type: ignore[arg-type]
            for client in clients:
                bridge.send(_describe(engine, vllm, bridge.layout.rank), client)
        elif kind == "weights":
            _load(engine, vllm, bridge.receive_weights(), messages[0]["version"])  # type: ignore[index]
        else:
            for client, msg in zip(clients, messages):
                bridge.send(_generate(engine, vllm, settings, msg), client)  # type: ignore[arg-type]
                served += 1


def _describe(engine: Any, vllm: bool, rank: int) -> dict[str, Any]:
    """The rollout rank's engine, for the trainer's log and summary."""
    if vllm:
        return {"rank": rank, "engine": "vllm", **engine.memory("rollout")}
    params = list(engine.parameters())
    return {"rank": rank, "engine": "transformers", "parameters": sum(p.numel() for p in params),
            "bytes": sum(p.numel() * p.element_size() for p in params)}


def _generate(engine: Any, vllm: bool, settings: GenerationSettings, msg: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.manual_seed(msg["seed"])
    eos, pad = msg["ids"]
    run = engine_generate if vllm else module_generate
    device = torch.device("cpu") if vllm else next(engine.parameters()).device
    response, logprobs = run(engine, msg["input_ids"].to(device), msg["attention_mask"].to(device), settings, eos,
                             pad)
    return {"index": msg["index"], "response": response.cpu(), "logprobs": logprobs.cpu(),
            "timings": {"generation_s": time.perf_counter() - t0, "generation_steps": float(response.shape[1])}}

"""Seeds: one number in, reproducible streams out, the same on every run and distinct per rank.

``seed_everything(seed, rank)`` seeds Python's ``random``, NumPy and torch (CPU and accelerator) with
``seed + rank``: ranks draw different dropout masks and data augmentations, as
``accelerate.set_seed(seed, device_specific=True)`` does, and a rerun with the same seed repeats
bit for bit. Model factories do not see that per-rank stream: the registry builds every role under
``role_seed(seed, role)``, the same on every rank, so randomly initialised weights agree without a
broadcast (see ``EngineRegistry.build``).

``derive_seed``/``generator`` give independent streams keyed by names and numbers (the step, the
micro-batch, the rank): a resumed run draws exactly what the uninterrupted one would have drawn,
whatever happened to the global RNG in between.
"""

from __future__ import annotations

import hashlib
import random

import torch

__all__ = ["derive_seed", "generator", "role_seed", "seed_everything"]

_MASK = (1 << 63) - 1


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (ints, strings): stable across runs, processes and platforms."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK


def generator(*parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded with ``derive_seed(*parts)``."""
    return torch.Generator(device=device).manual_seed(derive_seed(*parts))


def role_seed(seed: int, role: str) -> int:
    """The seed a role's model factory runs under: the same on every rank."""
    return derive_seed("role", seed, role) % (2**32)


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed ``random``, NumPy and torch with ``seed + rank``; returns the seed used."""
    value = int(seed) + int(rank)
    random.seed(value)
    try:
        import numpy as np

        np.random.seed(value % (2**32))
    except ImportError:  # numpy is optional for the engines
        pass
    torch.manual_seed(value)  # also seeds every CUDA device
    return value

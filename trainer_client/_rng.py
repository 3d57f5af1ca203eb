"""The process's random states, captured into a checkpoint and set back on restore.

A resumed run is bitwise the uninterrupted one only if every generator the training
step draws from (dropout, data augmentation, sampling) continues from where it was
when the checkpoint was taken. The session captures them in ``checkpoint()`` (the
moment the state is staged) and sets them in ``restore()``/``rollback()``, so the
user's loop does nothing about RNG. States are plain JSON (bytes base64-encoded) for
the session record (:class:`trainguard.core.record.RankState`).

The DataLoader is the other half: creating its iterator draws a base seed from the
global generator unless the loader has its own. :func:`loader_generator` gives it
one derived from the run seed, so ``batches()`` never moves the global state. Inside
a worker, a ``decode``/``collate`` that draws random numbers (augmentation) gets
generators seeded per batch (:func:`seed_batch`: run seed, partition, batch index
in it), so what it draws is a function of the batch alone, whatever the worker, the
worker count or the resume point.
"""

from __future__ import annotations

import base64
import random
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "default_seed", "loader_generator", "restore", "seed_batch"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def default_seed(run: str) -> int:
    """The run seed when none is given: a pure function of the run's name, so every
    rank and every restart agrees on it without being told."""
    return zlib.crc32(run.encode())


def capture() -> dict[str, Any]:
    """Every global generator's state now, as JSON-ready values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    version, words, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "numpy": [str(kind), _b64(np.asarray(keys, dtype="<u4").tobytes()), int(pos),
                  int(has_gauss), float(gauss)],
        "python": [int(version), _b64(np.asarray(words, dtype="<u4").tobytes()), gauss_next],
    }
    # Only when CUDA is already in use: querying it would initialise it otherwise.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return out


def restore(states: Mapping[str, Any]) -> None:
    """Set every generator ``states`` has (from :func:`capture`); others stay."""
    if "torch" in states:
        raw = np.frombuffer(_unb64(states["torch"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))
    if "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, np.frombuffer(_unb64(keys), dtype="<u4").astype(np.uint32),
                             int(pos), int(has_gauss), float(gauss)))
    if "python" in states:
        version, words, gauss_next = states["python"]
        ints = tuple(int(w) for w in np.frombuffer(_unb64(words), dtype="<u4"))
        random.setstate((int(version), ints, gauss_next))
    cuda = states.get("cuda")
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(
            [torch.from_numpy(np.frombuffer(_unb64(s), dtype=np.uint8).copy()) for s in cuda[:n]]
        )


def loader_generator(seed: int, rank: int, consumed: int) -> torch.Generator:
    """The generator a DataLoader pass draws its base seed from (and so its workers'
    seeds): a pure function of the run seed, the rank and the batches consumed
    before the pass, so the same resume point gives the same worker seeds."""
    mixed = zlib.crc32(f"{seed}:{rank}:{consumed}".encode())
    return torch.Generator().manual_seed(mixed)


def seed_batch(seed: int, partition: int, index: int) -> None:
    """Seed this (worker) process's generators for batch ``index`` of ``partition``."""
    mixed = zlib.crc32(f"{seed}:{partition}:{index}".encode())
    torch.manual_seed(mixed)
    np.random.seed(mixed)
    random.seed(mixed)

"""Deterministic random streams for the schedule.

Every stream comes from a PCG64 bit generator keyed by integers only (seed,
epoch, stage, bucket) through ``SeedSequence``, never by Python's ``hash``.
The schedule reads only the raw 64-bit output (``random_raw``), which numpy
keeps stable across releases, and derives chunks and permutations from it
itself, so the same inputs give the same batches on every machine and numpy
version.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# Stage tags keep the streams of different steps of the build independent.
STAGE_CHUNKS = 1
STAGE_BATCH_ORDER = 2
STAGE_RANDOM_INTERLEAVE = 3
STAGE_LOSS_NOISE = 4


def bit_generator(seed: int, epoch: int, stage: int, *more: int) -> np.random.PCG64:
    return np.random.PCG64(np.random.SeedSequence([seed, epoch, stage, *more]))


def random_u64(size: int, seed: int, epoch: int, stage: int, *more: int) -> npt.NDArray[np.uint64]:
    """``size`` raw 64-bit words of the stream keyed by (seed, epoch, stage, *more)."""
    return np.asarray(bit_generator(seed, epoch, stage, *more).random_raw(size), dtype=np.uint64)


def permutation(n: int, seed: int, epoch: int, stage: int, *more: int) -> npt.NDArray[np.int64]:
    """A uniformly random permutation of ``range(n)`` from the keyed stream."""
    return np.argsort(random_u64(n, seed, epoch, stage, *more), kind="stable").astype(np.int64)


def generator(seed: int, epoch: int, stage: int, *more: int) -> np.random.Generator:
    """A full ``Generator`` (for simulations only: its distributions may change across numpy releases)."""
    return np.random.Generator(bit_generator(seed, epoch, stage, *more))

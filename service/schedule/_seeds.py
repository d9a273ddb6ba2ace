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
STAGE_TIES = 5
STAGE_BATCH_MATES = 6


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


class BitMixer:
    """A keyed bijection of ``bits``-bit integers, vectorised, with its inverse.

    Three rounds of xor with a key, multiplication by an odd key and an
    xorshift, all modulo ``2**bits``: each step is invertible, so distinct
    inputs stay distinct and ``unmix(mix(x)) == x``. Keyed by a stream of
    ``random_u64``, it orders integers in a seeded random order with one
    array pass per step, which lets a sort key carry a row's random rank and
    still give the row back (``packing``).
    """

    ROUNDS = 3

    def __init__(self, bits: int, seed: int, epoch: int, stage: int, *more: int) -> None:
        if not 1 <= bits <= 63:
            raise ValueError(f"BitMixer: bits must be in 1..63, got {bits}")
        self.bits = bits
        mod = 1 << bits
        self._mask = np.uint64(mod - 1)
        self._shift = np.uint64(max(1, (bits + 1) // 2))
        words = [int(w) for w in random_u64(2 * self.ROUNDS, seed, epoch, stage, *more)]
        self._xor = [np.uint64(w % mod) for w in words[: self.ROUNDS]]
        odd = [(w % mod) | 1 for w in words[self.ROUNDS :]]
        self._mul = [np.uint64(m) for m in odd]
        self._inv = [np.uint64(pow(m, -1, mod)) for m in odd]

    def mix(self, x: npt.NDArray[np.uint64]) -> None:
        """Map ``x`` (values below ``2**bits``) in place."""
        for key, mul in zip(self._xor, self._mul, strict=True):
            x ^= key
            x *= mul
            x &= self._mask
            x ^= x >> self._shift

    def unmix(self, x: npt.NDArray[np.uint64]) -> None:
        """The inverse of ``mix``, in place."""
        for key, inv in zip(reversed(self._xor), reversed(self._inv), strict=True):
            # x ^= x >> s is undone by xoring in every further multiple of s (2s >= bits: one more)
            x ^= x >> self._shift
            x *= inv
            x &= self._mask
            x ^= key

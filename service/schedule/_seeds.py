"""Deterministic random streams for the schedule.

Every stream is a numpy ``Generator`` keyed by integers only (seed, epoch,
stage, bucket), never by Python's ``hash``, so the same inputs give the same
numbers in every process, on every machine.
"""

from __future__ import annotations

import numpy as np

# Stage tags keep the streams of different steps of the build independent.
STAGE_CHUNKS = 1
STAGE_BATCH_ORDER = 2
STAGE_RANDOM_INTERLEAVE = 3
STAGE_LOSS_NOISE = 4


def generator(seed: int, epoch: int, stage: int, *more: int) -> np.random.Generator:
    """A PCG64 stream for (seed, epoch, stage, *more); all parts non-negative ints."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stage, *more])))

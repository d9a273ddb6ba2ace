"""Packing breaks ties at random (guarantee 10) and nothing else moves.

Rows of equal padded length cost the same padding, so their order inside a
chunk is a per-epoch random key, never row id. The batches' shapes (rows,
padded length, bucket: hence padding, runs and shares) are exactly those of
the same packing with ties broken by row order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.bench_batchmates import row_order_ties
from ladle.service.schedule import ScheduleConfig, _seeds, build_schedule, packing
from ladle.service.schedule._seeds import BitMixer
from ladle.service.schedule.buckets import assign_buckets
from ladle.service.schedule.schedule import resolve_bounds

from .test_schedule_properties import build_or_skip, inputs


@given(bits=st.integers(1, 63), seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 1000), data=st.data())
def test_the_tie_key_is_a_bijection_with_its_inverse(bits: int, seed: int, epoch: int, data: Any) -> None:
    top = (1 << bits) - 1
    values = data.draw(st.lists(st.integers(0, top), min_size=1, max_size=64, unique=True))
    x = np.asarray(values, dtype=np.uint64)
    mixer = BitMixer(bits, seed, epoch, _seeds.STAGE_TIES)
    y = x.copy()
    mixer.mix(y)
    assert int(y.max()) <= top, "the key left its bits"
    assert len(np.unique(y)) == len(x), "two rows got one key"
    mixer.unmix(y)
    assert (y == x).all(), "a row could not be read back from its key"


def test_the_tie_key_permutes_every_value_of_a_small_width() -> None:
    for bits in (1, 2, 3, 7, 12):
        y = np.arange(1 << bits, dtype=np.uint64)
        BitMixer(bits, 5, 1, _seeds.STAGE_TIES).mix(y)
        assert sorted(y.tolist()) == list(range(1 << bits)), f"not a permutation of {bits} bits"


def _shapes(sched: Any) -> tuple[Any, ...]:
    return (
        sched.buckets.tolist(),
        sched.batch_rows().tolist(),
        sched.batch_padded_len().tolist(),
        sched.dropped.counts,  # which rows a dropped remainder holds may differ: how many may not
    )


@given(inputs())
def test_random_ties_change_which_rows_meet_never_the_batches_shapes(
    case: tuple[np.ndarray, ScheduleConfig, int],
) -> None:
    """Padding, runs and shares depend on the batches' shapes only: those must not move."""
    lengths, config, world = case
    sched = build_or_skip(lengths, config, world)
    with row_order_ties():
        by_row = build_schedule(lengths, config, world_size=world)
    assert _shapes(sched) == _shapes(by_row), "breaking ties at random changed a batch's shape"


@given(inputs())
def test_rows_are_sorted_by_padded_length_inside_a_chunk(
    case: tuple[np.ndarray, ScheduleConfig, int],
) -> None:
    """What keeps padding low: each batch's padded length is that of its longest row."""
    lengths, config, world = case
    sched = build_or_skip(lengths, config, world)
    pad = config.pad_to_multiple_of
    cut = np.minimum(lengths, config.max_seq_len)
    for step in range(sched.num_steps):
        for rank in range(world):
            rows = sched.samples(step, rank)
            longest = int(cut[rows].max())
            assert sched.padded_len(step, rank) == -(-longest // pad) * pad, "wrong padded length"


def _row_order_share(lengths: np.ndarray, config: ScheduleConfig, epoch: int) -> float:
    """Share of consecutive rows in packing order (inside one class) that are consecutive row ids."""
    cut = np.minimum(lengths, config.max_seq_len)
    bounds = resolve_bounds(cut, config)
    packed = packing.pack(None, cut, assign_buckets(cut, bounds), len(bounds) - 1, config, epoch, len(cut))
    rows = packed.rows.astype(np.int64)
    return float(np.mean(np.diff(rows) == 1))


@pytest.mark.parametrize("pad", [1, 8])
def test_equal_rows_are_not_packed_in_row_order(pad: int) -> None:
    """Rows of one length (or one padded length) fall in a random order, a new one every epoch."""
    n = 20_000
    lengths = np.full(n, 256) if pad == 1 else 249 + np.arange(n) % 8  # one padded length, 256
    config = ScheduleConfig(
        bucket_bounds=(0, 257), max_seq_len=256, token_budget=4096, pad_to_multiple_of=pad
    )
    assert _row_order_share(lengths, config, 0) < 0.01, "rows follow row order"
    cut = np.minimum(lengths, 256)
    bounds = (0, 257)
    a = packing.pack(None, cut, assign_buckets(cut, bounds), 1, config, 0, n).rows
    b = packing.pack(None, cut, assign_buckets(cut, bounds), 1, config, 1, n).rows
    assert np.mean(a == b) < 0.01, "two epochs ordered the rows alike"
    c = packing.pack(None, cut, assign_buckets(cut, bounds), 1, config, 0, n).rows
    assert (a == c).all(), "the order is not a pure function of (lengths, config, epoch)"


def test_a_subset_of_rows_is_read_back_from_the_keys() -> None:
    """A re-planned rest of an epoch (rows given) packs those rows, each once, with their lengths."""
    lengths = (np.arange(5000, dtype=np.int64) * 7919) % 300 + 1
    config = ScheduleConfig(
        bucket_bounds=(0, 100, 301), max_seq_len=300, token_budget=1200, pad_to_multiple_of=4
    )
    rows = np.flatnonzero(np.arange(5000) % 3 != 0)
    packed = packing.pack(
        rows, lengths[rows], assign_buckets(lengths[rows], (0, 100, 301)), 2, config, 3, 5000, source=lengths
    )
    assert sorted(packed.rows.tolist()) == rows.tolist(), "missing or duplicate samples"
    assert (packed.lengths() == lengths[packed.rows]).all(), "a row got another row's length"
    last = packed.start + packed.size - 1
    assert (packed.padded_len == -(-lengths[packed.rows[last]] // 4) * 4).all(), "wrong padded length"

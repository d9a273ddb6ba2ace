"""``build_schedule``: the epoch schedule as a pure function.

The schedule of an epoch depends only on (the sample lengths, the config, the
epoch, the world size); the same inputs give byte-identical batches in every
process (guarantee 5). Steps: cut or drop over-long samples, assign buckets,
pack each bucket under the token budget, fit the batch count to the world
size, interleave buckets across steps and ranks, and deal each bucket's
batches (in a seeded order) to the cells the interleaving gave it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, OverlongSampleError, ScheduleError
from ._seeds import STAGE_RANDOM_INTERLEAVE, permutation
from .buckets import assign_buckets, auto_bounds, quantile_bounds
from .config import ALGORITHM_VERSION, ScheduleConfig
from .interleave import interleave_1d, interleave_grid
from .packing import Packed, batch_order, check_keys, cut_lengths, pack
from .remainder import fit_to_world

__all__ = ["Cut", "Dropped", "Schedule", "bucket_edges", "build_schedule", "cut_samples", "resolve_bounds"]

I64 = npt.NDArray[np.int64]

# ``auto`` bounds compare candidate edges by packing at most about this many samples.
AUTO_TRIAL_ROWS = 1 << 20


@dataclass(frozen=True)
class Dropped:
    """Rows left out of an epoch on purpose, by reason (``overlong``, ``remainder``)."""

    by_reason: Mapping[str, I64] = field(default_factory=dict)

    @property
    def rows(self) -> I64:
        """All dropped row indices, sorted."""
        parts = list(self.by_reason.values())
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    @property
    def counts(self) -> dict[str, int]:
        return {reason: len(rows) for reason, rows in self.by_reason.items()}

    def __len__(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class Cut:
    """Samples longer than ``max_seq_len`` that ``overlong="truncate"`` serves cut to it (``cut_samples``)."""

    samples: int
    rows: int
    tokens_cut: int
    tokens: int
    max_seq_len: int

    def __bool__(self) -> bool:
        return self.samples > 0

    def sentence(self) -> str:
        """One line saying what is cut and what to do about it."""
        share = self.tokens_cut / self.tokens if self.tokens else 0.0
        return (
            f"{self.samples:,} of {self.rows:,} samples are longer than max_seq_len={self.max_seq_len} and "
            f"are served cut to it: {self.tokens_cut:,} of {self.tokens:,} tokens ({share:.1%}) are never "
            "trained on; raise --max-seq-len (auto bounds follow it; given --bucket-bounds need a last edge "
            "above it), or --overlong drop (leave them out) or error (refuse them)"
        )


def cut_samples(lengths: npt.ArrayLike, config: ScheduleConfig) -> Cut:
    """What ``config`` cuts of samples of ``lengths`` (nothing unless ``overlong="truncate"``)."""
    lens = _as_lengths(lengths)
    over = lens[lens > config.max_seq_len] if config.overlong == "truncate" else lens[:0]
    return Cut(
        samples=int(over.size),
        rows=int(lens.size),
        tokens_cut=int(over.sum(dtype=np.int64)) - int(over.size) * config.max_seq_len,
        tokens=int(lens.sum(dtype=np.int64)),
        max_seq_len=config.max_seq_len,
    )


class Schedule:
    """One epoch's batches for ``world_size`` ranks.

    ``buckets[step, rank]`` is the bucket of the batch that ``rank`` trains on at
    ``step``; ``samples(step, rank)`` are its row indices in row order.
    """

    def __init__(
        self,
        *,
        config: ScheduleConfig,
        epoch: int,
        world_size: int,
        bounds: tuple[int, ...],
        num_rows: int,
        packed: Packed,
        batch_ids: I64,
        dropped: Dropped,
    ) -> None:
        self.config = config
        self.epoch = epoch
        self.world_size = world_size
        self.bounds = bounds
        self.num_rows = num_rows
        self._packed = packed
        self.batch_ids = batch_ids
        self.dropped = dropped
        self.buckets: I64 = (
            packed.bucket[batch_ids] if batch_ids.size else np.empty((0, world_size), np.int64)
        )
        self.buckets.setflags(write=False)
        self.batch_ids.setflags(write=False)

    # --- shape ---

    @property
    def num_steps(self) -> int:
        return int(self.batch_ids.shape[0])

    @property
    def num_buckets(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_batches(self) -> int:
        return int(self.batch_ids.size)

    # --- one batch ---

    def _batch(self, step: int, rank: int) -> int:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} outside 0..{self.num_steps - 1}")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside 0..{self.world_size - 1}")
        return int(self.batch_ids[step, rank])

    def samples(self, step: int, rank: int) -> I64:
        """Row indices of the batch of ``rank`` at ``step``, in row order."""
        return self._samples(self._batch(step, rank))

    def _samples(self, b: int) -> I64:
        start = int(self._packed.start[b])
        rows: I64 = self._packed.rows[start : start + int(self._packed.size[b])].astype(np.int64)
        rows.sort()  # in place, on the copy: np.sort would copy again
        return rows

    def batch(self, step: int, rank: int) -> tuple[I64, int, int]:
        """``samples``, ``padded_len`` and ``bucket`` of one batch, with one lookup (the server's)."""
        b = self._batch(step, rank)
        return self._samples(b), int(self._packed.padded_len[b]), int(self.buckets[step, rank])

    def lengths(self, step: int, rank: int) -> I64:
        """Cut lengths of ``samples(step, rank)``, in the same order."""
        packed = self._packed
        out: I64 = cut_lengths(packed.source, self.samples(step, rank), packed.max_seq_len).astype(np.int64)
        return out

    def padded_len(self, step: int, rank: int) -> int:
        return int(self._packed.padded_len[self._batch(step, rank)])

    def bucket(self, step: int, rank: int) -> int:
        return int(self.buckets[step, rank])

    # --- whole-epoch views (vectorised, for statistics) ---

    def batch_rows(self) -> I64:
        """Rows per batch, ``[num_steps, world_size]``."""
        return self._packed.size[self.batch_ids]

    def batch_padded_len(self) -> I64:
        return self._packed.padded_len[self.batch_ids]

    def batch_real_tokens(self) -> I64:
        """Real (unpadded, cut) tokens per batch, ``[num_steps, world_size]``."""
        out: I64 = self._packed.per_batch(np.add)[self.batch_ids]
        return out

    def scheduled_rows(self) -> I64:
        """Every row that is in some batch of this epoch (unsorted, each once)."""
        return self._rows_of(self.batch_ids.ravel())

    def rows_before(self, steps: npt.ArrayLike) -> I64:
        """The rows of every rank's batches before its own step ``steps[rank]`` (unsorted, each once).

        What a world that stopped with rank r at step ``steps[r]`` has consumed
        of this epoch; steps past the end count as the whole epoch.
        """
        counts = np.minimum(np.asarray(steps, dtype=np.int64), self.num_steps)
        if counts.shape != (self.world_size,) or (counts < 0).any():
            raise ValueError(f"steps: expected {self.world_size} non-negative steps, got {counts.tolist()}")
        taken = np.arange(self.num_steps)[:, None] < counts[None, :]
        return self._rows_of(self.batch_ids[taken])

    def _rows_of(self, batch_ids: I64) -> I64:
        start = self._packed.start[batch_ids]
        size = self._packed.size[batch_ids]
        if len(start) == 0:
            return np.empty(0, dtype=np.int64)
        offsets = np.repeat(start - np.r_[0, np.cumsum(size)[:-1]], size)
        out: I64 = self._packed.rows[np.arange(int(size.sum())) + offsets].astype(np.int64)
        return out

    @classmethod
    def empty(
        cls,
        config: ScheduleConfig,
        epoch: int,
        world_size: int,
        bounds: tuple[int, ...],
        num_rows: int,
        dropped: Dropped,
    ) -> Schedule:
        """An epoch with no step (the rest of an epoch too small to give every rank a batch)."""
        none = np.empty(0, dtype=np.int64)
        packed = Packed(none, none, config.max_seq_len, none, none, none, none)
        return cls(
            config=config,
            epoch=epoch,
            world_size=world_size,
            bounds=bounds,
            num_rows=num_rows,
            packed=packed,
            batch_ids=np.empty((0, world_size), dtype=np.int64),
            dropped=dropped,
        )

    def content_hash(self) -> str:
        """A hash of every batch's rows, in step and rank order (golden tests, replicas)."""
        h = hashlib.sha256()
        h.update(f"v{ALGORITHM_VERSION}:{self.world_size}:{self.num_steps}:".encode())
        h.update(np.ascontiguousarray(self.batch_rows(), dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.scheduled_rows(), dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.batch_padded_len(), dtype="<i8").tobytes())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return (
            f"Schedule(epoch={self.epoch}, world_size={self.world_size}, steps={self.num_steps}, "
            f"buckets={self.num_buckets}, dropped={self.dropped.counts})"
        )


def _as_lengths(lengths: npt.ArrayLike) -> npt.NDArray[np.integer]:
    """The lengths as a 1-D integer array (no copy when they already are one), all positive."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ScheduleError(f"lengths: expected a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ScheduleError(f"lengths: expected integers, got dtype {arr.dtype}")
    if int(arr.min()) <= 0:
        bad = np.flatnonzero(arr <= 0)
        raise ScheduleError(
            f"lengths: {len(bad)} sample(s) have non-positive length (first rows: {bad[:5].tolist()})"
        )
    if arr.dtype.itemsize > 8 or (arr.dtype.kind == "u" and arr.dtype.itemsize == 8):
        arr = arr.astype(np.int64)
    return arr


def resolve_bounds(lengths: npt.ArrayLike, config: ScheduleConfig) -> tuple[int, ...]:
    """The bucket edges ``config`` means for these lengths.

    ``auto`` tries a few candidate edge sets (expected padding under ladle's
    packer, pad-to-bucket-max, equal-count quantiles), packs epoch 0 with each
    and keeps the one that pads least, so it is never worse than quantiles.
    Past ``AUTO_TRIAL_ROWS`` samples the trial packings use every k-th sample
    (the candidates still come from every length), so the choice costs about
    the same on 10^8 rows as on 10^6. The edges depend on the lengths and the
    config only, never on the epoch.
    """
    if config.bucket_bounds != "auto":
        return tuple(config.bucket_bounds)
    cut = _as_lengths(lengths)
    if cut.size and int(cut.max()) > config.max_seq_len:  # else no copy of them all
        cut = np.minimum(cut, config.max_seq_len)
    k, top, pad = config.num_buckets, config.max_seq_len, config.pad_to_multiple_of
    candidates = [
        auto_bounds(cut, k, top, pad, token_budget=config.token_budget, max_batch_size=config.max_batch_size),
        auto_bounds(cut, k, top, pad, objective="pad_to_max"),
        quantile_bounds(cut, config.num_buckets, config.max_seq_len),
    ]
    trial = cut[:: -(-len(cut) // AUTO_TRIAL_ROWS)]
    best: tuple[float, tuple[int, ...]] | None = None
    for bounds in dict.fromkeys(candidates):
        packed = pack(None, trial, assign_buckets(trial, bounds), len(bounds) - 1, config, 0, len(trial))
        padded = float((packed.size * packed.padded_len).sum())
        if best is None or padded < best[0]:
            best = (padded, bounds)
    assert best is not None
    return best[1]


def _usable(
    lens: npt.NDArray[np.integer], config: ScheduleConfig, rows: npt.ArrayLike | None
) -> tuple[I64 | None, npt.NDArray[np.integer], dict[str, I64]]:
    """The rows an epoch schedules (None: all), their lengths cut to ``max_seq_len``, and the rows dropped.

    Over-long samples are cut, dropped or refused as ``config.overlong`` says.
    """
    if lens.size == 0:
        raise ScheduleError("lengths: the dataset is empty")
    num_rows = len(lens)
    dropped: dict[str, I64] = {}
    subset: I64 | None = None  # None: every row, in order
    cut: npt.NDArray[np.integer] = lens
    if rows is not None:
        subset = np.asarray(rows, dtype=np.int64)
        if subset.ndim != 1 or (subset.size and (subset[0] < 0 or subset[-1] >= num_rows)):
            raise ScheduleError(f"rows: expected sorted row indices in 0..{num_rows - 1}")
        if subset.size > 1 and not bool((np.diff(subset) > 0).all()):
            raise ScheduleError("rows: expected sorted, unique row indices")
        cut = lens[subset]
    over = cut > config.max_seq_len
    if over.any():
        if config.overlong == "error":
            bad = np.flatnonzero(over) if subset is None else subset[over]
            raise OverlongSampleError(len(bad), bad[:5].tolist(), config.max_seq_len)
        if config.overlong == "drop":
            dropped["overlong"] = np.flatnonzero(over) if subset is None else subset[over]
            subset = np.flatnonzero(~over) if subset is None else subset[~over]
            cut = lens[subset]
        else:
            cut = np.minimum(cut, config.max_seq_len)
    del over
    if len(cut) == 0:
        raise ScheduleError("every sample was dropped as over-long; nothing to schedule")
    return subset, cut, dropped


def _edges(cut: npt.NDArray[np.integer], config: ScheduleConfig) -> tuple[int, ...]:
    return resolve_bounds(cut, config) if config.bucket_bounds == "auto" else tuple(config.bucket_bounds)


def bucket_edges(lengths: npt.ArrayLike, config: ScheduleConfig) -> tuple[int, ...]:
    """The bucket edges of every epoch's schedule of these lengths, with the config checked against them.

    ``build_schedule(lengths, config, bounds=bucket_edges(lengths, config))``
    is ``build_schedule(lengths, config)``, for every epoch and world size,
    without resolving ``auto`` edges again (a pass over the lengths and three
    trial packings: seconds at 10^8 rows). Raises what ``build_schedule``
    raises before the world size matters (``OverlongSampleError``, every
    sample dropped, more rows than the sort keys hold), at a fraction of a
    build's cost: a server checks its config with it at start-up.
    """
    _, cut, _ = _usable(_as_lengths(lengths), config, None)
    bounds = _edges(cut, config)
    check_keys(assign_buckets(cut, bounds), len(bounds) - 1, config)
    return bounds


def build_schedule(
    lengths: npt.ArrayLike,
    config: ScheduleConfig,
    *,
    epoch: int = 0,
    world_size: int = 1,
    rows: npt.ArrayLike | None = None,
    bounds: tuple[int, ...] | None = None,
) -> Schedule:
    """The schedule of ``epoch`` for ``world_size`` ranks over samples of these lengths.

    ``rows`` (sorted, unique row indices) limits the epoch to those rows: the
    rest of an epoch re-planned for a new world size (``service.jobs``).
    ``bounds`` overrides the bucket edges ``config`` would resolve (a re-plan
    keeps the epoch's edges even when they are ``auto``).
    """
    if not isinstance(world_size, int | np.integer) or world_size < 1:
        raise ConfigError("world_size", f"must be a positive integer, got {world_size!r}")
    if not isinstance(epoch, int | np.integer) or epoch < 0:
        raise ConfigError("epoch", f"must be a non-negative integer, got {epoch!r}")
    world_size, epoch = int(world_size), int(epoch)
    lens = _as_lengths(lengths)
    num_rows = len(lens)
    subset, cut, dropped = _usable(lens, config, rows)
    if bounds is None:
        bounds = _edges(cut, config)
    num_buckets = len(bounds) - 1
    bucket_ids = assign_buckets(cut, bounds)
    packed = pack(subset, cut, bucket_ids, num_buckets, config, epoch, num_rows, source=lens)
    candidates = len(cut)
    del cut
    del bucket_ids
    packed, lost = fit_to_world(
        packed,
        num_buckets,
        world_size,
        config.rank_mode,
        config.remainder,
        config.pad_to_multiple_of,
    )
    if len(lost):
        dropped["remainder"] = lost
    if packed.num_batches == 0:
        raise ScheduleError(
            f"no complete step: {candidates} row(s) cannot give "
            f"each of {world_size} ranks a batch"
            + (" of one bucket (rank_mode='sync')" if config.rank_mode == "sync" else "")
            + (
                f" with remainder='drop', which left out {len(lost)} row(s) that could not fill a step "
                "on every rank; remainder='split' serves them"
                if config.remainder == "drop" and len(lost)
                else ""
            )
        )

    counts = np.bincount(packed.bucket, minlength=num_buckets)
    grid = _interleave(counts, config, epoch, world_size)
    batch_ids = _deal(grid, batch_order(packed, num_buckets, config, epoch))
    return Schedule(
        config=config,
        epoch=epoch,
        world_size=world_size,
        bounds=bounds,
        num_rows=num_rows,
        packed=packed,
        batch_ids=batch_ids,
        dropped=Dropped(MappingProxyType(dropped)),
    )


def _interleave(counts: I64, config: ScheduleConfig, epoch: int, world_size: int) -> I64:
    """The bucket of every (step, rank) cell."""
    if config.rank_mode == "sync":
        per_step = counts // world_size
        if config.interleave == "random":
            steps = np.repeat(np.arange(len(counts), dtype=np.int64), per_step)
            steps = steps[permutation(len(steps), config.seed, epoch, STAGE_RANDOM_INTERLEAVE)]
        else:
            steps = interleave_1d(per_step)
        return np.repeat(steps[:, None], world_size, axis=1)
    if config.interleave == "random":
        items = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        items = items[permutation(len(items), config.seed, epoch, STAGE_RANDOM_INTERLEAVE)]
        return items.reshape(-1, world_size)
    return interleave_grid(counts, world_size)


def _deal(grid: I64, queues: list[I64]) -> I64:
    """Give each cell the next batch of its bucket's queue, in step-then-rank order."""
    flat = grid.ravel()
    order = np.argsort(flat, kind="stable")
    ids = np.empty_like(flat)
    ids[order] = np.concatenate(queues)
    return ids.reshape(grid.shape)

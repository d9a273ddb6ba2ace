"""Edge datasets get a clear outcome: one length, one row, every row over max_seq_len, no valid packing."""

from __future__ import annotations

import numpy as np
import pytest

from ladle.service.errors import ConfigError, OverlongSampleError, ScheduleError
from ladle.service.schedule import (
    PRODUCTION_BOUNDS,
    ScheduleConfig,
    bucket_edges,
    build_schedule,
    cut_samples,
)
from ladle.service.schedule.stats import batch_mates, quality


def _served(sched: object) -> list[int]:
    return sorted(sched.scheduled_rows().tolist())  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["mixed", "sync"])
def test_a_dataset_of_one_length_is_one_bucket_of_random_batches(mode: str) -> None:
    lengths = np.full(5000, 77)
    config = ScheduleConfig.from_mapping({"rank_mode": mode})  # auto edges, the default
    first = build_schedule(lengths, config, epoch=0, world_size=4)
    assert first.bounds == (0, 8193), "auto makes one bucket of one distinct length"
    assert _served(first) == list(range(5000)), "missing or duplicate samples"
    q = quality(first, build_schedule(lengths, config, epoch=1, world_size=4))
    assert q.padding_efficiency == 1.0
    assert q.batch_span_ratio is not None
    assert q.batch_span_ratio > 0.8, "batch-mates follow row order"


def test_one_row_is_one_batch_for_one_rank_and_refused_for_two() -> None:
    sched = build_schedule([300], ScheduleConfig(), world_size=1)
    assert sched.num_steps == 1
    assert sched.samples(0, 0).tolist() == [0]
    mates = batch_mates(sched, build_schedule([300], ScheduleConfig(), epoch=1, world_size=1))
    assert mates.span_ratio is None, (
        "a batch of one row has no batch-mates: no figure, not a division by zero"
    )
    with pytest.raises(ScheduleError, match="no complete step"):
        build_schedule([300], ScheduleConfig(), world_size=2)


def test_rows_all_over_max_seq_len_by_policy() -> None:
    lengths = np.full(40, 9000)
    config = ScheduleConfig(bucket_bounds=PRODUCTION_BOUNDS)  # max_seq_len 8192
    cut = build_schedule(lengths, config, world_size=2)
    assert _served(cut) == list(range(40)), "truncate serves every row, cut"
    assert cut_samples(lengths, config).samples == 40
    assert set(cut.batch_padded_len().ravel().tolist()) == {8192}
    auto = build_schedule(lengths, ScheduleConfig(), world_size=2)
    assert _served(auto) == list(range(40)), "auto edges too"
    with pytest.raises(ScheduleError, match="every sample was dropped as over-long"):
        build_schedule(lengths, config.replace(overlong="drop"), world_size=2)
    with pytest.raises(OverlongSampleError, match="40"):
        build_schedule(lengths, config.replace(overlong="error"), world_size=2)


@pytest.mark.parametrize(
    "options",
    [
        {"max_seq_len": 4096, "token_budget": 1000},
        {"max_seq_len": 1000, "token_budget": 1000, "pad_to_multiple_of": 64},
    ],
)
def test_a_config_that_cannot_pack_one_row_names_the_field(options: dict[str, int]) -> None:
    with pytest.raises(ConfigError) as info:
        ScheduleConfig.from_mapping(options)
    assert info.value.field == "token_budget", info.value


@pytest.mark.parametrize(
    ("overlong", "bounds"),
    [("truncate", "auto"), ("drop", "auto"), ("truncate", "0,300,900,2001"), ("drop", "0,300,2001")],
)
def test_edges_resolved_once_give_every_epoch_the_schedule_it_builds_alone(
    overlong: str, bounds: str
) -> None:
    """A server resolves ``bucket_edges`` once and builds every epoch and world size with them."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 2600, size=30_000).astype(np.int32)
    config = ScheduleConfig.from_mapping({"max_seq_len": 2000, "overlong": overlong, "bucket_bounds": bounds})
    edges = bucket_edges(lengths, config)
    for epoch, world_size in ((0, 1), (3, 8)):
        alone = build_schedule(lengths, config, epoch=epoch, world_size=world_size)
        given = build_schedule(lengths, config, epoch=epoch, world_size=world_size, bounds=edges)
        assert given.bounds == alone.bounds == edges
        assert given.content_hash() == alone.content_hash(), "the edges given change the schedule"


def test_edges_refuse_what_a_build_refuses() -> None:
    lengths = np.array([10, 3000, 20], dtype=np.int32)
    with pytest.raises(OverlongSampleError):
        bucket_edges(lengths, ScheduleConfig.from_mapping({"max_seq_len": 2000, "overlong": "error"}))
    with pytest.raises(ScheduleError, match="every sample was dropped"):
        bucket_edges(np.full(3, 3000), ScheduleConfig.from_mapping({"max_seq_len": 2000, "overlong": "drop"}))
    many = np.arange(2**18) % 7 + 1  # a chunk a row and 25-bit lengths: more than 62-bit sort keys hold
    tight = ScheduleConfig.from_mapping(
        {"max_seq_len": 2**24, "token_budget": 2**24, "sort_chunk": 1, "bucket_bounds": "0,2,16777217"}
    )
    with pytest.raises(ScheduleError, match="62-bit sort keys"):
        build_schedule(many, tight)
    with pytest.raises(ScheduleError, match="62-bit sort keys"):
        bucket_edges(many, tight)

"""Edge datasets get a clear outcome: one length, one row, every row over max_seq_len, no valid packing."""

from __future__ import annotations

import numpy as np
import pytest

from ladle.service.errors import ConfigError, OverlongSampleError, ScheduleError
from ladle.service.schedule import PRODUCTION_BOUNDS, ScheduleConfig, build_schedule, cut_samples
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

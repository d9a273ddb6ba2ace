"""A schedule keeps its rows and small per-batch arrays, never a copy of every row's length.

A server holds two epochs' schedules at once; at 10^8 rows a per-row int32
array is 381 MiB each, so a schedule reads cut lengths from the dataset's own
lengths array (shared) when it needs them.
"""

from __future__ import annotations

import numpy as np
import pytest

from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.schedule.schedule import Schedule

ROWS = 200_000
# batches of about a thousand rows, so the per-batch arrays are well under a byte a row
CONFIG = ScheduleConfig(bucket_bounds=(0, 4, 9), max_seq_len=8, token_budget=16384, max_batch_size=1024)


def _retained_bytes(sched: Schedule, source: np.ndarray) -> int:
    """Bytes of the numpy arrays a schedule and its packing hold, but for views of ``source``."""
    arrays = [v for obj in (sched, sched._packed) for v in vars(obj).values() if isinstance(v, np.ndarray)]
    return sum(a.nbytes for a in arrays if not np.shares_memory(a, source))


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
@pytest.mark.parametrize("subset", [False, True])
@pytest.mark.parametrize("pad", [1, 8])
def test_a_schedule_keeps_no_per_row_lengths(overlong: str, subset: bool, pad: int) -> None:
    lengths = (np.arange(ROWS, dtype=np.int32) * 7919) % 12 + 1  # 1..12: some cut or dropped at 8
    config = CONFIG.replace(overlong=overlong, pad_to_multiple_of=pad)
    rows = np.flatnonzero(np.arange(ROWS) % 3 != 1) if subset else None
    sched = build_schedule(lengths, config, epoch=1, world_size=4, rows=rows)
    served = sched.scheduled_rows()
    assert sched._packed.source is lengths, "the schedule copied the dataset's lengths"
    per_row = _retained_bytes(sched, lengths) / len(served)
    assert per_row < 4.5, f"a schedule retains {per_row:.2f} bytes a row: a per-row lengths array?"
    cut = np.minimum(lengths, config.max_seq_len)
    assert int(sched.batch_real_tokens().sum()) == int(cut[served].sum()), "real tokens != cut rows"
    for step, rank in ((0, 0), (sched.num_steps - 1, 3)):
        samples = sched.samples(step, rank)
        assert sched.lengths(step, rank).tolist() == cut[samples].tolist(), "a row got another row's length"

"""``benchmarks/bench_sampler.py`` in a small form: ScheduleSampler keeps the budget and the run bound.

The counts are deterministic, so ladle's are asserted (no batch over the token
budget, every bucket's longest run at its lower bound) and the baseline's
defects are checked to still show; the tokens a second are only reported.
"""

from __future__ import annotations

from benchmarks import bench_sampler


def test_the_sampler_keeps_the_budget_and_the_bound_where_group_by_length_does_not() -> None:
    result = bench_sampler.main(rows=4000)
    ladle, hf = result["ladle"], result["group_by_length"]
    assert ladle["over_budget"] == 0
    assert ladle["worst_run_over_bound"] == 0
    assert ladle["padding_efficiency"] > hf["padding_efficiency"]
    assert hf["over_budget"] > 0.05, "the baseline no longer shows over-budget batches"
    assert hf["worst_run_over_bound"] > 1, "the baseline no longer shows runs"
    assert ladle["tokens_per_s"] > 0
    assert bench_sampler.summary(result)

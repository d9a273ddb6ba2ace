"""``benchmarks/bench_batchmates.py --quick``: the batch-mates targets hold in the form CI runs.

The figures (span, meeting again, padding, runs, shares) are deterministic, so
their targets are asserted; the build time is only reported (a timed ratio is
the benchmark's to print, not a test's to assert).
"""

from __future__ import annotations

from benchmarks import bench_batchmates


def test_the_batch_mates_targets_hold_and_the_baseline_fails_them() -> None:
    results = bench_batchmates.main(quick=True)
    assert results["missed"] == [], results["missed"]
    equal = next(r for r in results["cases"] if r["case"] == "equal lengths, mixed")
    assert equal["row_order"]["span"] < 0.1, "the row-order baseline no longer shows the defect"
    assert equal["row_order"]["again"] > 10, "the row-order baseline no longer shows the defect"
    assert results["build"]["ratio"] > 0
    assert bench_batchmates.summary(results)

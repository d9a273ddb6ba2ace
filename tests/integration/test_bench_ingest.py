"""``benchmarks/bench_ingest.py`` on a tiny input: it runs end to end and its figures are sane.

The ratio to ``encode_batch`` and the peak RSS are the benchmark's to report
at a real size (a timed ratio on 2 MB is start-up noise); here the run must
finish, write every token ``encode_batch`` made, and measure a process tree.
"""

from __future__ import annotations

from benchmarks import bench_ingest


def test_the_ingest_benchmark_runs_on_a_tiny_input() -> None:
    results = bench_ingest.main(mb=2, workers=(1, 2), vocab=1000)
    base = results["encode_batch_one_thread"]
    assert base["tokens"] > 100_000
    for run in results["ladle"]:
        assert run["tokens"] == base["tokens"], "make-dataset wrote every token encode_batch made"
        assert run["tokens_per_s"] > 0
        assert 50 < run["peak_rss_mb"] < bench_ingest.RSS_LIMIT_MB, "the process tree was measured"
    assert [run["workers"] for run in results["ladle"]] == [1, 2]
    assert bench_ingest.summary(results)

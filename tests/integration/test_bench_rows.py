"""``benchmarks/bench_rows.py`` in a small form: every part runs and its figures are sane.

The seconds and megabytes are the benchmark's to report at 10^8 rows (on
10^5 they are start-up noise); here each part must run end to end on real
processes and measure what it says: the server served, built the next epoch
in the background, and two trainers crossed the epoch boundary with every
step of their epoch.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import bench_rows
from ladle.service.dataset import open_dataset
from ladle.service.schedule import ScheduleConfig, build_schedule


def test_the_rows_benchmark_runs_on_a_small_dataset(tmp_path: Path) -> None:
    rows = 100_000
    results = bench_rows.run(rows, data=tmp_path, world_size=64, boundary_world_size=8, ranks=2, step_ms=0.5)
    made = results["dataset"]
    assert made["rows"] == rows
    assert not made["reused"]
    assert results["open"]["open_dataset_s"] > 0
    assert results["open"]["baseline_s"] > 0
    assert results["open"]["peak_anon_mib"] > 0
    build = results["build"]
    assert build["batches"] >= rows // 64, "tiny rows: at most 64 rows a batch"
    assert build["peak_rss_mib"] >= build["lengths_only_rss_mib"] > 0
    serve = results["serve"]
    assert 0 < serve["ready_s"] <= serve["first_batch_s"]
    assert serve["next_epoch_built_s"] is not None, "the server did not build the next epoch behind"
    assert serve["peak_rss_mib"] >= serve["peak_anon_mib"] > 0
    assert not serve["server_log_problems"], serve["server_log_problems"]
    boundary = results["boundary"]
    steps = build_schedule(open_dataset(made["path"]).lengths, ScheduleConfig(), world_size=8).num_steps
    assert [r["steps"] for r in boundary["per_rank"]] == [steps, steps], "a rank's epoch was not read whole"
    assert all(r["epoch1_first_ms"] is not None for r in boundary["per_rank"]), "no batch of epoch 1"
    assert 0 < boundary["mid_epoch"]["median_ms"] <= boundary["mid_epoch"]["p99_ms"]
    assert 0 < boundary["boundary_max_ms"] < 10_000, "a boundary next() took 10 s"
    assert boundary["one_build_ms"] > 0
    assert set(results["targets"]) == {
        "first_batch_within_60_s",
        "server_rss_under_6_gb",
        "server_heap_under_6_gb",
    }
    assert all(line for line in bench_rows.summary(results))
    again = bench_rows.dataset(tmp_path, rows)[1]
    assert again["reused"], "the dataset was made again in the same folder"

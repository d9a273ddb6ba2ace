"""``benchmarks/bench_gpu.py --cpu``: the GPU benchmark's code runs end to end (no GPU figure).

The three feeds (batches resident in memory, ``BatchClient``, a spawned
``DataLoader`` over ``bench_serving.ScheduleBatches``) train a tiny model on
the same steps; a GPU machine runs the same code with CUDA
(docs/serving.md, "On a GPU").
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from benchmarks import bench_gpu


def test_the_benchmark_runs_on_the_cpu() -> None:
    results = bench_gpu.main(steps=4, repeats=1, cpu=True)
    assert results["server_log_problems"] == []
    for name in ("numpy", "cpu"):
        assert results["next_latency"][name]["batches"] == 80
        assert results["conversion"][name]["convert_median_us"] > 0
    (training,) = results["training"].values()
    for feed in ("resident", "ladle", "dataloader"):
        (run,) = training["runs"][feed]
        assert run["steps"] == 4
        assert run["real_tokens_s"] > 0
    # the same batches, the same model: every feed trained to a finite, plausible loss
    losses = [training["runs"][feed][0]["last_loss"] for feed in ("resident", "ladle", "dataloader")]
    assert all(0 < loss < 20 for loss in losses)
    assert any("resident" in line for line in bench_gpu.summary(results))

"""A bounded soak of a real ``ladle serve``: idle and silent connections plus churn beside a trainer.

The scenario is ``benchmarks/bench_soak.py``'s (which prints the figures);
here it runs in a short form (50 idle gRPC connections, 12 silent TCP ones,
50 connects and disconnects a second for 5 s) and checks that the server
held every connection, closed the silent ones, kept the trainer streaming
(loosely: this machine is shared) and came back to its threads, descriptors
and memory afterwards. ``LADLE_SOAK_SECONDS=60 LADLE_SOAK_IDLE=200`` runs
the full soak.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.bench_soak import SoakSettings, run_soak, summary

SECONDS = float(os.environ.get("LADLE_SOAK_SECONDS", "5"))
IDLE = int(os.environ.get("LADLE_SOAK_IDLE", "50"))


@pytest.mark.slow
@pytest.mark.timeout(180 + 3 * SECONDS)
def test_server_holds_a_crowd_and_returns_to_its_baseline(small_dataset: Path, tmp_path: Path) -> None:
    settings = SoakSettings(
        idle=IDLE,
        silent=max(1, IDLE // 4),
        churn_per_s=50.0,
        churn_s=SECONDS,
        window_s=max(3.0, SECONDS / 3),
        warmup_s=1.0,
        settle_s=30.0,
        server_args=("--handshake-timeout", "2"),
    )
    got = run_soak(small_dataset, tmp_path, settings)
    report = "\n".join(summary(got))
    c, t, s = got["connections"], got["trainer"], got["server"]

    assert c["idle_held"] == IDLE, f"idle connections did not connect\n{report}"
    assert c["server_sockets_with_crowd"] >= c["server_sockets_before"] + IDLE, (
        f"the server did not hold every idle connection\n{report}"
    )
    assert c["server_sockets_at_churn_end"] >= c["server_sockets_before"] + IDLE, (
        f"idle connections were cut during the churn\n{report}"
    )
    assert c["silent_closed_by_server"] == c["silent_opened"], f"silent connections were kept\n{report}"
    ops = c["churn_grpc_calls"] + c["churn_tcp_connects"]
    assert c["churn_per_s"] >= 25, f"the churn fell below half its rate\n{report}"
    assert c["churn_errors"] <= ops // 100, f"churned calls failed: {c['churn_error_examples']}\n{report}"

    assert t["reconnects"] == 0, f"the trainer lost its stream during the soak\n{report}"
    assert t["ratio_during_vs_without"] >= 0.5, f"the trainer's throughput did not hold\n{report}"

    assert s["threads"]["after"] <= s["threads"]["before"] + 2, f"threads leaked\n{report}"
    assert s["fds"]["after"] <= s["fds"]["before"] + 2, f"file descriptors leaked\n{report}"
    # two per pooled SQLite connection at most, one connection per thread reading at once
    store_bound = 2 * s["threads"]["peak_during"] + 1
    assert s["store_fds"]["after"] <= store_bound, f"store connections leaked\n{report}"
    assert s["rss"]["after"] <= s["rss"]["before"] * 1.10 + 16, f"memory did not come back\n{report}"
    assert got["settled"], report

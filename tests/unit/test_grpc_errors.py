"""An unexpected exception in a gRPC method is INTERNAL, counted in the metrics and logged once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ladle.proto import ladle_pb2 as pb
from ladle.proto import rpc
from ladle.service.grpc_server import BatchServicer
from ladle.service.jobs import JobRegistry
from ladle.service.metrics import ServerMetrics
from ladle.service.schedule import ScheduleConfig
from ladle.service.store import EmbeddedStore

CONFIG = ScheduleConfig(max_seq_len=128, bucket_bounds=(0, 32, 129), token_budget=512)


class AbortedError(Exception):
    pass


class Context:
    """What a grpc.aio context does when a method aborts: keep the status and trailer, raise."""

    def __init__(self) -> None:
        self.code: Any = None
        self.trailer: Any = ()

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailer = metadata

    async def abort(self, code: Any, message: str) -> None:
        self.code = code
        raise AbortedError(message)


def test_an_unexpected_error_in_describe_is_a_counted_internal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to end UNKNOWN by grpc's own handler, uncounted: an alert on errors never fired."""
    lengths = (np.arange(4000, dtype=np.int64) * 37) % 128 + 1
    dataset = SimpleNamespace(lengths=lengths, fingerprint="ds", path=str(tmp_path), num_rows=len(lengths))
    registry = JobRegistry(dataset, CONFIG, EmbeddedStore(tmp_path / "state.db"))  # type: ignore[arg-type]
    metrics = ServerMetrics()
    servicer = BatchServicer(registry, None, metrics=metrics)  # type: ignore[arg-type]

    def broken(*args: Any) -> None:
        raise KeyError("dataset_fingerprint")

    monkeypatch.setattr(registry, "preview", broken)
    context = Context()
    try:
        with caplog.at_level("ERROR"), pytest.raises(AbortedError, match="internal error: KeyError"):
            asyncio.run(servicer.describe(pb.DescribeRequest(job="j", world_size=1), context))
    finally:
        servicer.close()
    assert context.code == grpc.StatusCode.INTERNAL
    error = rpc.error_details(context.trailer)
    assert error is not None
    assert error.code == "INTERNAL"
    assert len([r for r in caplog.records if r.exc_info]) == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    assert samples["ladle_errors_total", (("code", "INTERNAL"), ("face", "grpc"))] == 1

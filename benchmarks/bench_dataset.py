"""``make_dataset`` and ``open_dataset`` timings beside writing the same bytes raw.

The baseline writes as many bytes as the dataset holds with ``ndarray.tofile``
and fsyncs them, in the same run, so the ratio says how much ladle adds over
the disk itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ladle.service.dataset import open_dataset
from ladle.service.synth import make_dataset


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _raw_write(path: Path, nbytes: int) -> float:
    block = np.random.default_rng(0).integers(0, 255, size=64 << 20, dtype=np.uint8)
    began = time.perf_counter()
    with path.open("wb") as fh:
        left = nbytes
        while left > 0:
            part = block[: min(left, len(block))]
            part.tofile(fh)
            left -= len(part)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - began


def bench_make_dataset(rows: int, where: str | None = None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ladle-bench-", dir=where))
    try:
        out = tmp / "ds"
        began = time.perf_counter()
        make_dataset(out, rows, seed=0)
        for f in out.iterdir():  # count the time to get it onto the disk, like the baseline
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        make_s = time.perf_counter() - began
        nbytes = _folder_bytes(out)
        began = time.perf_counter()
        ds = open_dataset(out)
        open_s = time.perf_counter() - began
        shutil.rmtree(out)
        raw_s = _raw_write(tmp / "raw.bin", nbytes)
        return {
            "rows": rows,
            "gb_on_disk": round(nbytes / 1e9, 2),
            "tokens": ds.num_tokens,
            "make_dataset_s": round(make_s, 1),
            "raw_write_same_bytes_s": round(raw_s, 1),
            "ratio_vs_raw_write": round(make_s / raw_s, 2),
            "open_dataset_s": round(open_s, 3),
            "target": "1M rows well under a minute",
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""Fixtures the unit tests share: a small saved sample dataset and the schedule flags that fit it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ladle.service.cli import main

# Schedule flags for the sample below (its lengths are scaled to 1/16 of the production mix).
SMALL = ["--max-seq-len", "512", "--bucket-bounds", "0,48,76,108,152,206,513", "--token-budget", "3072"]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ds") / "sample"
    assert main(["make-dataset", str(out), "--rows", "3000", "--seed", "1", "--scale", "0.0625"]) == 0
    return out

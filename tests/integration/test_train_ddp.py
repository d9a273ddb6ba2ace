"""examples/train_ddp.py in its short form: real text, a real server, 2 DDP ranks, both interleave modes.

Checks that the loss falls, that every rank trained on exactly the batches
``build_schedule`` gives for the server's dataset and config, and that the
figure is drawn. The script, its server and its rank processes run in their
own session, killed as a group if anything goes wrong.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ladle.service.dataset import open_dataset
from ladle.service.jobs import schedule_fingerprint
from ladle.service.schedule import ScheduleConfig, build_schedule
from tests.support.session import run_in_session

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
WORLD = 2
STEPS = 48


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train")
    cmd = [
        sys.executable, str(EXAMPLE), "--out", str(out),
        "--text", str(STDLIB / "json"), str(STDLIB / "email"), str(STDLIB / "asyncio"), "--vocab-size", "512",
        "--world-size", str(WORLD), "--steps", str(STEPS),
        "--max-seq-len", "64", "--token-budget", "512", "--bucket-bounds", "0,8,16,32,65",
        "--d-model", "32", "--layers", "1", "--heads", "2", "--lr", "5e-3", "--warmup", "5",
        "--skip", "5", "--trend", "16", "--window", "2", "--report-every", "10",
        "--plot", str(out / "ladder.png"),
    ]  # fmt: skip
    code, output = run_in_session(cmd, timeout=240)
    assert code == 0, f"train_ddp.py failed:\n{output[-4000:]}"
    (out / "stdout.txt").write_text(output)
    return out


def records(run: Path, mode: str, rank: int) -> list[dict[str, object]]:
    lines = (run / mode / f"rank-{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("mode", ["stride", "random"])
def test_every_rank_got_exactly_its_scheduled_batches(run: Path, mode: str) -> None:
    ds = open_dataset(run / "dataset")
    config = ScheduleConfig.from_toml(run / mode / "ladle.toml")
    assert config.interleave == mode
    sched = build_schedule(ds.lengths, config, epoch=0, world_size=WORLD)
    steps = min(STEPS, sched.num_steps)
    assert steps == STEPS, "the short run stays inside one epoch"
    for rank in range(WORLD):
        got = records(run, mode, rank)
        assert [r["step"] for r in got] == list(range(steps)), f"rank {rank}: steps missing or out of order"
        assert {r["epoch"] for r in got} == {0}
        for r in got:
            step = int(str(r["step"]))
            assert r["bucket"] == sched.bucket(step, rank), f"rank {rank} step {step}: another bucket"
            assert r["samples"] == sched.samples(step, rank).tolist(), (
                f"rank {rank} step {step}: other samples than the schedule"
            )
        state = json.loads((run / mode / f"rank-{rank}.state.json").read_text())
        expected = schedule_fingerprint(ds.fingerprint, config.fingerprint(), WORLD)
        assert state["schedule_fingerprint"] == expected, (
            "the server served another dataset or config than the one compared"
        )
        assert (state["epoch"], state["step"]) == (0, steps)


@pytest.mark.parametrize("mode", ["stride", "random"])
def test_loss_falls(run: Path, mode: str) -> None:
    loss = np.array([r["step_loss"] for r in records(run, mode, 0)], dtype=np.float64)
    assert np.isfinite(loss).all()
    assert loss[-5:].mean() < loss[:5].mean() - 0.3, f"{mode}: the loss did not fall: {loss.round(2)}"
    assert loss[0] == pytest.approx(np.log(512), abs=0.5), "an untrained model starts near log(vocab)"


def test_figure_and_summary(run: Path) -> None:
    assert (run / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary) == {"stride", "random"}
    for figures in summary.values():
        assert figures["steps"] == STEPS
        assert figures["windowed_std"] >= 0
    output = (run / "stdout.txt").read_text()
    assert "std of windowed loss" in output


def load_example(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``examples/train_ddp.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_ddp", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_ddp", example)  # its dataclasses look themselves up there
    spec.loader.exec_module(example)
    return example


def test_a_run_shorter_than_the_trend_still_gets_its_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--steps 10`` (a smoke test) with the default 64-step trend: a trend of the whole run, no crash."""
    example = load_example(monkeypatch)
    loss = np.linspace(3.0, 2.0, 15)
    assert example.moving_average(loss, 64).shape == loss.shape
    assert example.detrended(loss, 64).shape == loss.shape


def test_cuda_needs_a_gpu_for_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--device cuda`` puts rank r on GPU r (NCCL refuses two ranks on one): too few is a usage error."""
    import torch

    example = load_example(monkeypatch)
    world = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    with pytest.raises(SystemExit) as stopped:
        example.parse_args(["--device", "cuda", "--world-size", str(world)])
    assert stopped.value.code == 2
    assert f"--world-size {world}, {world - 1} GPU(s) here" in capsys.readouterr().err
    assert example.parse_args(["--world-size", str(world)]).device == "cpu"


@pytest.mark.parametrize("cut", ["docs", "code"])
def test_mix_dataset_cuts_and_shuffles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str) -> None:
    """``--mix copyright`` with named documents: one tokenizer, ``--piece``-token pieces, shuffled rows.

    ``--cut`` names the source cut into pieces (source 1: the documents, 0: the code).
    """
    example = load_example(monkeypatch)
    docs = [str(EXAMPLE.parents[1] / "README.md"), str(EXAMPLE.parents[1] / "docs" / "training.md")]
    args = example.parse_args(
        [
            "--out", str(tmp_path), "--mix", "copyright", "--mix-docs", *docs, "--piece", "64",
            "--text", str(STDLIB / "json"), "--vocab-size", "512", "--cut", cut,
        ]
    )  # fmt: skip
    ds = open_dataset(example.mix_dataset(args))
    source = np.array(ds.table.column("source").to_numpy())
    code_files = len(list((STDLIB / "json").glob("*.py")))
    cut_source, cut_files = (1, len(docs)) if cut == "docs" else (0, code_files)
    pieces = ds.lengths[source == cut_source]
    assert len(pieces) > 10
    assert pieces.max() == 64
    assert (pieces == 64).sum() >= len(pieces) - cut_files, "only a file's last piece is shorter"
    assert (source != cut_source).sum() > 10, "the other source's paragraphs are there too"
    first_piece = int(np.flatnonzero(source == cut_source)[0])
    assert first_piece < len(source) - len(pieces), "the rows are shuffled, not in source order"
    manifest = json.loads((tmp_path / "dataset" / "text.json").read_text())
    assert manifest["rows"] == ds.num_rows
    assert manifest["mix_docs"] == len(docs)
    assert example.mix_dataset(args) == tmp_path / "dataset", "made once, then reused"

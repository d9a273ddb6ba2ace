"""``ladle plan`` and ``ladle make-dataset`` as a user runs them (in process and as a real command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ladle.service.cli import format_cursor, format_job_names, main
from tests.support.pipes import into_closed_pipe

from .conftest import SMALL


def test_plan_json_keys(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(sample), "--world-size", "4", "--json", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in (
        "buckets",
        "num_steps",
        "world_size",
        "padding_efficiency",
        "max_run",
        "max_run_lower_bound",
        "max_share_deviation",
        "dropped",
    ):
        assert key in doc, f"plan --json lacks {key}"
    assert doc["world_size"] == 4
    assert len(doc["buckets"]) == 6
    row = doc["buckets"][0]
    for key in (
        "samples",
        "pct_samples",
        "avg_len",
        "max_len",
        "rows_per_batch",
        "batches",
        "pct_batches",
        "padding_efficiency",
    ):
        assert key in row
    served = sum(r["samples"] for r in doc["buckets"])
    assert served + doc["dropped_total"] == 3000, "plan lost samples"


def test_plan_table_compare_and_loss(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", str(sample), "--world-size", "2", "--compare", "random", "--simulate-loss", *SMALL])
        == 0
    )
    out = capsys.readouterr().out
    assert "% batches" in out
    assert "random" in out
    assert "longest run per bucket" in out
    assert "std of windowed loss" in out


def test_plan_json_compare(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(sample), "--json", "--compare", "random", "--simulate-loss", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compare"]["random"]["interleave"] == "random"
    assert set(doc["simulated_loss"]) == {"ladle", "random"}


def test_plan_config_file(sample: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[schedule]\nmax_seq_len = 512\nbucket_bounds = "auto"\nnum_buckets = 3\ntoken_budget = 2048\n'
    )
    assert main(["plan", str(sample), "--json", "--config", str(cfg)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["bucket_bounds"]) == 4


def test_errors_exit_2_with_one_line(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(sample / "nope")]) == 2
    assert "ladle: error:" in capsys.readouterr().err
    assert main(["plan", str(sample), "--bucket-bounds", "0,50,40,8193"]) == 2
    assert "bucket_bounds" in capsys.readouterr().err
    assert main(["plan", str(sample), "--world-size", "0"]) == 2
    assert "world_size" in capsys.readouterr().err


def test_console_script_runs(sample: Path) -> None:
    ladle = Path(sys.executable).with_name("ladle")
    out = subprocess.run(
        [str(ladle), "plan", str(sample), "--json", *SMALL],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout)["num_steps"] > 0


def test_a_closed_pipe_ends_quietly(sample: Path) -> None:
    # `ladle plan DS | head -3`: the reader goes away; no BrokenPipeError traceback
    done = into_closed_pipe([str(Path(sys.executable).with_name("ladle")), "plan", str(sample), *SMALL])
    assert done.stderr == "", f"a closed pipe printed: {done.stderr[-2000:]}"
    assert done.returncode == 1


def test_serve_with_an_impossible_state_path(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", str(sample), "--grpc-port", "0", "--no-http", "--state", "/proc/nope/state.db", *SMALL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladle: error: cursor store /proc/nope/state.db: cannot create its folder"), err
    assert err.count("\n") == 1, f"not one line: {err!r}"


@pytest.mark.parametrize(("grace", "shown"), [("inf", "inf"), ("nan", "nan"), ("-1", "-1.0")])
def test_serve_refuses_a_grace_that_is_not_finite_seconds(
    sample: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], grace: str, shown: str
) -> None:
    # inf and nan used to be accepted and crash the shutdown; -1 was taken silently
    from ladle.service import server as server_module

    monkeypatch.setattr(server_module, "serve_forever", lambda server, **files: 0)  # never serve here
    argv = ["serve", str(sample), "--grpc-port", "0", "--no-http", "--grace", grace, *SMALL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"ladle: error: grace: must be a finite number of seconds >= 0, got {shown}\n", err


def test_inspect_epoch_is_checked_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["inspect", "--server", "127.0.0.1:1", "--epoch", "-1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --epoch: must be >= 0, got -1" in err
    assert "greater_than_equal" not in err, "pydantic's raw error list reached the user"


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_help_names_every_command_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    top = _help(capsys)
    assert "jobs, inspect, health and make-dataset" in top, "ladle --help leaves a command out"
    serve = _help(capsys, "serve")
    for default in ("(default: 50051)", "(default: 8080)", "(default: .ladle/state.db)", "(default: 5)"):
        assert default in serve, f"ladle serve --help does not show {default}"
    assert "(default: 1.0)" in _help(capsys, "make-dataset")


def test_make_dataset_where_it_cannot_write_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-dataset", "/proc/ladle-nope/sample", "--rows", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ladle: error: out: cannot write /proc/ladle-nope/sample: "), err
    assert err.count("\n") == 1, f"not one line: {err!r}"


def test_make_dataset_into_a_folder_it_may_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # what uid 10001 gets in a root-owned volume (the tests may run as root, who may write anywhere)
    from ladle.service import synth

    def refused(out: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / ".sample.ladle-write-x"))

    monkeypatch.setattr(synth, "make_dataset", refused)
    assert main(["make-dataset", str(tmp_path / "sample"), "--rows", "10"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"ladle: error: out: cannot write {tmp_path / 'sample'}: Permission denied "
        f"({tmp_path / '.sample.ladle-write-x'})\n"
    ), err


def rank(number: int, seen: float | None) -> dict[str, object]:
    return {
        "rank": number, "epoch": 0, "step": 2 if seen is not None else 0, "progress": 0.0,
        "steps_in_epoch": 464, "lag_steps": 0 if seen is not None else 2, "generation": int(seen is not None),
        "last_seen": None if seen is None else 1796158935.3 - seen, "seen_ago_s": seen,
    }  # fmt: skip


def test_the_cursor_shows_a_rank_that_never_connected_as_never() -> None:
    text = format_cursor({"ranks": [rank(0, 3.4), rank(1, None)], "leader": {"epoch": 0, "step": 2}})
    rows = text.splitlines()[3:]
    assert rows[0].split()[-3:] == ["3s", "ago", "1"], rows[0]
    assert rows[1].split()[-2:] == ["never", "0"], f"a rank that never connected: {rows[1]!r}"


def listed(name: str, updated: float, served: bool) -> dict[str, object]:
    return {"job": name, "updated": updated, "served": served}


def test_inspect_names_a_few_jobs_of_a_big_store_newest_first() -> None:
    others = [listed(f"many-{i:04d}", 1000.0 + i, False) for i in range(150)]
    text = format_job_names([listed("late-job", 10.0, False), *others])
    assert text == (
        "jobs: none on this server's dataset and config; 151 of another dataset or config: "
        "many-0149, many-0148, many-0147, many-0146, many-0145 and 146 more"
    ), text
    mixed = format_job_names([listed("run-42", 5.0, True), listed("old", 1.0, True), *others])
    assert mixed.splitlines() == [
        "jobs: 2 on this server's dataset and config: run-42, old",
        "      150 of another dataset or config: many-0149, many-0148, many-0147, many-0146, many-0145 "
        "and 145 more",
    ], mixed
    assert format_job_names([]) == "jobs: none yet"
    assert max(len(line) for line in mixed.splitlines()) < 200, "one line of every job name"


def test_inspect_help_has_the_client_certificate(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "inspect")
    for option in (
        "--tls-cert PEM",
        "(default: $LADLE_TLS_CERT)",
        "--tls-key PEM",
        "(default: $LADLE_TLS_KEY)",
    ):
        assert option in text, f"ladle inspect --help lacks {option}"


def test_a_job_ttl_shorter_than_a_minute_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--job-ttl 0.0001 was taken: every job expired between two writes of a pausing trainer."""
    assert main(["serve", "no-such-dataset", "--job-ttl", "5"]) == 2
    err = capsys.readouterr().err
    assert "--job-ttl 5 s is shorter than 60 s" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (["--ack-flush-ms", "-1"], "--ack-flush-ms must be a number of milliseconds >= 0, got -1"),
        (["--ack-flush-ms", "nan"], "--ack-flush-ms must be a number of milliseconds >= 0, got nan"),
        (["--job-ttl", "-5"], "--job-ttl must be a number of seconds >= 0 (0: never), got -5"),
    ],
)
def test_bad_store_timings_are_named_as_their_flags(
    capsys: pytest.CaptureFixture[str], flags: list[str], shown: str
) -> None:
    """They were named in the server's own units: "ack_flush_s: must be >= 0, got -0.001"."""
    assert main(["serve", "no-such-dataset", *flags]) == 2
    err = capsys.readouterr().err
    assert shown in err, err
    assert "_s:" not in err, err


def test_health_asks_for_the_batch_service_by_default() -> None:
    """`ladle health` names the service without importing grpc; it must be the one the server registers."""
    from ladle.proto import rpc
    from ladle.service.cli import SERVICE_HEALTH, build_parser

    assert SERVICE_HEALTH == rpc.SERVICE
    assert build_parser().parse_args(["health"]).service == rpc.SERVICE


def test_plan_says_what_max_seq_len_cuts(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Truncation loses tokens as a drop loses samples: the plan says how many, in words and in JSON."""
    from ladle.service.dataset import open_dataset

    lengths = open_dataset(sample).lengths
    short = ["--max-seq-len", "100", "--bucket-bounds", "0,50,101", "--token-budget", "3072"]
    over = lengths[lengths > 100]
    assert over.size, "the sample has no row over 100 tokens"
    assert main(["plan", str(sample), *short, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cut"] == {
        "samples": int(over.size),
        "tokens_cut": int(over.sum() - 100 * over.size),
        "tokens": int(lengths.sum()),
    }
    assert main(["plan", str(sample), *short]) == 0
    out = capsys.readouterr().out
    assert f"note: {over.size:,} of 3,000 samples are longer than max_seq_len=100" in out, out
    assert "--overlong drop" in out
    assert main(["plan", str(sample), *short, "--overlong", "drop"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out
    assert f"overlong {over.size}" in out, "dropped samples are reported instead"
    assert main(["plan", str(sample), *short, "--overlong", "error"]) == 2
    err = capsys.readouterr().err
    assert f"{over.size} sample(s) longer than max_seq_len=100" in err, err
    assert "--overlong drop" in err, "the refusal names the flag that accepts them"
    wide = ["--max-seq-len", "3072", "--bucket-bounds", "0,76,206,3073"]
    assert main(["plan", str(sample), *SMALL, *wide]) == 0
    assert "note:" not in capsys.readouterr().out, "nothing is cut at 3072"


def test_demo_takes_the_dataset_as_plan_and_serve_do(capsys: pytest.CaptureFixture[str]) -> None:
    from ladle.service.cli import build_parser

    assert build_parser().parse_args(["demo", "some/dir"]).dataset_path == "some/dir"
    assert main(["demo", "some/dir", "--text", "x.py"]) == 2
    assert "give DATASET or --text, not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one way to name it: --dataset is gone
        build_parser().parse_args(["demo", "--dataset", "other/dir"])


def test_plan_hints_at_auto_edges_when_one_bucket_takes_nearly_all(
    sample: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The production edges fit one production mix; a dataset of short rows lands in their first bucket."""
    production = ["--bucket-bounds", "production"]
    assert main(["plan", str(sample), *production, "--token-budget", "8192"]) == 0
    out = capsys.readouterr().out
    assert "bucket bounds (the production preset): 0, 770, 1216, 1728, 2432, 3296, 8193" in out, out
    assert "of the samples fall in one bucket ([0, 770))" in out, out
    assert "--bucket-bounds auto" in out
    assert main(["plan", str(sample), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "fall in one bucket" not in out
    assert "bucket bounds (given): 0, 48, 76, 108, 152, 206, 513" in out, out
    assert main(["plan", str(sample), *production, "--max-seq-len", "32768", "--token-budget", "32768"]) == 2
    err = capsys.readouterr().err
    assert "last edge 8193 (the 'production' edges, for one production mix) must exceed" in err, err
    assert "--bucket-bounds auto" in err


def test_plan_fits_edges_by_default_and_shows_them(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """auto is the default: a longer max_seq_len needs no edges, and every plan prints the chosen ones."""
    assert main(["plan", str(sample), "--max-seq-len", "32768", "--token-budget", "32768"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("bucket bounds (auto"))
    edges = [int(e) for e in line.split(":", 1)[1].split(",")]
    assert (edges[0], edges[-1]) == (0, 32769), line
    assert edges == sorted(edges), line
    assert "fall in one bucket" not in out, "auto edges spread the rows"


def test_plan_check_values_prints_the_ranges(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(sample), *SMALL, "--check-values"]) == 0
    out = capsys.readouterr().out
    assert "values: input_ids 1..31999" in out, out
    assert "loss_mask 0..1: all fit the wire" in out, out
    assert "note: input_ids holds negative values" not in out
    assert main(["plan", str(sample), *SMALL, "--check-values", "--json"]) == 0
    values = json.loads(capsys.readouterr().out)["values"]
    assert values["loss_mask"] == {"min": 0, "max": 1}


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import ladle

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"ladle {ladle.__version__}"

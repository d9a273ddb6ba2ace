"""Saved datasets whose metadata or data files are not what save_to_disk writes: one clear error each.

A ``dataset_info.json`` or ``state.json`` that is valid JSON but not an object
crashed ``ladle serve`` with a traceback; a data file that is a FIFO (or
another file that is not a regular one) made it hang at start-up with no
message. Each is a ``DatasetError`` naming the file, which the CLI prints as
one ``ladle: error:`` line with exit code 2.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ladle.service.cli import main
from ladle.service.dataset import open_dataset
from ladle.service.errors import DatasetError
from ladle.service.synth import make_dataset

SHARD = "data-00000-of-00001.arrow"
NOT_OBJECTS: list[object] = [[], None, "a string", 3, 2.5, True]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corrupt") / "ds"
    make_dataset(path, 40, seed=1, scale=1 / 16)
    assert (path / SHARD).is_file()
    return path


@pytest.fixture
def dataset(saved: Path, tmp_path: Path) -> Path:
    """A fresh copy of a good saved dataset, for one test to break."""
    return Path(shutil.copytree(saved, tmp_path / "ds"))


def refused(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The error ``open_dataset`` raises, checked to be the one line ``ladle plan`` prints too."""
    with pytest.raises(DatasetError) as info:
        open_dataset(path)
    assert type(info.value) is DatasetError
    capsys.readouterr()
    assert main(["plan", str(path)]) == 2
    out, err = capsys.readouterr()
    assert not out
    assert err == f"ladle: error: {info.value}\n", err
    assert "Traceback" not in err
    return str(info.value)


def test_a_good_copy_opens(dataset: Path) -> None:
    assert open_dataset(dataset).num_rows == 40


@pytest.mark.parametrize("name", ["dataset_info.json", "state.json"])
@pytest.mark.parametrize("value", NOT_OBJECTS, ids=[json.dumps(v) for v in NOT_OBJECTS])
def test_metadata_that_is_json_but_not_an_object(
    dataset: Path, name: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    (dataset / name).write_text(json.dumps(value))
    message = refused(dataset, capsys)
    assert message.startswith(f"{dataset}: {name} holds "), message
    assert "not the JSON object save_to_disk writes" in message


@pytest.mark.parametrize("name", ["dataset_info.json", "state.json"])
def test_metadata_that_is_not_json(dataset: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    (dataset / name).write_bytes(b"{\xff")
    assert f"{name} is unreadable" in refused(dataset, capsys)


@pytest.mark.parametrize(
    ("data_files", "shown"),
    [
        (None, "null"),
        ("x.arrow", 'a string, "x.arrow"'),
        ([SHARD], "an array"),
        ([{"name": SHARD}], "an array"),
        ([{"filename": ""}], "an array"),
        ([{"filename": 3}], "an array"),
    ],
)
def test_data_files_not_as_save_to_disk_writes_them(
    dataset: Path, data_files: object, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    state = json.loads((dataset / "state.json").read_text())
    state["_data_files"] = data_files
    (dataset / "state.json").write_text(json.dumps(state))
    message = refused(dataset, capsys)
    assert f"state.json's _data_files is {shown}" in message, message
    del state["_data_files"]
    (dataset / "state.json").write_text(json.dumps(state))
    assert "state.json's _data_files is missing" in refused(dataset, capsys)


def test_a_listed_data_file_that_is_gone_is_named(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (dataset / SHARD).unlink()
    assert f"the data file {dataset / SHARD} does not exist" in refused(dataset, capsys)


def within(seconds: float, call: Callable[[], str], fifos: list[Path]) -> str:
    """``call()`` in a thread: a failure, not a hung suite, if it is still waiting after ``seconds``."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # pytest's Failed too: re-raised below
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():  # let the open that waits for a writer return, so the thread ends
        for fifo in fifos:
            with contextlib.suppress(OSError):  # ENXIO: nothing is waiting on it
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"opening the dataset still waited after {seconds} s (on a FIFO?)")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return str(outcome[0])


@pytest.fixture
def special(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], list[Path]]]:
    """Puts a file of a kind that is not a regular one in place of one of the dataset's files."""
    sockets: list[socket.socket] = []

    def make(name: str, kind: str) -> list[Path]:
        path = dataset / name
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link to a fifo":
            os.mkfifo(dataset / "elsewhere")
            path.symlink_to(dataset / "elsewhere")
            return [dataset / "elsewhere"]
        elif kind == "directory":
            path.mkdir()
        elif kind == "socket":
            monkeypatch.chdir(dataset)  # a relative name: a socket's path has a length limit
            sockets.append(socket.socket(socket.AF_UNIX))
            sockets[-1].bind(name)
        elif kind == "device":
            path.symlink_to("/dev/null")
        return [path] if kind == "fifo" else []

    yield make
    for sock in sockets:
        sock.close()


KINDS = {
    "fifo": "a FIFO (named pipe)",
    "link to a fifo": "a FIFO (named pipe)",
    "directory": "a directory",
    "socket": "a socket",
    "device": "a character device",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [SHARD, "state.json", "dataset_info.json"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_file_that_is_not_a_regular_file_is_refused_at_once(
    dataset: Path,
    special: Callable[[str, str], list[Path]],
    name: str,
    kind: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A FIFO made ``ladle serve`` wait for ever for a writer, with no message."""
    fifos = special(name, kind)
    message = within(20, lambda: refused(dataset, capsys), fifos)
    assert message == (
        f"{dataset}: {dataset / name} is {KINDS[kind]}, not a regular file: "
        "ladle reads only files save_to_disk wrote"
    )

"""The wire contract: generated code is current, frames round-trip zero-copy, bad frames are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from ladle.proto import codec, rpc
from ladle.proto import ladle_pb2 as pb
from ladle.proto.codec import WireFormatError

PROTO_DIR = Path(codec.__file__).parent
U32 = 2**32 - 1
U64 = 2**64 - 1
FORBIDDEN_IN_CLIENT = ("pyarrow", "datasets", "redis", "fastapi", "torch")


def make_arrays(rows: int, padded_len: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, padded_len + 1, size=rows, dtype=np.int32)
    keep = np.arange(padded_len)[None, :] < lengths[:, None]
    ids = rng.integers(-(2**31), 2**31, size=(rows, padded_len), dtype=np.int64).astype(np.int32)
    return {
        "input_ids": np.where(keep, ids, 0).astype(np.int32),
        "loss_mask": (keep & (rng.random((rows, padded_len)) < 0.8)).astype(np.int8),
        "lengths": lengths,
        "sample_ids": rng.integers(0, 2**63 - 1, size=rows, dtype=np.int64),
    }


def make_frame(
    rows: int = 5, padded_len: int = 7, seed: int = 0, **fields: Any
) -> tuple[bytes, dict[str, Any]]:
    arrays = make_arrays(rows, padded_len, seed)
    header: dict[str, Any] = {
        "epoch": 2,
        "step": 11,
        "rank": 3,
        "bucket": 4,
        "schedule_fingerprint": "0123456789abcdef",
    }
    header.update(fields)
    return codec.encode_batch(**header, **arrays), {**header, **arrays}


def based_on(array: npt.NDArray[Any], owner: object) -> bool:
    """Whether ``owner`` is on the ``.base`` chain of ``array`` (a view, not a copy)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
        if base is owner:
            return True
    return False


# ------------------------------------------------------------------ generated code


def test_generated_modules_match_the_proto() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ladle.proto.generate", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"generated modules are stale:\n{done.stdout}{done.stderr}"


def test_generated_grpc_module_imports_the_package_path() -> None:
    text = (PROTO_DIR / "ladle_pb2_grpc.py").read_text()
    assert "from ladle.proto import ladle_pb2" in text, "ladle_pb2_grpc does not import ladle.proto.ladle_pb2"
    assert "\nimport ladle_pb2" not in text, "ladle_pb2_grpc imports a bare top-level ladle_pb2"
    import ladle.proto.ladle_pb2_grpc as generated

    assert vars(generated)["ladle_dot_proto_dot_ladle__pb2"] is pb, "two copies of the messages module"


def test_client_side_modules_import_no_service_code() -> None:
    code = "import sys, json, ladle.proto.codec, ladle.proto.rpc; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = json.loads(out.stdout)
    leaked = [m for m in loaded if m.startswith("ladle.service") or m.split(".")[0] in FORBIDDEN_IN_CLIENT]
    assert not leaked, f"the protocol modules import {leaked}"


# ------------------------------------------------------------------ round trips


@given(
    rows=st.integers(1, 96),
    padded_len=st.integers(1, 4096),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, U64),
    step=st.integers(0, U64),
    rank=st.integers(0, U32),
    bucket=st.integers(0, U32),
    fingerprint=st.text(max_size=16),
)
@example(rows=1, padded_len=1, seed=0, epoch=0, step=0, rank=0, bucket=0, fingerprint="")
@example(rows=64, padded_len=768, seed=1, epoch=3, step=43_100, rank=7, bucket=0, fingerprint="ab" * 8)
@example(rows=6, padded_len=8192, seed=2, epoch=U64, step=U64, rank=U32, bucket=U32, fingerprint="é" * 16)
@example(rows=1, padded_len=49152, seed=3, epoch=1, step=1, rank=1, bucket=5, fingerprint="x")
@example(rows=3, padded_len=1, seed=4, epoch=1, step=1, rank=1, bucket=5, fingerprint="x")
def test_encode_decode_round_trip(
    rows: int, padded_len: int, seed: int, epoch: int, step: int, rank: int, bucket: int, fingerprint: str
) -> None:
    arrays = make_arrays(rows, padded_len, seed)
    frame = codec.encode_batch(
        epoch=epoch, step=step, rank=rank, bucket=bucket, schedule_fingerprint=fingerprint, **arrays
    )
    got = codec.decode_batch(frame)
    assert (got.epoch, got.step, got.rank, got.bucket) == (epoch, step, rank, bucket), "header fields changed"
    assert got.schedule_fingerprint == fingerprint
    assert (got.rows, got.padded_len) == (rows, padded_len)
    assert got.padded_tokens == rows * padded_len
    assert got.real_tokens == int(arrays["lengths"].sum()), "real_tokens is not the sum of lengths"
    for name in ("input_ids", "loss_mask", "lengths", "sample_ids"):
        value = getattr(got, name)
        np.testing.assert_array_equal(value, arrays[name], err_msg=f"{name} changed on the wire")
        assert value.dtype == np.dtype(codec._WIRE[name][1]), f"{name} has dtype {value.dtype}"
        assert value.ctypes.data % value.itemsize == 0, f"{name} view is misaligned"
    assert len(frame) <= codec.max_frame_bytes(rows * padded_len, rows), "frame beyond max_frame_bytes"


@given(rows=st.integers(1, 40), padded_len=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_encode_batch_pieces_is_encode_batch(rows: int, padded_len: int, seed: int) -> None:
    frame, sent = make_frame(rows=rows, padded_len=padded_len, seed=seed)
    ids, mask = sent["input_ids"], sent["loss_mask"]
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, rows * padded_len + 1, size=3))  # pieces need not follow rows
    pieces = codec.encode_batch_pieces(
        epoch=2,
        step=11,
        rank=3,
        bucket=4,
        schedule_fingerprint="0123456789abcdef",
        padded_len=padded_len,
        input_ids=[memoryview(p.tobytes()) for p in np.split(ids.reshape(-1), cuts)],
        loss_mask=[mask.tobytes()],
        lengths=sent["lengths"],
        sample_ids=sent["sample_ids"],
    )
    assert pieces == frame, "encode_batch_pieces and encode_batch disagree"


def test_encode_batch_pieces_refuses_pieces_of_the_wrong_size() -> None:
    _, sent = make_frame(rows=3, padded_len=5)
    header: dict[str, Any] = {"epoch": 0, "step": 0, "rank": 0, "bucket": 0, "schedule_fingerprint": ""}
    ids, mask = sent["input_ids"].tobytes(), sent["loss_mask"].tobytes()
    lengths, samples = sent["lengths"], sent["sample_ids"]
    with pytest.raises(WireFormatError, match="pieces hold 74 bytes"):
        codec.encode_batch_pieces(
            **header,
            padded_len=5,
            input_ids=[ids[:-1]],
            loss_mask=[mask],
            lengths=lengths,
            sample_ids=samples,
        )
    with pytest.raises(WireFormatError, match=r"lengths must lie in \[1, padded_len=4\]"):
        codec.encode_batch_pieces(
            **header, padded_len=4, input_ids=[ids], loss_mask=[mask], lengths=lengths, sample_ids=samples
        )


def test_decode_is_zero_copy_and_read_only() -> None:
    frame, _ = make_frame(rows=64, padded_len=768)
    got = codec.decode_batch(frame)
    raw = np.frombuffer(frame, dtype=np.uint8)
    for name in ("input_ids", "loss_mask", "lengths", "sample_ids"):
        value = getattr(got, name)
        assert np.shares_memory(value, raw), f"{name} is a copy, not a view of the frame"
        assert based_on(value, frame), f"{name} does not keep the frame alive through .base"
        assert not value.flags.writeable, f"{name} is writable: it aliases the received bytes"


def test_attention_mask_from_lengths() -> None:
    frame, sent = make_frame(rows=4, padded_len=9, seed=7)
    mask = codec.decode_batch(frame).attention_mask()
    assert mask.shape == (4, 9)
    np.testing.assert_array_equal(mask.sum(axis=1), sent["lengths"], err_msg="attention_mask row sums")
    np.testing.assert_array_equal(mask, np.arange(9)[None, :] < sent["lengths"][:, None])


def test_epoch_end_round_trip() -> None:
    got = codec.decode_frame(codec.encode_epoch_end(epoch=4, steps=43_100))
    assert got == codec.DecodedEpochEnd(epoch=4, steps=43_100)
    with pytest.raises(WireFormatError, match="expected a batch frame"):
        codec.decode_batch(codec.encode_epoch_end(epoch=4, steps=1))


def test_encode_takes_bool_mask_and_non_contiguous_arrays() -> None:
    arrays = make_arrays(6, 10, seed=3)
    wide = np.zeros((6, 20), dtype=np.int32)
    wide[:, ::2] = arrays["input_ids"]
    frame = codec.encode_batch(
        epoch=0,
        step=0,
        rank=0,
        bucket=0,
        schedule_fingerprint="f",
        input_ids=wide[:, ::2],
        loss_mask=arrays["loss_mask"].astype(bool),
        lengths=arrays["lengths"],
        sample_ids=arrays["sample_ids"],
    )
    got = codec.decode_batch(frame)
    np.testing.assert_array_equal(got.input_ids, arrays["input_ids"])
    np.testing.assert_array_equal(got.loss_mask, arrays["loss_mask"])


def test_encode_writes_little_endian_whatever_the_input_byte_order() -> None:
    arrays = make_arrays(3, 4, seed=5)
    swapped = {name: value.astype(value.dtype.newbyteorder(">")) for name, value in arrays.items()}
    frame = codec.encode_batch(epoch=0, step=0, rank=0, bucket=0, schedule_fingerprint="f", **swapped)
    got = codec.decode_batch(frame)
    for name in arrays:
        np.testing.assert_array_equal(getattr(got, name), arrays[name], err_msg=f"{name} byte order")
        assert getattr(got, name).dtype.str.startswith(("<", "|")), f"{name} is not little-endian"


@given(
    budget=st.integers(1, 70_000),
    max_rows=st.integers(1, 128),
    seed=st.integers(0, 2**32 - 1),
)
@example(budget=49152, max_rows=64, seed=0)
@example(budget=1, max_rows=1, seed=0)
def test_max_frame_bytes_bounds_every_batch_of_the_config(budget: int, max_rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, min(budget, max_rows) + 1))
    padded_len = int(rng.integers(1, budget // rows + 1))
    arrays = make_arrays(rows, padded_len, seed)
    frame = codec.encode_batch(
        epoch=U64,
        step=U64,
        rank=U32,
        bucket=U32,
        schedule_fingerprint="f" * codec.MAX_FINGERPRINT_BYTES,
        **arrays,
    )
    assert len(frame) <= codec.max_frame_bytes(budget, max_rows), "a frame exceeds max_frame_bytes"


def test_max_frame_bytes_production_config() -> None:
    size = codec.max_frame_bytes(49152, 64)
    payload = 5 * 49152 + 12 * 64  # input_ids + loss_mask + sample_ids + lengths
    assert payload < size < payload + 512, f"bound {size} is not payload {payload} plus a small header"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"input_ids": np.zeros((2, 3), dtype=np.int64)}, "input_ids must be int32"),
        ({"input_ids": np.zeros((2, 3), dtype=np.float32)}, "input_ids must be int32"),
        ({"loss_mask": np.zeros((2, 3), dtype=np.int32)}, "loss_mask must be int8"),
        ({"loss_mask": np.zeros((2, 4), dtype=np.int8)}, "loss_mask shape"),
        ({"input_ids": np.zeros(6, dtype=np.int32)}, "2 dimension"),
        ({"input_ids": np.zeros((0, 3), dtype=np.int32)}, "at least one row"),
        ({"lengths": np.array([3, 0], dtype=np.int32)}, r"row lengths must lie in \[1, padded_len=3\]"),
        ({"lengths": np.array([3, 4], dtype=np.int32)}, "row lengths"),
        ({"lengths": np.array([3], dtype=np.int32)}, "must both have shape"),
        ({"sample_ids": np.array([1, -1], dtype=np.int64)}, "sample_ids must be >= 0"),
        ({"sample_ids": np.array([1, 2], dtype=np.int32)}, "sample_ids must be int64"),
        ({"rank": -1}, "rank must be an integer"),
        ({"rank": 2**32}, "rank must be an integer"),
        ({"epoch": 2**64}, "epoch must be an integer"),
        ({"step": True}, "step must be an integer"),
        ({"schedule_fingerprint": "f" * 65}, "schedule_fingerprint is 65 bytes"),
        ({"schedule_fingerprint": 5}, "schedule_fingerprint must be a str"),
    ],
)
def test_encode_refuses_what_would_not_be_a_valid_frame(change: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {
        "epoch": 0,
        "step": 0,
        "rank": 0,
        "bucket": 0,
        "schedule_fingerprint": "f",
        "input_ids": np.zeros((2, 3), dtype=np.int32),
        "loss_mask": np.zeros((2, 3), dtype=np.int8),
        "lengths": np.array([3, 1], dtype=np.int32),
        "sample_ids": np.array([5, 6], dtype=np.int64),
    }
    args.update(change)
    with pytest.raises(WireFormatError, match=match):
        codec.encode_batch(**args)


# ------------------------------------------------------------------ malformed frames


def split(frame: bytes) -> tuple[pb.FrameHeader, bytes]:
    """A frame's parsed header and its payload."""
    length = int.from_bytes(frame[:4], "little")
    header = pb.FrameHeader()
    header.ParseFromString(frame[4 : 4 + length])
    start = -(-(4 + length) // 8) * 8
    return header, frame[start:]


def join(header: pb.FrameHeader, payload: bytes) -> bytes:
    """A frame from a (possibly edited) header and a payload, laid out as the contract says."""
    data: bytes = header.SerializeToString()
    head = 4 + len(data)
    return len(data).to_bytes(4, "little") + data + b"\0" * (-head % 8) + payload


def edited(mutate: Callable[[pb.FrameHeader], object], frame: bytes | None = None) -> bytes:
    header, payload = split(frame if frame is not None else make_frame()[0])
    mutate(header)
    return join(header, payload)


def test_split_and_join_rebuild_a_valid_frame() -> None:
    frame, _ = make_frame()
    assert edited(lambda h: None, frame) == frame, "the test helpers do not rebuild frames exactly"


def _set(path: str, value: Any) -> Callable[[pb.FrameHeader], None]:
    def mutate(header: pb.FrameHeader) -> None:
        *parents, leaf = path.split(".")
        target: Any = header
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)

    return mutate


MALFORMED_HEADERS: list[tuple[str, Callable[[pb.FrameHeader], object], str]] = [
    ("version 2", _set("version", 2), "frame version 2"),
    ("no kind", lambda h: h.ClearField("batch"), "names no known kind"),
    ("offset out of bounds", _set("batch.loss_mask.offset", 10_000), "lies outside the"),
    ("offset past the end", _set("batch.sample_ids.offset", U64 - 8), "lies outside the"),
    ("misaligned offset", _set("batch.sample_ids.offset", 4), "not a multiple of 8"),
    ("overlapping buffers", _set("batch.loss_mask.offset", 0), "overlap"),
    ("wrong dtype code", _set("batch.input_ids.dtype", pb.DTYPE_INT64), "input_ids has dtype DTYPE_INT64"),
    ("unknown dtype code", _set("batch.lengths.dtype", 99), "unknown dtype code 99"),
    ("unspecified dtype", _set("batch.loss_mask.dtype", pb.DTYPE_UNSPECIFIED), "DTYPE_UNSPECIFIED"),
    ("missing buffer", lambda h: h.batch.ClearField("sample_ids"), "lacks the sample_ids buffer"),
    ("rows without padded_tokens", _set("batch.rows", 6), "padded_tokens"),
    (
        "shape mismatch",
        lambda h: (_set("batch.rows", 7)(h), _set("batch.padded_len", 5)(h)),
        "bytes, its shape",
    ),
    ("zero rows", _set("batch.rows", 0), "no rows"),
    ("zero columns", _set("batch.padded_len", 0), "no rows or no columns"),
    ("buffer length", _set("batch.lengths.length", 24), "lengths buffer is 24 bytes"),
    ("real_tokens", lambda h: setattr(h.batch, "real_tokens", h.batch.real_tokens + 1), "real_tokens"),
    (
        "payload_bytes",
        lambda h: setattr(h.batch, "payload_bytes", h.batch.payload_bytes - 1),
        "its header says",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "match"), [m[1:] for m in MALFORMED_HEADERS], ids=[m[0] for m in MALFORMED_HEADERS]
)
def test_decode_refuses_a_malformed_header(mutate: Callable[[pb.FrameHeader], object], match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        codec.decode_frame(edited(mutate))


def test_decode_refuses_truncated_frames() -> None:
    frame, _ = make_frame(rows=3, padded_len=5)
    header_len = int.from_bytes(frame[:4], "little")
    for cut in sorted({0, 1, 3, 4, 5, 3 + header_len, 4 + header_len, len(frame) // 2, len(frame) - 1}):
        with pytest.raises(WireFormatError):
            codec.decode_frame(frame[:cut])
    with pytest.raises(WireFormatError, match="shorter than its 4-byte prefix"):
        codec.decode_frame(b"\x01\x00")
    with pytest.raises(WireFormatError, match="bytes after its header"):
        codec.decode_frame(codec.encode_epoch_end(1, 2) + b"\0")


def test_decode_refuses_trailing_bytes() -> None:
    frame, _ = make_frame()
    with pytest.raises(WireFormatError, match="its header says"):
        codec.decode_frame(frame + b"\0" * 8)


def test_decode_refuses_a_header_length_beyond_the_frame() -> None:
    frame, _ = make_frame()
    too_long = len(frame).to_bytes(4, "little") + frame[4:]
    with pytest.raises(WireFormatError, match="runs past the end"):
        codec.decode_frame(too_long)
    with pytest.raises(WireFormatError, match="runs past the end"):
        codec.decode_frame(b"\xff\xff\xff\xff" + frame[4:])


def test_decode_refuses_a_header_that_does_not_parse() -> None:
    frame, _ = make_frame()
    header_len = int.from_bytes(frame[:4], "little")
    broken = frame[:4] + b"\xff" * header_len + frame[4 + header_len :]
    with pytest.raises(WireFormatError):
        codec.decode_frame(broken)


def test_decode_refuses_bad_values_in_the_payload() -> None:
    frame, sent = make_frame(rows=3, padded_len=5)
    header, payload = split(frame)
    lengths_at = header.batch.lengths.offset
    too_long = np.array(sent["lengths"], dtype="<i4")
    too_long[1] = 6
    patched = payload[:lengths_at] + too_long.tobytes() + payload[lengths_at + 12 :]
    with pytest.raises(WireFormatError, match="row lengths"):
        codec.decode_frame(join(header, patched))
    samples_at = header.batch.sample_ids.offset
    negative = np.array(sent["sample_ids"], dtype="<i8")
    negative[2] = -1
    patched = payload[:samples_at] + negative.tobytes() + payload[samples_at + 24 :]
    with pytest.raises(WireFormatError, match="negative row indices"):
        codec.decode_frame(join(header, patched))


@given(st.binary(max_size=600))
@example(b"")
@example(b"\x00\x00\x00\x00")
@example(b"\x02\x00\x00\x00\x08\x01")
def test_random_bytes_never_decode(garbage: bytes) -> None:
    with pytest.raises(WireFormatError):
        codec.decode_frame(garbage)


@given(position=st.integers(0, 10_000), value=st.integers(0, 255), seed=st.integers(0, 1000))
def test_corrupted_frames_raise_only_wire_format_errors(position: int, value: int, seed: int) -> None:
    """One changed byte anywhere: either a still-valid frame or WireFormatError, never another error."""
    frame, _ = make_frame(rows=4, padded_len=9, seed=seed)
    at = position % len(frame)
    corrupted = frame[:at] + bytes([value]) + frame[at + 1 :]
    try:
        got = codec.decode_frame(corrupted)
    except WireFormatError:
        return
    if isinstance(got, codec.DecodedBatch):  # a valid frame must satisfy every invariant
        assert got.input_ids.shape == got.loss_mask.shape == (got.rows, got.padded_len)
        assert got.lengths.shape == got.sample_ids.shape == (got.rows,)
        assert int(got.lengths.sum()) == got.real_tokens


# ------------------------------------------------------------------ over gRPC


class OneBatchServer:
    """An in-process BatchService on 127.0.0.1 that answers Open with one batch frame and an epoch end."""

    def __init__(self, frames: list[bytes], max_frame: int) -> None:
        self.frames = frames
        self.opens: list[pb.Open] = []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4), options=rpc.message_options(max_frame)
        )
        self.server.add_generic_rpc_handlers((rpc.batch_service_handler(self.stream, self.describe),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.lock = threading.Lock()

    def stream(self, requests: Iterator[pb.StreamRequest], context: Any) -> Iterator[bytes]:
        first = next(requests)
        if first.WhichOneof("kind") != "open":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first request must be open")
        with self.lock:
            self.opens.append(first.open)
        yield from self.frames

    def describe(self, request: pb.DescribeRequest, context: Any) -> pb.JobInfo:
        if request.job != "run-42":
            error = pb.Error(code="NOT_FOUND", reason="unknown_job", message=f"no job {request.job!r}")
            context.set_trailing_metadata(rpc.error_trailer(error))
            context.abort(grpc.StatusCode.NOT_FOUND, error.message)
        return pb.JobInfo(
            job="run-42",
            world_size=8,
            bucket_bounds=[0, 770, 8193],
            max_frame_bytes=codec.max_frame_bytes(49152, 64),
        )


@pytest.fixture
def serve() -> Iterator[Callable[[list[bytes], int], OneBatchServer]]:
    started: list[OneBatchServer] = []

    def start(frames: list[bytes], max_frame: int) -> OneBatchServer:
        server = OneBatchServer(frames, max_frame)
        started.append(server)
        server.server.start()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.server.stop(grace=None).wait(10)


def open_request() -> Iterator[pb.StreamRequest]:
    yield pb.StreamRequest(open=pb.Open(job="run-42", rank=3, world_size=8, prefetch=4))


def test_a_frame_round_trips_through_grpc(serve: Callable[[list[bytes], int], OneBatchServer]) -> None:
    frame, sent = make_frame(rows=64, padded_len=768)
    server = serve([frame, codec.encode_epoch_end(2, 12)], codec.max_frame_bytes(49152, 64))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        client = rpc.BatchServiceClient(channel)
        received = list(client.stream(open_request(), timeout=30))
        info = client.describe("run-42", timeout=30)
        with pytest.raises(grpc.RpcError) as failed:
            client.describe("nope", timeout=30)
    assert [o.rank for o in server.opens] == [3], "the server did not receive the Open request"
    assert len(received) == 2, f"expected a batch and an epoch end, got {len(received)} frames"
    assert received[0] == frame, "the frame changed on the wire"
    got = codec.decode_batch(received[0])
    assert based_on(got.input_ids, received[0]), "decoded arrays are not views of the received bytes"
    for name in ("input_ids", "loss_mask", "lengths", "sample_ids"):
        np.testing.assert_array_equal(getattr(got, name), sent[name], err_msg=f"{name} over gRPC")
    assert codec.decode_frame(received[1]) == codec.DecodedEpochEnd(epoch=2, steps=12)
    assert (info.world_size, list(info.bucket_bounds)) == (8, [0, 770, 8193])
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    details = rpc.error_details(failed.value.trailing_metadata())
    assert details is not None, "the ladle-error-bin trailer is missing"
    assert details.reason == "unknown_job"


def test_frames_over_4_mib_need_the_receive_limit(
    serve: Callable[[list[bytes], int], OneBatchServer],
) -> None:
    budget = 1_200_000  # 6 MB frames: over gRPC's 4 MiB default receive limit
    frame, _ = make_frame(rows=2, padded_len=budget // 2)
    limit = codec.max_frame_bytes(budget, 64)
    assert len(frame) > 4 << 20
    server = serve([frame], limit)
    target = f"127.0.0.1:{server.port}"
    with grpc.insecure_channel(target, options=rpc.message_options(limit)) as channel:
        received = list(rpc.BatchServiceClient(channel).stream(open_request(), timeout=30))
    assert received == [frame], "a large frame did not arrive whole"
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
        list(rpc.BatchServiceClient(channel).stream(open_request(), timeout=30))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

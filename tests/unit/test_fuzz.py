"""Fuzzing the three parsers that take input ladle does not control.

* the schedule config loader (``ScheduleConfig.from_toml`` / ``from_mapping``):
  arbitrary bytes, arbitrary TOML documents and mutations of a valid one must
  load a config that satisfies every documented bound, or raise ``ConfigError``;
* ``BatchClient.load_state_dict``: arbitrary mappings (and non-mappings) must be
  accepted as a position the client can send, or refused with
  ``StateDictError``; the caller's dict is never changed and a refused state
  leaves the client as it was;
* the frame decoder (``codec.decode_frame``): arbitrary bytes, valid frames and
  frames with bytes or header fields changed must decode to arrays that lie
  inside the frame and agree with the header, or raise ``WireFormatError``.

CI runs ``LADLE_FUZZ_EXAMPLES`` (default 200) examples per test; a long run:
``LADLE_FUZZ_EXAMPLES=20000 pytest tests/unit/test_fuzz.py``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ladle.client import BatchClient, StateDictError
from ladle.proto import codec
from ladle.proto import ladle_pb2 as pb
from ladle.proto.codec import WireFormatError
from ladle.service.errors import ConfigError, LadleError
from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.schedule import config as config_module

FUZZ_EXAMPLES = int(os.environ.get("LADLE_FUZZ_EXAMPLES", "200"))

TINY = np.array([1, 5, 30, 7, 100, 3, 3, 64, 700, 2000], dtype=np.int64)

fuzz = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

FIELDS = sorted(ScheduleConfig.model_fields)

# Integers around every edge a field or an int64 array has, and far beyond.
EDGES = [0, 1, 2, 63, 64, 65, 4096, 4097, 2**20, 2**24, 2**28, 2**31, 2**53, 2**62, 2**63, 2**64, 10**40]
wide_ints = st.one_of(
    st.integers(-10, 10_000),
    st.sampled_from(EDGES).flatmap(lambda e: st.sampled_from([e - 1, e, e + 1, -e])),
    st.integers(),
)
scalars = st.one_of(
    wide_ints,
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["auto", "stride", "random", "sync", "mixed", "drop", "split", "0,48,513", "[0, 9000]"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def config_tables(draw: st.DrawFn) -> dict[str, Any]:
    """Valid values per field, up to every cap, a few fields left out or made odd."""
    top = draw(st.one_of(st.integers(1, 600), st.sampled_from([2**24 - 1, 2**24])))
    edges = draw(st.lists(st.integers(1, top), max_size=6, unique=True))
    last = draw(st.one_of(st.just(top + 1), st.integers(top + 1, top + 3))) if top < 2**24 else 2**24 + 1
    bounds = [draw(st.sampled_from([0, 1])), *sorted(edges), last]
    bounds = sorted(set(bounds))
    plausible: dict[str, Any] = {
        "max_seq_len": top,
        "bucket_bounds": draw(st.sampled_from(["auto", bounds, ",".join(map(str, bounds)), str(bounds)])),
        "num_buckets": draw(st.integers(1, 64)),
        "token_budget": min(2**28, top * draw(st.sampled_from([1, 2, 16, 2**10]))),
        "max_batch_size": draw(st.sampled_from([1, 64, 2**20])),
        "pad_to_multiple_of": 1,
        "seed": draw(st.sampled_from([0, 7, 2**63 - 1])),
        "interleave": draw(st.sampled_from(["stride", "random"])),
        "rank_mode": draw(st.sampled_from(["mixed", "sync"])),
        "grad_accum": draw(st.integers(1, 5)),
        "overlong": draw(st.sampled_from(["truncate", "drop", "error"])),
        "remainder": draw(st.sampled_from(["split", "drop"])),
        "sort_chunk": draw(st.sampled_from([1, 2048, 2**31])),
    }
    table = {}
    for name in FIELDS:
        choice = draw(st.sampled_from(["plausible"] * 16 + ["absent"] * 3 + ["odd"]))
        if choice == "plausible":
            table[name] = plausible[name]
        elif choice == "odd":
            table[name] = draw(values)
    return table


mappings = st.one_of(
    config_tables(),
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=12)), values, max_size=8),
)


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (a few of them invalid TOML on purpose: NUL, huge ints)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(table: Mapping[str, Any], section: bool) -> str:
    lines = ["[schedule]"] if section else []
    lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def check_config(config: ScheduleConfig) -> None:
    """What a loaded config guarantees: every bound, and a TOML round trip to an equal config."""
    assert 1 <= config.max_seq_len <= config_module.MAX_SEQ_LEN
    assert 1 <= config.token_budget <= config_module.MAX_TOKEN_BUDGET
    assert 1 <= config.max_batch_size <= config_module.MAX_BATCH_SIZE
    assert 1 <= config.sort_chunk <= config_module.MAX_SORT_CHUNK
    assert 0 <= config.seed < 2**63
    assert config.token_budget >= config_module.round_up(config.max_seq_len, config.pad_to_multiple_of)
    if config.bucket_bounds != "auto":
        bounds = config.bucket_bounds
        assert all(isinstance(b, int) for b in bounds)
        assert list(bounds) == sorted(set(bounds)), "bounds not strictly increasing"
        assert bounds[0] in (0, 1)
        assert config.max_seq_len < bounds[-1] <= config_module.MAX_SEQ_LEN + 1
    assert ScheduleConfig.from_mapping(json.loads(json.dumps(config.model_dump(mode="json")))) == config
    small = config.max_seq_len <= 1024 and (
        config.bucket_bounds == "auto" or config.bucket_bounds[-1] <= 1025
    )
    if small:  # and it makes a schedule (or refuses the data with a LadleError)
        with contextlib.suppress(LadleError):
            build_schedule(TINY, config, epoch=2**53 - 1, world_size=2)


@fuzz
@given(data=st.binary(max_size=300))
@example(data=b"\xff\xfe[schedule]")  # not UTF-8
@example(data=b"schedule = 3")
def test_config_from_arbitrary_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(data)
    try:
        config = ScheduleConfig.from_toml(path)
    except ConfigError:
        return
    check_config(config)


@fuzz
@given(table=mappings, section=st.booleans(), overrides=st.none() | mappings)
@example(table={"bucket_bounds": [0, 10**40]}, section=True, overrides=None)
@example(table={"max_seq_len": 10**15, "token_budget": 10**15}, section=False, overrides=None)
@example(table={"sort_chunk": 2**64, "max_batch_size": 10**30}, section=True, overrides=None)
def test_config_from_arbitrary_toml(
    tmp_path: Path, table: dict[str, Any], section: bool, overrides: dict[str, Any] | None
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(toml_document(table, section), encoding="utf-8", errors="surrogatepass")
    try:
        config = ScheduleConfig.from_toml(path, overrides)
    except ConfigError:
        return
    check_config(config)


@fuzz
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 4), st.text(max_size=6)), max_size=6))
def test_config_from_a_mutated_valid_file(tmp_path: Path, edits: list[tuple[int, int, str]]) -> None:
    text = ScheduleConfig().to_toml()
    for at, cut, insert in edits:
        at %= len(text) + 1
        text = text[:at] + insert + text[at + cut :]
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        config = ScheduleConfig.from_toml(path)
    except ConfigError:
        return
    check_config(config)


@fuzz
@given(data=mappings)
def test_config_from_arbitrary_mappings(data: dict[str, Any]) -> None:
    try:
        config = ScheduleConfig.from_mapping(data)
    except ConfigError:
        return
    check_config(config)


def test_a_config_at_every_cap_still_makes_a_schedule() -> None:
    """The caps are safe: no int64 overflow and bounded memory (~0.6 GB peak) at all of them at once."""
    top = config_module.MAX_SEQ_LEN
    lengths = np.array([1, 5, 30, 7, 100, 3, 64, top, top + 1], dtype=np.int64)
    for bounds in ((0, top + 1), "auto"):
        config = ScheduleConfig(
            max_seq_len=top,
            bucket_bounds=bounds,
            token_budget=config_module.MAX_TOKEN_BUDGET,
            max_batch_size=config_module.MAX_BATCH_SIZE,
            sort_chunk=config_module.MAX_SORT_CHUNK,
            pad_to_multiple_of=4096,
            num_buckets=64,
            grad_accum=4096,
            seed=2**63 - 1,
        )
        sched = build_schedule(lengths, config, epoch=2**53 - 1, world_size=2)
        assert sched.num_steps >= 1


def test_config_refuses_a_folder_and_an_unreadable_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config"):
        ScheduleConfig.from_toml(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        ScheduleConfig.from_toml(tmp_path / "missing.toml")


# ---------------------------------------------------------------- load_state_dict

STATE_KEYS = ("version", "job", "rank", "world_size", "epoch", "step", "schedule_fingerprint")
VALID = {
    "version": 1,
    "job": "fuzz",
    "rank": 1,
    "world_size": 2,
    "epoch": 3,
    "step": 5,
    "schedule_fingerprint": "0123456789abcdef",
}
odd_values = st.one_of(
    values,
    st.none(),
    st.binary(max_size=8),
    st.text(max_size=80),  # surrogates and other strings protobuf cannot send
    st.sampled_from(
        [
            np.int64(1),
            np.uint64(2**64 - 1),
            np.int32(-1),
            np.array([1, 2]),
            np.array(1),
            np.array(["fuzz", "fuzz"]),
            np.float64(1.0),
            float("nan"),
            "\ud800",
            "x" * 70,
            2**53,
            2**64,
        ]
    ),
)


@st.composite
def states(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "other"]))
    if kind == "other":
        return draw(
            st.one_of(st.none(), st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=3))
        )
    state: dict[Any, Any] = dict(VALID)
    for key in STATE_KEYS:
        action = draw(st.sampled_from(["keep", "keep", "drop", "replace"]))
        if action == "drop":
            del state[key]
        elif action == "replace":
            state[key] = draw(odd_values)
    state.update(draw(st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), values, max_size=2)))
    return state


def snapshot(state: Any) -> Any:
    if isinstance(state, dict):
        return {key: (type(value), pickle.dumps(value)) for key, value in state.items()}
    return pickle.dumps(state)


@fuzz
@given(state=states(), elastic=st.booleans())
@example(state=dict(VALID, version=True), elastic=False)
@example(state=dict(VALID, job=np.array(["fuzz", "fuzz"])), elastic=False)
@example(state=dict(VALID, version=np.array([1, 1])), elastic=False)
@example(state=dict(VALID, epoch=2**70), elastic=False)
@example(state=dict(VALID, schedule_fingerprint="\ud800"), elastic=False)
def test_load_state_dict_accepts_a_sendable_position_or_refuses(state: Any, elastic: bool) -> None:
    # the client connects on its first batch only: no server is needed here
    client = BatchClient(1, 2, "127.0.0.1:1", "fuzz", elastic=elastic)
    before = snapshot(state)
    try:
        client.load_state_dict(state)
    except StateDictError:
        assert client.position is None, "a refused state moved the client"
        assert snapshot(state) == before, "load_state_dict changed the caller's dict"
        return
    assert snapshot(state) == before, "load_state_dict changed the caller's dict"
    position = client.position
    assert position is not None
    assert all(type(v) is int for v in position)
    assert position == (int(state["epoch"]), int(state["step"]))
    # what the client will send on its first batch must be encodable
    opening = pb.Open(job=client.job, rank=client.rank, world_size=client.world_size)
    opening.start.CopyFrom(pb.Position(epoch=position[0], step=position[1]))
    if client._position.fingerprint is not None:
        opening.schedule_fingerprint = client._position.fingerprint
    assert pb.StreamRequest(open=opening).SerializeToString()
    client.close()


# ------------------------------------------------------------------ frame decoder


def batch_frame(rows: int, padded_len: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, padded_len + 1, size=rows).astype(np.int32)
    ids = rng.integers(0, 50_000, size=(rows, padded_len)).astype(np.int32)
    mask = (np.arange(padded_len)[None, :] < lengths[:, None]).astype(np.int8)
    return codec.encode_batch(
        epoch=int(rng.integers(0, 9)),
        step=int(rng.integers(0, 999)),
        rank=int(rng.integers(0, 8)),
        bucket=int(rng.integers(0, 6)),
        schedule_fingerprint="0123456789abcdef",
        input_ids=ids,
        loss_mask=mask,
        lengths=lengths,
        sample_ids=rng.integers(0, 10**6, size=rows).astype(np.int64),
    )


frames = st.one_of(
    st.builds(batch_frame, st.integers(1, 9), st.integers(1, 17), st.integers(0, 2**16)),
    st.builds(codec.encode_epoch_end, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.builds(
        lambda g, e, s, w: codec.encode_stream_start(
            generation=g, incarnation="inc", epoch=e, step=s, schedule_fingerprint="f" * 16, world_size=w
        ),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
    ),
)
# header fields the structured mutation may set, and values around their edges
HEADER_FIELDS = [
    "version",
    "batch.rows",
    "batch.padded_len",
    "batch.real_tokens",
    "batch.padded_tokens",
    "batch.payload_bytes",
    "batch.epoch",
    *(
        f"batch.{b}.{f}"
        for b in ("input_ids", "loss_mask", "lengths", "sample_ids")
        for f in ("dtype", "offset", "length")
    ),
]
field_values = st.one_of(
    st.integers(0, 300),
    st.integers(0, 40).map(lambda n: 4 * n),
    st.sampled_from([2**31 - 1, 2**32 - 1, 2**62, 2**63, 2**64 - 1]).flatmap(
        lambda e: st.sampled_from([e - 1, e])
    ),
)


def split(frame: bytes) -> tuple[pb.FrameHeader, bytes]:
    (size,) = struct.unpack_from("<I", frame)
    header = pb.FrameHeader()
    header.ParseFromString(frame[4 : 4 + size])
    return header, frame[(4 + size + 7) // 8 * 8 :]


def join(header: pb.FrameHeader, payload: bytes) -> bytes:
    raw: bytes = header.SerializeToString()
    head = 4 + len(raw)
    return struct.pack("<I", len(raw)) + raw + b"\0" * ((-head) % 8) + payload


@st.composite
def mutated_frames(draw: st.DrawFn) -> bytes:
    frame = draw(frames)
    if draw(st.booleans()) and codec.decode_frame(frame).__class__ is codec.DecodedBatch:
        header, payload = split(frame)
        for path in draw(st.lists(st.sampled_from(HEADER_FIELDS), min_size=1, max_size=4)):
            *parents, leaf = path.split(".")
            target: Any = header
            for part in parents:
                target = getattr(target, part)
            value = draw(field_values)
            if leaf in ("version", "rows", "padded_len", "dtype"):
                value %= 2**32 if leaf != "dtype" else 2**31
            setattr(target, leaf, value)
        cut = draw(st.sampled_from([0, 0, 0, -8, -1, 1, 8]))
        payload = payload[:cut] if cut < 0 else payload + bytes(cut)
        return join(header, payload)
    data = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "flip", "cut", "grow"]))
        if op == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[len(data) - draw(st.integers(0, min(len(data), 24))) :]
        else:
            data += draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def check_decoded(frame: bytes, decoded: codec.Decoded) -> None:
    """A decoded batch reads inside its frame only, and its arrays agree with its header."""
    if not isinstance(decoded, codec.DecodedBatch):
        return
    base = np.frombuffer(frame, dtype=np.uint8)
    lo, hi = base.__array_interface__["data"][0], base.__array_interface__["data"][0] + len(frame)
    for array in (decoded.input_ids, decoded.loss_mask, decoded.lengths, decoded.sample_ids):
        start = array.__array_interface__["data"][0]
        assert lo <= start, "an array starts before its frame"
        assert start + array.nbytes <= hi, "an array reads past the end of its frame"
        assert not array.flags.writeable
    rows, width = decoded.rows, decoded.padded_len
    assert decoded.input_ids.shape == decoded.loss_mask.shape == (rows, width)
    assert decoded.lengths.shape == decoded.sample_ids.shape == (rows,)
    assert decoded.lengths.min() >= 1
    assert decoded.lengths.max() <= width
    assert int(decoded.lengths.sum()) == decoded.real_tokens
    assert decoded.padded_tokens == rows * width
    assert decoded.sample_ids.min() >= 0
    assert decoded.attention_mask().shape == (rows, width)


@fuzz
@given(garbage=st.binary(max_size=2000))
@example(garbage=b"\xff\xff\xff\xff")
@example(garbage=b"\x00\x00\x00\x00\x00\x00\x00\x00")
def test_arbitrary_bytes_decode_or_raise_wire_format_error(garbage: bytes) -> None:
    try:
        decoded = codec.decode_frame(garbage)
    except WireFormatError:
        return
    check_decoded(garbage, decoded)


@fuzz
@given(frame=mutated_frames())
def test_mutated_frames_decode_or_raise_wire_format_error(frame: bytes) -> None:
    try:
        decoded = codec.decode_frame(frame)
    except WireFormatError:
        return
    check_decoded(frame, decoded)


@fuzz
@given(frame=frames)
def test_valid_frames_decode_from_every_buffer_type(frame: bytes) -> None:
    for view in (frame, bytearray(frame), memoryview(frame)):
        decoded = codec.decode_frame(view)
        if isinstance(view, bytes):
            check_decoded(frame, decoded)


# ------------------------------------------------------------------ the compiled decoder (proto/_codec.c)


def decode_in_python(frame: bytes | bytearray | memoryview) -> codec.Decoded | WireFormatError:
    """What codec's Python decoder makes of ``frame`` (the compiled fast case switched off), or its error."""
    compiled, codec._codec_c = codec._codec_c, None
    try:
        return codec.decode_frame(frame)
    except WireFormatError as exc:
        return exc
    finally:
        codec._codec_c = compiled


def assert_same_decoding(frame: bytes) -> None:
    """The compiled fast case takes only frames the Python decoder reads, and reads them the same."""
    if codec._codec_c is None:
        pytest.skip("the compiled codec is not built")
    fields = codec._codec_c.batch(frame)
    expected = decode_in_python(frame)
    if fields is None:  # left to the Python decoder: decode_frame gives exactly its answer
        try:
            got: codec.Decoded | WireFormatError = codec.decode_frame(frame)
        except WireFormatError as exc:
            got = exc
        assert type(got) is type(expected)
        if isinstance(got, WireFormatError):
            assert str(got) == str(expected)
        return
    assert isinstance(expected, codec.DecodedBatch), f"C read a frame Python refuses: {expected!r}"
    got_batch = codec.decode_frame(frame)
    assert isinstance(got_batch, codec.DecodedBatch)
    for name in codec.DecodedBatch._fields:
        mine, theirs = getattr(got_batch, name), getattr(expected, name)
        if isinstance(theirs, np.ndarray):
            assert mine.dtype == theirs.dtype, name
            assert mine.shape == theirs.shape, name
            assert mine.ctypes.data == theirs.ctypes.data, f"{name} is a view of another part of the frame"
            assert not mine.flags.writeable
        else:
            assert mine == theirs, name
            assert type(mine) is type(theirs), name


@fuzz
@given(frame=mutated_frames())
@example(frame=batch_frame(3, 5, 1))
def test_the_compiled_decoder_agrees_on_mutated_frames(frame: bytes) -> None:
    assert_same_decoding(frame)


@fuzz
@given(garbage=st.binary(max_size=600))
def test_the_compiled_decoder_agrees_on_arbitrary_bytes(garbage: bytes) -> None:
    assert_same_decoding(garbage)


@fuzz
@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    epoch=st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]),
    step=st.sampled_from([0, 7, 2**40, 2**64 - 1]),
    rank=st.sampled_from([0, 1, 2**32 - 1]),
    bucket=st.sampled_from([0, 3, 2**32 - 1]),
    fingerprint=st.text(max_size=20).filter(lambda t: len(t.encode()) <= codec.MAX_FINGERPRINT_BYTES),
)
def test_the_compiled_decoder_reads_every_frame_the_server_writes(
    rows: int, width: int, seed: int, epoch: int, step: int, rank: int, bucket: int, fingerprint: str
) -> None:
    """Every field at 0 (left out on the wire), at its top, and every shape: C reads it, as Python does."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width + 1, size=rows).astype(np.int32)
    frame = codec.encode_batch(
        epoch=epoch,
        step=step,
        rank=rank,
        bucket=bucket,
        schedule_fingerprint=fingerprint,
        input_ids=rng.integers(0, 2**31, size=(rows, width)).astype(np.int32),
        loss_mask=(rng.random((rows, width)) < 0.5).astype(np.int8),
        lengths=lengths,
        sample_ids=rng.integers(0, 2**63 - 1, size=rows, dtype=np.int64),
    )
    if codec._codec_c is not None:
        assert codec._codec_c.batch(frame) is not None, "the server's own frame left to the Python decoder"
    assert_same_decoding(frame)


def test_the_compiled_decoder_leaves_other_encodings_to_python() -> None:
    """A valid frame in another field order, with a duplicate or an unknown field: Python reads it."""
    frame = batch_frame(3, 5, 1)
    header, payload = split(frame)
    raw = header.SerializeToString()
    batch = header.batch.SerializeToString()
    reordered = b"\x12" + bytes([len(batch)]) + batch + b"\x08\x01"  # batch before version
    unknown = raw + b"\xa8\x06\x01"  # field 101, a varint: protobuf keeps it as unknown
    duplicate = b"\x08\x01" + raw  # version twice
    for variant in (reordered, unknown, duplicate):
        head = 4 + len(variant)
        other = struct.pack("<I", len(variant)) + variant + b"\0" * ((-head) % 8) + payload
        if codec._codec_c is not None:
            assert codec._codec_c.batch(other) is None
        decoded = codec.decode_frame(other)
        assert isinstance(decoded, codec.DecodedBatch)
        assert_same_decoding(other)


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")
def test_the_compiled_decoder_is_built_here() -> None:
    """Where a C compiler is (CI, development), the receive path's fast case is built and tested."""
    assert codec._codec_c is not None, "proto/_codec.c was not built (pip install -e . with gcc)"

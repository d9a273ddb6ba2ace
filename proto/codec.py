"""Batch frames: encode on the server, decode on the client, validate both ways.

A frame is ``[uint32 LE header length][FrameHeader protobuf][zero pad to 8][payload]``
(``proto/ladle.proto`` has the layout and why it was chosen). Encoding copies
the arrays once, into the one ``bytes`` object gRPC sends; decoding copies
nothing: the arrays are read-only numpy views onto the received frame, and
every offset, length, dtype and shape is checked first, so a bad frame raises
:class:`WireFormatError` and never yields a garbage array.

The module is pure (numpy and the generated messages only), so the server and
the client share it.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError  # type: ignore[import-untyped]

from ladle.proto import ladle_pb2 as pb


def _compiled_codec() -> Any:
    """The receive path's fast case in C (proto/_codec.c), or None: optional, the results are the same."""
    try:
        from ladle.proto import _codec  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - a build without a C compiler
        return None
    return _codec


_codec_c: Any = _compiled_codec()

__all__ = [
    "ALIGN",
    "JOB_NAME_PATTERN",
    "JOB_NAME_RULE",
    "MAX_FINGERPRINT_BYTES",
    "MAX_JOB_NAME_LEN",
    "PREFIX_BYTES",
    "WIRE_VERSION",
    "Decoded",
    "DecodedBatch",
    "DecodedEpochEnd",
    "DecodedStreamStart",
    "WireFormatError",
    "batch_frame_head",
    "decode_batch",
    "decode_frame",
    "encode_batch",
    "encode_batch_pieces",
    "encode_epoch_end",
    "encode_stream_start",
    "max_frame_bytes",
]

WIRE_VERSION: Final = 1
PREFIX_BYTES: Final = 4
"""The header length prefix: a little-endian uint32."""
ALIGN: Final = 8
"""The payload starts at a multiple of this from the frame's first byte."""
MAX_FINGERPRINT_BYTES: Final = 64
"""Longest schedule fingerprint (UTF-8 bytes) a frame may carry; bounds the header."""
MAX_JOB_NAME_LEN: Final = 200
JOB_NAME_PATTERN: Final = rf"[A-Za-z0-9._:-]{{1,{MAX_JOB_NAME_LEN}}}"
"""What an ``Open.job`` may be (a key of the cursor store); the client checks it before sending."""
JOB_NAME_RULE: Final = f"1..{MAX_JOB_NAME_LEN} characters of A-Z a-z 0-9 . _ : -"

_U32: Final = 2**32 - 1
_U64: Final = 2**64 - 1
_PREFIX: Final = struct.Struct("<I")
_PADS: Final = tuple(b"\0" * n for n in range(ALIGN))

I8 = npt.NDArray[np.int8]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

# The wire dtype of each buffer, by header field.
_WIRE: Final[dict[str, tuple[int, np.dtype[np.signedinteger]]]] = {
    "input_ids": (pb.DTYPE_INT32, np.dtype("<i4")),
    "loss_mask": (pb.DTYPE_INT8, np.dtype("<i1")),
    "lengths": (pb.DTYPE_INT32, np.dtype("<i4")),
    "sample_ids": (pb.DTYPE_INT64, np.dtype("<i8")),
}
_I1, _I4, _I8 = _WIRE["loss_mask"][1], _WIRE["input_ids"][1], _WIRE["sample_ids"][1]
_PER_TOKEN: Final = frozenset({"input_ids", "loss_mask"})  # [rows, padded_len]; the rest are [rows]
_DTYPE_NAMES: Final = {value: name for name, value in pb.Dtype.items()}


class WireFormatError(ValueError):
    """A frame (or the arrays given to encode one) breaks the wire contract."""


class DecodedBatch(NamedTuple):
    """One batch as received: header fields and zero-copy, read-only array views.

    The arrays share memory with the frame they were decoded from and keep it
    alive; copy them (``np.array(x)``) to write to them. Immutable; a named
    tuple because a trainer makes one a batch, and it is the cheapest to make.
    """

    epoch: int
    step: int
    rank: int
    bucket: int
    rows: int
    padded_len: int
    real_tokens: int
    padded_tokens: int
    schedule_fingerprint: str
    input_ids: I32
    """int32 [rows, padded_len]; padding holds 0."""
    loss_mask: I8
    """int8 [rows, padded_len]."""
    lengths: I32
    """int32 [rows]: real tokens of each row (left-aligned)."""
    sample_ids: I64
    """int64 [rows]: the dataset row of each row."""

    def attention_mask(self, dtype: npt.DTypeLike = np.int8) -> npt.NDArray[np.generic]:
        """A new [rows, padded_len] array: 1 on each row's real tokens, 0 on its padding."""
        positions = np.arange(self.padded_len, dtype=np.int32)
        mask = positions[None, :] < self.lengths[:, None]
        if np.dtype(dtype).itemsize == 1 and np.dtype(dtype).kind in "iu":
            return mask.view(dtype)  # bool is one byte of 0 or 1 already: no second pass
        return mask.astype(dtype)


@dataclass(frozen=True, slots=True)
class DecodedEpochEnd:
    """The marker the server sends after the last step of an epoch."""

    epoch: int
    steps: int


@dataclass(frozen=True, slots=True)
class DecodedStreamStart:
    """The first frame of a stream: the server's start position, schedule, generation and incarnation."""

    generation: int
    incarnation: str
    epoch: int
    step: int
    schedule_fingerprint: str
    world_size: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_int(name: str, value: int, top: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value <= top:
        raise WireFormatError(f"{name} must be an integer in [0, {top}], got {value!r}")


def _wire_array(name: str, array: npt.ArrayLike, ndim: int) -> npt.NDArray[np.signedinteger]:
    """``array`` as a C-contiguous array of its wire dtype, without copying when it already is one."""
    _, wire = _WIRE[name]
    arr = np.asarray(array)
    if name == "loss_mask" and arr.dtype in (np.dtype(np.bool_), np.dtype(np.uint8)):
        arr = arr.view(np.int8)  # same bytes: 0/1 flags
    if arr.dtype.kind != "i" or arr.dtype.itemsize != wire.itemsize:
        raise WireFormatError(f"{name} must be {wire.name} ({wire.str}), got {arr.dtype}")
    if arr.ndim != ndim:
        raise WireFormatError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=wire)


def _raw(array: npt.NDArray[np.signedinteger]) -> memoryview:
    """The bytes of a C-contiguous array, as a flat byte view (no copy, any byte order)."""
    return array.reshape(-1).view(np.uint8).data


def _payload_layout(rows: int, tokens: int) -> tuple[int, int, int, int, int]:
    """Offsets of input_ids, sample_ids, lengths, loss_mask and the payload size.

    input_ids first (offset 0, the payload is 8-aligned), then the int64 ids
    at the next multiple of 8, then the int32 lengths (still 8-aligned), then
    the int8 mask, which needs no alignment.
    """
    ids_at = 0
    sample_at = _align(4 * tokens)
    lengths_at = sample_at + 8 * rows
    mask_at = lengths_at + 4 * rows
    return ids_at, sample_at, lengths_at, mask_at, mask_at + tokens


def encode_batch(
    *,
    epoch: int,
    step: int,
    rank: int,
    bucket: int,
    schedule_fingerprint: str,
    input_ids: npt.ArrayLike,
    loss_mask: npt.ArrayLike,
    lengths: npt.ArrayLike,
    sample_ids: npt.ArrayLike,
) -> bytes:
    """One batch frame: the header, then the four arrays, joined with a single copy.

    ``input_ids`` (int32) and ``loss_mask`` (int8; bool or uint8 are taken as
    the same bytes) are [rows, padded_len]; ``lengths`` (int32, each in
    [1, padded_len]) and ``sample_ids`` (int64, >= 0) are [rows]. Arrays of
    the wire dtype and C order are not copied before the join; the token
    counts are derived. Raises WireFormatError when the arrays or fields
    would not make a valid frame.
    """
    ids = _wire_array("input_ids", input_ids, 2)
    mask = _wire_array("loss_mask", loss_mask, 2)
    rows, padded_len = ids.shape
    if rows < 1 or padded_len < 1:
        raise WireFormatError(f"a batch needs at least one row and one column, got shape {ids.shape}")
    if mask.shape != ids.shape:
        raise WireFormatError(f"loss_mask shape {mask.shape} differs from input_ids shape {ids.shape}")
    lens, samples, real_tokens = _check_rows(lengths, sample_ids, rows, padded_len)
    head, gap = batch_frame_head(
        epoch, step, rank, bucket, schedule_fingerprint, rows, padded_len, real_tokens
    )
    return b"".join((head, _raw(ids), gap, _raw(samples), _raw(lens), _raw(mask)))


def encode_batch_pieces(
    *,
    epoch: int,
    step: int,
    rank: int,
    bucket: int,
    schedule_fingerprint: str,
    padded_len: int,
    input_ids: Sequence[bytes | bytearray | memoryview],
    loss_mask: Sequence[bytes | bytearray | memoryview],
    lengths: npt.ArrayLike,
    sample_ids: npt.ArrayLike,
) -> bytes:
    """``encode_batch`` for arrays given as byte pieces: the frame is joined straight from them.

    ``input_ids`` joined must be the little-endian int32 bytes of the
    [rows, padded_len] array, row after row, and ``loss_mask`` joined its int8
    bytes; rows is ``len(lengths)``. A server gathering rows from a
    memory-mapped dataset (``Assembler.pieces``: each row's tokens, then a
    shared pad) copies every byte once, into the frame, instead of into the
    arrays first. The fields, ``lengths`` and ``sample_ids`` are checked as by
    ``encode_batch``, and pieces whose total size is not rows x padded_len
    items raise WireFormatError; what the pieces hold is the caller's.
    """
    rows = len(_wire_array("lengths", lengths, 1))
    padded_len = _check_shape(rows, padded_len)
    lens, samples, real_tokens = _check_rows(lengths, sample_ids, rows, padded_len)
    head, gap = batch_frame_head(
        epoch, step, rank, bucket, schedule_fingerprint, rows, padded_len, real_tokens
    )
    frame = b"".join([head, *input_ids, gap, _raw(samples), _raw(lens), *loss_mask])
    tokens = rows * padded_len
    given = len(frame) - (len(head) + len(gap) + 12 * rows)
    if given != 5 * tokens:
        raise WireFormatError(
            f"the input_ids and loss_mask pieces hold {given} bytes, rows x padded_len = {tokens} "
            f"tokens need {5 * tokens}"
        )
    return frame


def _check_shape(rows: int, padded_len: int) -> int:
    """``padded_len`` as an int, after checking a batch of that shape can be framed."""
    _check_int("padded_len", padded_len, _U32)
    padded_len = int(padded_len)
    if rows < 1 or padded_len < 1:
        raise WireFormatError(f"a batch needs at least one row and one column, got ({rows}, {padded_len})")
    return padded_len


def _check_rows(
    lengths: npt.ArrayLike, sample_ids: npt.ArrayLike, rows: int, padded_len: int
) -> tuple[I32, I64, int]:
    """The wire arrays of ``lengths`` and ``sample_ids`` (checked), and the real token count."""
    lens = _wire_array("lengths", lengths, 1)
    samples = _wire_array("sample_ids", sample_ids, 1)
    if lens.shape != (rows,) or samples.shape != (rows,):
        raise WireFormatError(
            f"lengths {lens.shape} and sample_ids {samples.shape} must both have shape ({rows},)"
        )
    real_tokens = _check_lengths(lens, padded_len)
    if min(samples.tolist()) < 0:
        raise WireFormatError("sample_ids must be >= 0")
    return lens, samples, real_tokens


def batch_frame_head(
    epoch: int,
    step: int,
    rank: int,
    bucket: int,
    schedule_fingerprint: str,
    rows: int,
    padded_len: int,
    real_tokens: int,
) -> tuple[bytes, bytes]:
    """A batch frame's bytes before input_ids (prefix, header, zero pad) and between it and sample_ids.

    Checks its fields, not the rows: a caller outside this module (the
    server's compiled row plan) has checked that each length lies in [1,
    padded_len], that they sum to ``real_tokens`` and that the sample ids are
    row indices. Raises WireFormatError for fields that would not make a
    valid frame.
    """
    for name, value, top in (("epoch", epoch, _U64), ("step", step, _U64), ("rank", rank, _U32)):
        _check_int(name, value, top)
    _check_int("bucket", bucket, _U32)
    _check_int("rows", rows, _U32)
    rows = int(rows)
    padded_len = _check_shape(rows, padded_len)
    _check_int("real_tokens", real_tokens, rows * padded_len)
    if not isinstance(schedule_fingerprint, str):
        raise WireFormatError(
            f"schedule_fingerprint must be a str, got {type(schedule_fingerprint).__name__}"
        )
    fingerprint = schedule_fingerprint.encode()
    if len(fingerprint) > MAX_FINGERPRINT_BYTES:
        raise WireFormatError(
            f"schedule_fingerprint is {len(fingerprint)} bytes, at most {MAX_FINGERPRINT_BYTES}"
        )

    tokens = rows * padded_len
    ids_at, sample_at, lengths_at, mask_at, payload = _payload_layout(rows, tokens)
    # set field by field: cheaper than building the nested messages from keywords
    frame_header = pb.FrameHeader(version=WIRE_VERSION)
    h = frame_header.batch
    h.epoch, h.step, h.rank, h.bucket = int(epoch), int(step), int(rank), int(bucket)
    h.rows, h.padded_len, h.real_tokens, h.padded_tokens = rows, padded_len, real_tokens, tokens
    h.schedule_fingerprint, h.payload_bytes = schedule_fingerprint, payload
    for buf, dtype, offset, length in (
        (h.input_ids, pb.DTYPE_INT32, ids_at, 4 * tokens),
        (h.loss_mask, pb.DTYPE_INT8, mask_at, tokens),
        (h.lengths, pb.DTYPE_INT32, lengths_at, 4 * rows),
        (h.sample_ids, pb.DTYPE_INT64, sample_at, 8 * rows),
    ):
        buf.dtype, buf.offset, buf.length = dtype, offset, length
    header: bytes = frame_header.SerializeToString()
    head = PREFIX_BYTES + len(header)
    return _PREFIX.pack(len(header)) + header + _PADS[_align(head) - head], _PADS[sample_at - 4 * tokens]


def encode_epoch_end(epoch: int, steps: int) -> bytes:
    """The frame that marks the end of ``epoch`` (``steps`` steps long)."""
    _check_int("epoch", epoch, _U64)
    _check_int("steps", steps, _U64)
    header: bytes = pb.FrameHeader(
        version=WIRE_VERSION, epoch_end=pb.EpochEnd(epoch=int(epoch), steps=int(steps))
    ).SerializeToString()
    return _PREFIX.pack(len(header)) + header


def encode_stream_start(
    *, generation: int, incarnation: str, epoch: int, step: int, schedule_fingerprint: str, world_size: int
) -> bytes:
    """The first frame of a stream (see ``StreamStart`` in ladle.proto)."""
    for name, value in (("generation", generation), ("epoch", epoch), ("step", step)):
        _check_int(name, value, _U64)
    _check_int("world_size", world_size, _U32)
    header: bytes = pb.FrameHeader(
        version=WIRE_VERSION,
        start=pb.StreamStart(
            generation=int(generation),
            incarnation=incarnation,
            position=pb.Position(epoch=int(epoch), step=int(step)),
            schedule_fingerprint=schedule_fingerprint,
            world_size=int(world_size),
        ),
    ).SerializeToString()
    return _PREFIX.pack(len(header)) + header


def max_frame_bytes(token_budget: int, max_batch_size: int) -> int:
    """The largest frame a batch can take under this config: set gRPC's message limits from it.

    A batch has rows x padded_len <= token_budget and rows <= max_batch_size;
    the header is bounded by taking every integer at its widest varint and the
    fingerprint at MAX_FINGERPRINT_BYTES. Pass the result (or more) as
    ``grpc.max_send_message_length`` on the server and
    ``grpc.max_receive_message_length`` on the client.
    """
    if token_budget < 1 or max_batch_size < 1:
        raise ValueError("token_budget and max_batch_size must be >= 1")
    widest = pb.Buffer(dtype=pb.DTYPE_INT64, offset=_U64, length=_U64)
    header = pb.FrameHeader(
        version=WIRE_VERSION,
        batch=pb.BatchHeader(
            epoch=_U64,
            step=_U64,
            rank=_U32,
            bucket=_U32,
            rows=_U32,
            padded_len=_U32,
            real_tokens=_U64,
            padded_tokens=_U64,
            schedule_fingerprint="f" * MAX_FINGERPRINT_BYTES,
            payload_bytes=_U64,
            input_ids=widest,
            loss_mask=widest,
            lengths=widest,
            sample_ids=widest,
        ),
    )
    rows = min(token_budget, max_batch_size)
    # input_ids and loss_mask hold rows x padded_len <= token_budget items; the
    # int64 ids need at most 4 bytes of alignment padding after input_ids.
    payload = 5 * token_budget + 4 + 12 * rows
    return _align(PREFIX_BYTES + header.ByteSize()) + payload


Decoded = DecodedBatch | DecodedEpochEnd | DecodedStreamStart


def decode_frame(frame: bytes | bytearray | memoryview) -> Decoded:
    """Parse and check one frame; a batch's arrays are zero-copy views onto ``frame``.

    Raises WireFormatError, with a message that says what is wrong, for a
    truncated or padded frame, a header that does not parse, an unknown
    version or kind, a buffer with the wrong dtype, size, alignment or place,
    overlapping buffers, or lengths and counts that disagree with the shape.
    """
    if _codec_c is not None:
        fields = _codec_c.batch(frame)  # a batch frame as the server writes it, every check made in C
        if fields is not None:
            return _fast_batch(frame, *fields)
    size = len(frame)
    if size < PREFIX_BYTES:
        raise WireFormatError(f"frame of {size} bytes is shorter than its {PREFIX_BYTES}-byte prefix")
    (header_len,) = _PREFIX.unpack_from(frame, 0)
    head = PREFIX_BYTES + header_len
    if head > size:
        raise WireFormatError(f"header length {header_len} runs past the end of a {size}-byte frame")
    header = pb.FrameHeader()
    try:
        header.ParseFromString(bytes(frame[PREFIX_BYTES:head]))
    except DecodeError as exc:
        raise WireFormatError(f"frame header does not parse: {exc}") from None
    if header.version != WIRE_VERSION:
        raise WireFormatError(f"frame version {header.version}, this decoder reads {WIRE_VERSION}")
    kind = header.WhichOneof("kind")
    if kind in ("epoch_end", "start") and head != size:
        raise WireFormatError(f"{kind} frame has {size - head} bytes after its header")
    if kind == "epoch_end":
        return DecodedEpochEnd(epoch=header.epoch_end.epoch, steps=header.epoch_end.steps)
    if kind == "start":
        start = header.start
        return DecodedStreamStart(
            generation=start.generation,
            incarnation=start.incarnation,
            epoch=start.position.epoch,
            step=start.position.step,
            schedule_fingerprint=start.schedule_fingerprint,
            world_size=start.world_size,
        )
    if kind != "batch":
        raise WireFormatError("frame header names no known kind (batch, epoch_end or start)")
    return _decode_batch(header.batch, frame, _align(head), size)


def decode_batch(frame: bytes | bytearray | memoryview) -> DecodedBatch:
    """Like decode_frame, but the frame must hold a batch."""
    decoded = decode_frame(frame)
    if not isinstance(decoded, DecodedBatch):
        raise WireFormatError(f"expected a batch frame, got {type(decoded).__name__}")
    return decoded


def _decode_batch(
    h: pb.BatchHeader, frame: bytes | bytearray | memoryview, start: int, size: int
) -> DecodedBatch:
    rows, padded_len, payload = h.rows, h.padded_len, h.payload_bytes
    if rows < 1 or padded_len < 1:
        raise WireFormatError(f"batch shape ({rows}, {padded_len}) has no rows or no columns")
    tokens = rows * padded_len
    if h.padded_tokens != tokens:
        raise WireFormatError(f"padded_tokens {h.padded_tokens} != rows x padded_len = {tokens}")
    if start + payload != size:
        raise WireFormatError(
            f"frame holds {size} bytes, its header says {start + payload} "
            f"(payload of {payload} at offset {start})"
        )
    ids, mask, lens, samples = h.input_ids, h.loss_mask, h.lengths, h.sample_ids
    _, sample_at, lengths_at, mask_at, canonical = _payload_layout(rows, tokens)
    if (
        payload == canonical
        and (ids.dtype, ids.offset, ids.length) == (pb.DTYPE_INT32, 0, 4 * tokens)
        and (mask.dtype, mask.offset, mask.length) == (pb.DTYPE_INT8, mask_at, tokens)
        and (lens.dtype, lens.offset, lens.length) == (pb.DTYPE_INT32, lengths_at, 4 * rows)
        and (samples.dtype, samples.offset, samples.length) == (pb.DTYPE_INT64, sample_at, 8 * rows)
    ):
        # the layout encode_batch writes: in bounds, aligned and disjoint by construction
        views = [
            np.frombuffer(frame, dtype=_I4, count=tokens, offset=start),
            np.frombuffer(frame, dtype=_I1, count=tokens, offset=start + mask_at),
            np.frombuffer(frame, dtype=_I4, count=rows, offset=start + lengths_at),
            np.frombuffer(frame, dtype=_I8, count=rows, offset=start + sample_at),
        ]
    else:
        views = _general_views(h, frame, start, rows, tokens, payload)
    input_ids, loss_mask, lengths, sample_ids = views
    real = _check_lengths(lengths, padded_len)
    if real != h.real_tokens:
        raise WireFormatError(f"real_tokens {h.real_tokens} != sum of lengths {real}")
    if min(sample_ids.tolist()) < 0:
        raise WireFormatError("sample_ids holds negative row indices")
    return DecodedBatch(
        epoch=h.epoch,
        step=h.step,
        rank=h.rank,
        bucket=h.bucket,
        rows=rows,
        padded_len=padded_len,
        real_tokens=real,
        padded_tokens=tokens,
        schedule_fingerprint=h.schedule_fingerprint,
        input_ids=input_ids.reshape(rows, padded_len),
        loss_mask=loss_mask.reshape(rows, padded_len),
        lengths=lengths,
        sample_ids=sample_ids,
    )


def _fast_batch(
    frame: bytes | bytearray | memoryview,
    epoch: int,
    step: int,
    rank: int,
    bucket: int,
    rows: int,
    padded_len: int,
    real_tokens: int,
    schedule_fingerprint: str,
    start: int,
    sample_at: int,
    lengths_at: int,
    mask_at: int,
) -> DecodedBatch:
    """The batch ``_codec.batch`` read and checked: the views of its canonical layout."""
    return DecodedBatch(
        epoch=epoch,
        step=step,
        rank=rank,
        bucket=bucket,
        rows=rows,
        padded_len=padded_len,
        real_tokens=real_tokens,
        padded_tokens=rows * padded_len,
        schedule_fingerprint=schedule_fingerprint,
        # np.ndarray over the frame: the view frombuffer and reshape make, in one call
        input_ids=np.ndarray((rows, padded_len), _I4, frame, start),
        loss_mask=np.ndarray((rows, padded_len), _I1, frame, start + mask_at),
        lengths=np.ndarray((rows,), _I4, frame, start + lengths_at),
        sample_ids=np.ndarray((rows,), _I8, frame, start + sample_at),
    )


def _general_views(
    h: pb.BatchHeader, frame: bytes | bytearray | memoryview, start: int, rows: int, tokens: int, payload: int
) -> list[npt.NDArray[np.signedinteger]]:
    """The four arrays of a batch whose buffers lie anywhere in the payload, each placement checked."""
    spans: list[tuple[int, int, str]] = []
    views: list[npt.NDArray[np.signedinteger]] = []
    for name, (code, wire) in _WIRE.items():
        if not h.HasField(name):
            raise WireFormatError(f"batch header lacks the {name} buffer")
        buf: pb.Buffer = getattr(h, name)
        dtype, offset, length = buf.dtype, buf.offset, buf.length
        count = tokens if name in _PER_TOKEN else rows
        if dtype != code:
            got = _DTYPE_NAMES.get(dtype, f"unknown dtype code {dtype}")
            raise WireFormatError(f"{name} has dtype {got}, expected {_DTYPE_NAMES[code]}")
        if length != count * wire.itemsize:
            raise WireFormatError(
                f"{name} buffer is {length} bytes, its shape needs {count} x {wire.itemsize}"
            )
        if offset + length > payload:
            raise WireFormatError(
                f"{name} buffer [{offset}, {offset + length}) lies outside the {payload}-byte payload"
            )
        if offset % wire.itemsize:
            raise WireFormatError(f"{name} buffer offset {offset} is not a multiple of {wire.itemsize}")
        spans.append((offset, offset + length, name))
        views.append(np.frombuffer(frame, dtype=wire, count=count, offset=start + offset))
    spans.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
        if begin < end:
            raise WireFormatError(f"buffers {first} and {second} overlap")
    return views


def _check_lengths(lengths: npt.NDArray[np.signedinteger], padded_len: int) -> int:
    """Check every row length lies in [1, padded_len]; return their sum."""
    # a few hundred rows at most: Python's min/max/sum beat three numpy reductions' call overhead
    values = lengths.tolist()
    low, high = min(values), max(values)
    if low < 1 or high > padded_len:
        raise WireFormatError(f"row lengths must lie in [1, padded_len={padded_len}], got [{low}, {high}]")
    return int(sum(values))

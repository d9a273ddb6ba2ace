"""Rows streamed into the Arrow shards of a ``save_to_disk`` folder, as they come.

Guarantee: the same rows, in the same order, write the same bytes, however
they arrive (record batches are cut from the row stream alone: at most
``BATCH_ROWS`` rows and about ``BLOCK_TOKENS`` tokens each; a shard ends
after the batch that takes it past ``shard_bytes``). Memory is one record
batch plus the rows not yet in one, whatever the dataset's size; the
folder appears at ``out`` only when ``close`` seals it (``_writer.staging``),
so a failure leaves nothing that looks like a dataset. The trade-off: the
shard count is known only at the end, so the shards are renamed then.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from .._writer import BLOCK_TOKENS, Staging

__all__ = ["BATCH_ROWS", "SHARD_BYTES", "ShardWriter"]

I32 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int8]

# Shards of about this many bytes (the "about 512 MB").
SHARD_BYTES = 512 * 10**6
# Rows per record batch, as save_to_disk writes them.
BATCH_ROWS = 1000


class ShardWriter:
    """Appends rows to the shards of a ``Staging`` folder; ``digest`` hashes every row as written."""

    def __init__(
        self, stage: Staging, *, shard_bytes: int = SHARD_BYTES, batch_tokens: int = BLOCK_TOKENS
    ) -> None:
        self.stage = stage
        self.shard_bytes = shard_bytes
        self.batch_tokens = batch_tokens
        self.shards: list[Path] = []
        self.rows = 0
        self.tokens = 0
        self.digest = hashlib.blake2b(digest_size=16)
        self._tokens: I32 = np.empty(0, np.int32)
        self._mask: I8 = np.empty(0, np.int8)
        self._lengths: I32 = np.empty(0, np.int32)
        self._sink: pa.NativeFile | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._shard_size = 0

    def add(self, tokens: I32, mask: I8, lengths: I32) -> None:
        """Append rows (``lengths`` all >= 1, summing to ``len(tokens) == len(mask)``)."""
        if len(lengths) == 0:
            return
        self.digest.update(lengths.astype("<i4").tobytes())
        self.digest.update(tokens.astype("<i4").tobytes())
        self.digest.update(mask.astype("i1").tobytes())
        self.rows += len(lengths)
        self.tokens += len(tokens)
        self._tokens = np.concatenate([self._tokens, tokens])
        self._mask = np.concatenate([self._mask, mask])
        self._lengths = np.concatenate([self._lengths, lengths])
        self._flush(final=False)

    def close(self) -> list[Path]:
        """Write the rows left and close the last shard; the shards written, in order."""
        self._flush(final=True)
        self._end_shard()
        return self.shards

    def abort(self) -> None:
        """Close the open shard without writing more (its folder is removed with the staging folder)."""
        self._end_shard()

    def _flush(self, *, final: bool) -> None:
        ends = np.cumsum(self._lengths, dtype=np.int64)
        count = len(ends)
        start = 0
        while start < count:
            base = int(ends[start - 1]) if start else 0
            fit = int(np.searchsorted(ends, base + self.batch_tokens, side="right"))
            stop = min(start + BATCH_ROWS, max(fit, start + 1))
            if stop == count and stop - start < BATCH_ROWS and not final:
                break  # the batch may take more rows: wait for them
            self._write(start, stop, ends)
            start = stop
        if start:
            cut = int(ends[start - 1])
            self._tokens = self._tokens[cut:]
            self._mask = self._mask[cut:]
            self._lengths = self._lengths[start:]

    def _write(self, start: int, stop: int, ends: npt.NDArray[np.int64]) -> None:
        base = int(ends[start - 1]) if start else 0
        top = int(ends[stop - 1])
        offsets = np.zeros(stop - start + 1, dtype=np.int32)
        np.cumsum(self._lengths[start:stop], out=offsets[1:])
        list_offsets = pa.array(offsets)
        schema = self.stage.schema
        batch = pa.RecordBatch.from_arrays(
            [
                pa.ListArray.from_arrays(list_offsets, pa.array(self._tokens[base:top])),
                pa.ListArray.from_arrays(list_offsets, pa.array(self._mask[base:top])),
                pa.array(self._lengths[start:stop]),
            ],
            schema=schema,
        )
        if self._writer is None:
            path = self.stage.folder / f"shard-{len(self.shards):05d}.arrow"
            self._sink = pa.OSFile(str(path), "wb")
            self._writer = pa.ipc.new_stream(self._sink, schema)
            self.shards.append(path)
            self._shard_size = 0
        self._writer.write_batch(batch)
        self._shard_size += batch.nbytes
        if self._shard_size >= self.shard_bytes:
            self._end_shard()

    def _end_shard(self) -> None:
        writer, sink = self._writer, self._sink
        self._writer = self._sink = None
        try:
            if writer is not None:
                writer.close()
        finally:
            if sink is not None:
                sink.close()

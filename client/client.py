"""``BatchClient``: a trainer's view of ladle, one rank's batches, one epoch per iteration.

The client opens one gRPC stream to the batch server, keeps ``prefetch``
batches in flight (credits), and hands out batches whose arrays are read-only
views of the received frames (no copy). A batch counts as consumed when the
trainer asks for the next one, calls ``state_dict()`` or closes the client;
the client then acknowledges it, and the server moves the rank's stored
cursor. If the server goes away (UNAVAILABLE) or is at its limit on calls in
progress (RESOURCE_EXHAUSTED, reason ``too_many_calls``), the client reconnects
with exponential backoff and continues at its next step: no gap, no duplicate.

This module holds the public class, epoch iteration, interruption safety and
the client's lifetime; its settings are ``config.ClientConfig``, its position
``position.RankPosition``, its channel and failover ``connection.Connection``
and its stream ``reader``. Imports only grpcio, numpy and ``ladle.proto``
(torch when ``device`` is given).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, cast

from ladle.proto import codec
from ladle.proto import ladle_pb2 as pb

from . import _device
from .batch import Batch
from .config import ClientConfig, channel_credentials, grpc_target, integer
from .connection import Connection
from .errors import BatchClientError, FencedError
from .position import STATE_VERSION, RankPosition
from .reader import ACK_DELAY, Stream

__all__ = ["ACK_DELAY", "STATE_VERSION", "BatchClient", "channel_credentials", "grpc_target"]

log = logging.getLogger("ladle.client")


class BatchClient:
    """Batches of one rank of one job, from a ladle batch server.

    ``BatchClient(rank, world_size, server, job)`` takes its defaults from
    ``RANK``, ``WORLD_SIZE``, ``LADLE_SERVER`` and ``LADLE_JOB`` (then 0, 1,
    ``127.0.0.1:50051`` and ``"default"``). Iterating yields one epoch of
    ``Batch`` objects; iterating again continues with the next epoch (after
    a ``break``, with the rest of the same one: nothing is skipped).
    ``device=None`` gives numpy arrays (read-only, zero-copy); a torch device
    gives tensors on it. For CUDA the reader thread copies each batch through
    pinned memory on a CUDA stream of its own, and ``next()`` makes the
    trainer's current stream wait for those copies (no host wait), so any
    stream may use the batch; ``"cuda"`` without an index is the device
    current when the client is made (``torch.cuda.set_device(local_rank)``
    first). ``timeout`` bounds how long the client waits for a server (to
    connect, or for the next batch) before it raises ``ServerUnavailableError``.

    Without ``load_state_dict``, a rank of a job that has already run
    starts at the job's cursor: the earliest position any of its ranks has
    reached. The ranks of a DDP job restarted without a checkpoint are then
    at the same step and get equal steps to the epoch's end (each at its own
    cursor, a step or two apart, the ranks with more would hang in their
    last collective); a rank that was ahead gets again the batches it
    consumed beyond it. ``own_cursor=True`` starts at this rank's own
    cursor instead, for ranks that do not train in step.

    ``token`` (default ``LADLE_TOKEN``, else the first line of the file
    ``LADLE_TOKEN_FILE`` names) is sent with every call to a server
    that wants one; a refused token raises ``AuthenticationError`` at once.
    TLS is on when ``root_certificates`` (PEM bytes, or a file; default
    ``LADLE_TLS_CA``) or a client certificate is given, or ``tls=True``
    (the system's roots); ``client_certificate`` and ``client_key`` (PEM
    bytes or files; default ``LADLE_TLS_CERT``, ``LADLE_TLS_KEY``) answer a
    server that asks for mutual TLS.

    ``dataset=PATH`` (default ``LADLE_DATASET`` when no server is named)
    serves the dataset in this process instead (``pip install
    'ladle[server]'``): the same batches, byte for byte, as ``ladle serve
    PATH`` with the schedule ``config`` (a ``ScheduleConfig``; its defaults
    when None) would send; ``state=FILE`` keeps the rank's position in an
    embedded store file, so a crash resumes without a checkpoint (else a
    temporary one, gone at ``close()``). ``dataset`` with ``server`` is a
    ``ValueError``.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        server: str | None = None,
        job: str | None = None,
        *,
        prefetch: int = 4,
        device: Any = None,
        timeout: float = 60.0,
        pin_memory: bool | None = None,
        client_id: str | None = None,
        elastic: bool = False,
        own_cursor: bool = False,
        token: str | None = None,
        tls: bool | None = None,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        client_certificate: bytes | str | os.PathLike[str] | None = None,
        client_key: bytes | str | os.PathLike[str] | None = None,
        dataset: str | os.PathLike[str] | None = None,
        config: Any = None,
        state: str | os.PathLike[str] | None = None,
    ) -> None:
        self._local = None
        local = _local_dataset(dataset, server)
        if local is None and (config is not None or state is not None):
            raise ValueError("config= and state= go with dataset= (the served config is the server's)")
        if local is not None:
            from ._local import LocalServer

            self._local = LocalServer(local, config, state)
            server = self._local.address
        try:
            self._setup(
                rank,
                world_size,
                server,
                job,
                prefetch,
                device,
                timeout,
                pin_memory,
                client_id,
                elastic,
                own_cursor,
                token,
                tls,
                root_certificates,
                client_certificate,
                client_key,
            )
        except BaseException:
            if self._local is not None:
                self._local.stop()
            raise

    def _setup(
        self,
        rank: int | None,
        world_size: int | None,
        server: str | None,
        job: str | None,
        prefetch: int,
        device: Any,
        timeout: float,
        pin_memory: bool | None,
        client_id: str | None,
        elastic: bool,
        own_cursor: bool,
        token: str | None,
        tls: bool | None,
        root_certificates: bytes | str | os.PathLike[str] | None,
        client_certificate: bytes | str | os.PathLike[str] | None,
        client_key: bytes | str | os.PathLike[str] | None,
    ) -> None:
        config = ClientConfig.from_arguments(
            rank,
            world_size,
            server,
            job,
            prefetch=prefetch,
            device=device,
            timeout=timeout,
            pin_memory=pin_memory,
            client_id=client_id,
            elastic=elastic,
            own_cursor=own_cursor,
            token=token,
            tls=tls,
            root_certificates=root_certificates,
            client_certificate=client_certificate,
            client_key=client_key,
        )
        self.rank, self.world_size, self.job = config.rank, config.world_size, config.job
        self.server, self.servers = config.server, list(config.servers)
        self.prefetch, self.timeout, self.client_id = config.prefetch, config.timeout, config.client_id
        self.elastic, self.own_cursor = config.elastic, config.own_cursor
        convert = _device.converter(config.device, config.pin_memory)
        self._connection = Connection(config, convert)
        self._position = RankPosition(config.job, config.rank, config.world_size, elastic=config.elastic)
        self._cut_short = False  # a take was interrupted where a frame may be lost (see _receive)
        # one thread iterates at a time (two would race each other into streams that fence one
        # another): _iterating refuses a second; _busy makes state_dict() from another thread wait
        self._iterating = threading.Lock()
        self._busy = threading.Lock()
        # gRPC's channels do not survive a fork: a child must make its own client
        self._pid = os.getpid()
        _LIVE.add(self)

    @property
    def reconnects(self) -> int:
        """Streams and replicas this client had to connect again to (after a failure or a silence)."""
        return self._connection.reconnects

    @reconnects.setter
    def reconnects(self, value: int) -> None:
        self._connection.reconnects = value

    @property
    def _closed(self) -> bool:
        return self._connection.closed

    @property
    def _stream(self) -> Stream | None:
        """The open stream, if any (tests and benchmarks look at its queue)."""
        return self._connection.stream

    # --- state ---

    def state_dict(self) -> dict[str, Any]:
        """The rank's position (a few integers) and the schedule fingerprint; consumes the held batch.

        Before the first batch (and with no ``load_state_dict``), the position
        is where the server will start this rank: the stored cursor of a job
        that has already run. The client opens its stream to learn it, so a
        checkpoint taken before any batch never rewinds the rank. After
        ``close()`` (or a ``with`` block) it is where the client ended: after
        the batches it consumed, at the held one if the block ended in an
        exception.

        Raises ``FencedError`` once the client knows that a newer process took
        its rank (the server ended its stream so, whether or not ``next()`` has
        raised it yet): a replaced process must not checkpoint a position, which
        could overwrite the newer process's checkpoint.
        """
        with self._busy:
            self._raise_if_fenced()
            if self._ended_at_known_position():
                return self._position.state_dict()
            if self._closed and self._pid == os.getpid() and self._connection.fence is None:
                raise BatchClientError(
                    "the client was closed before it learned its position (it read no batch and loaded "
                    "no state), so there is none to save: a new client for this rank goes on from the "
                    "job's stored cursor"
                )
            self._check_usable()
            self._consume_held()
            if not self._position.known:
                self._receive(until_start=True)
            self._connection.flush()
            self._raise_if_fenced()  # the fence may have come while it waited
            return self._position.state_dict()

    def _ended_at_known_position(self) -> bool:
        """Closed in this process, not fenced, with its position known: ``state_dict()`` needs no server.

        The position is known once a stream started or a state was loaded
        (whose fingerprint may be None, as it was saved).
        """
        return (
            self._closed
            and self._pid == os.getpid()
            and self._connection.fence is None
            and self._position.known
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume exactly where ``state`` (from ``state_dict()``) left off; the dict is not changed."""
        with self._busy:
            self._check_usable()
            self._position.load_state_dict(state)  # checks it all before it changes anything
            self._connection.drop_stream()

    @property
    def position(self) -> tuple[int, int] | None:
        """(epoch, step) of the next batch this client will receive (None before the first).

        After an elastic ``load_state_dict`` (another world size) it is the
        loaded position of the old world until the first batch or
        ``state_dict()`` learns the re-planned one from the server.
        """
        return self._position.next

    # --- the epoch's length ---

    def __len__(self) -> int:
        """This rank's batches in the epoch ``for batch in client`` continues or starts, from its start.

        Every rank gets the same number. The server answers it (its
        ``Describe`` call reads only: any process may ask, without joining the
        job or fencing the rank's trainer). After ``load_state_dict`` in the
        middle of an epoch it is still the whole epoch's count, as a resumed
        ``DataLoader``'s ``len`` is, and after a state taken on an epoch's
        last batch it is that epoch's (the next iteration is its empty rest).
        Each epoch is packed anew, so epochs can differ by a few batches: for
        a learning-rate schedule over several epochs, add
        ``steps_in_epoch(e)`` for each. Raises as iterating would:
        ``ServerUnavailableError`` after ``timeout``, ``BatchClientError`` for a
        job of another world size (unless ``elastic``: the job is then resized
        first, as the first batch would).
        """
        return self.steps_in_epoch()

    def __bool__(self) -> bool:
        """Always true: ``if client:`` must not ask the server for ``len(client)``."""
        return True

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """This rank's batches in ``epoch`` (default: the epoch ``len(client)`` counts)."""
        if epoch is not None:
            epoch = integer(epoch, "epoch", 0)
        with self._busy:
            self._check_usable()
            if epoch is None and self._position.loaded_epoch is not None:
                # the next iteration continues the loaded epoch: its empty rest, if the state
                # was taken on its last batch (the server already starts the rank after it)
                epoch = self._position.loaded_epoch
            info = self._describe(epoch)
            if info.world_size != self.world_size:
                if not self.elastic or self._stream is not None:
                    raise BatchClientError(
                        f"job {self.job!r} has {info.world_size} ranks and this client {self.world_size} "
                        "(pass elastic=True to resize it to this client's world size)",
                        "FAILED_PRECONDITION",
                    )
                self._receive(until_start=True)  # the stream's Open resizes the job: then it is known
                info = self._describe(epoch)
            if epoch is None and self._position.at_end_of(info.steps_per_epoch):
                info = self._describe(info.epoch + 1)  # the next iteration starts the next epoch
            return int(info.steps_per_epoch)

    def _describe(self, epoch: int | None) -> pb.JobInfo:
        """The server's ``JobInfo`` of this job for ``epoch`` (None: this client's, else the job's)."""
        if epoch is None and self._position.next is not None:
            epoch = self._position.next[0]
        # not read a batch yet: where this rank's stream would start (its own cursor, or the job's)
        return self._connection.describe(epoch, self.rank if epoch is None else None)

    # --- iteration ---

    def __iter__(self) -> Iterator[Batch]:
        return self._epoch()

    def _epoch(self) -> Iterator[Batch]:
        first = True
        ends = -1  # epochs this client had ended when this iteration took its first batch
        while True:
            if not first and self._position.epochs_ended != ends:
                return  # another iteration of this client ended this one's epoch: so does this one
            takes = self._position.takes
            try:
                batch = self._take(first)
            except BaseException:
                if self._position.takes != takes:
                    self._undeliver()  # taken, then interrupted (Ctrl-C) before it reached the trainer
                raise
            if batch is None:
                return
            if first:
                ends = self._position.epochs_ended
            first = False
            yield batch

    def _take(self, first: bool) -> Batch | None:
        """Consume the held batch and take the next one; None at the end of the epoch."""
        if not self._iterating.acquire(blocking=False):
            raise BatchClientError(
                "two threads asked one BatchClient for a batch at once: it is one rank's stream, "
                "so iterate it from one thread (a checkpoint thread may call state_dict())"
            )
        try:
            with self._busy:
                self._check_usable()
                if self._cut_short:
                    # the last take was interrupted (Ctrl-C, or an exception a signal handler
                    # raised) between a frame leaving the stream's queue and the position moving
                    # past it: the frame may be lost, so the stream starts again at the position
                    self._connection.drop_stream()
                self._consume_held()
                loaded = self._position.pop_loaded_epoch()
                if first and loaded is not None and self._rest_is_empty(loaded):
                    return None
                batch = self._take_next(first)
                self._cut_short = False  # the frame taken (if any) is accounted for
                return batch
        finally:
            self._iterating.release()

    def _undeliver(self) -> None:
        """The batch just taken never reached the trainer: it is the next one again, not a held one.

        Python raises a Ctrl-C at the first check after ``_take`` returns, so
        the position can have moved past a batch the loop never got; without
        this, the next take would consume it (acknowledged, never trained on).
        """
        with self._busy:
            if self._position.give_back():
                self._cut_short = True  # the stream has sent past it: start again at the position

    def _take_next(self, first: bool) -> Batch | None:
        """Receive the next batch and move the position past it; None at the end of the epoch."""
        item = self._receive()
        if isinstance(item, codec.DecodedEpochEnd):
            if not self._position.ended(item.epoch, item.steps, first=first):
                return None
            item = self._receive()  # a take that starts at the last epoch's end goes on into the next
            if isinstance(item, codec.DecodedEpochEnd):  # an empty epoch (a resize can leave one)
                self._position.ended(item.epoch, item.steps)
                return None
        batch = cast(Batch, item)
        self._position.took(batch.epoch, batch.step)
        return batch

    def _rest_is_empty(self, loaded: int) -> bool:
        """A state of epoch ``loaded`` was taken on its last batch: this iteration is its empty rest.

        The server starts such a state at the next epoch. A loop that resumes
        ``for epoch in range(saved_epoch, N): for batch in client:`` then
        finishes the saved epoch first (nothing is left of it) and trains N
        epochs in all, as it does from any other checkpoint.
        """
        if self._stream is None:
            self._receive(until_start=True)  # where the server starts this rank
        return self._position.past(loaded)

    def _consume_held(self) -> None:
        """The held batch is consumed: acknowledge it and give its credit back."""
        through = self._position.consume()
        if through is not None:
            self._connection.ack(through)

    def _check_usable(self) -> None:
        """Raise if this client cannot serve the caller: made in another process, fenced, or closed."""
        if self._pid != os.getpid():
            raise BatchClientError(
                f"this BatchClient was made in process {self._pid}, not this one ({os.getpid()}): gRPC "
                "does not survive a fork; make the client in the process that uses it, and start that "
                "process with 'spawn' (multiprocessing, torch.multiprocessing) or before the parent uses gRPC"
            )
        self._raise_if_fenced()
        if self._closed:
            raise BatchClientError("the client is closed")

    def _raise_if_fenced(self) -> None:
        """Raise ``FencedError`` once this client (in its own process) knows a newer process took its rank."""
        if self._pid == os.getpid():
            fence = self._connection.note_fence(self._stream)
            if fence is not None:
                raise FencedError(str(fence), fence.code)

    def _receive(self, *, until_start: bool = False) -> Any:
        """The next batch or epoch end; with ``until_start``, return None once the stream has started.

        From here until the caller has moved the position past what this
        returns, an exception raised into the trainer's thread (Ctrl-C) can
        lose a frame taken from the queue: ``_cut_short`` says so, and the
        next take starts the stream again at the position.
        """
        self._cut_short = True

        def started(start: codec.DecodedStreamStart) -> bool:
            for message, args in self._position.started(
                start.epoch,
                start.step,
                start.schedule_fingerprint,
                start.generation,
                start.incarnation,
                start.world_size,
            ):
                log.warning(message, *args)
            if until_start:
                self._cut_short = False
            return until_start

        item = self._connection.receive(self._open_request, started)
        if isinstance(item, tuple):
            decoded, batch = item
            self._check_batch(decoded)
            if batch._ready is not None:  # its device copies: the trainer's stream waits for them
                batch._ready()
                batch.__dict__["_ready"] = None
            return batch
        return item

    def _check_batch(self, batch: codec.DecodedBatch) -> None:
        """A received batch is the next one of this rank's schedule (on the trainer's thread)."""
        self._position.check_batch(batch.rank, batch.epoch, batch.step, batch.schedule_fingerprint)

    def _open_request(self) -> pb.Open:
        """The Open of a new stream: this client's rank and settings, and what its position claims."""
        request = pb.Open(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            prefetch=self.prefetch,
            client_id=self.client_id,
        )
        claim = self._position.claim()
        if claim.start is not None:
            request.start.CopyFrom(pb.Position(epoch=claim.start[0], step=claim.start[1]))
        if claim.fingerprint is not None:
            request.schedule_fingerprint = claim.fingerprint
        if self.elastic:
            request.elastic = True
        if self.own_cursor:
            request.own_cursor = True
        if claim.generation is not None:
            request.resume.CopyFrom(pb.Resume(generation=claim.generation, incarnation=claim.incarnation))
        return request

    # --- lifetime ---

    def close(self) -> None:
        """Acknowledge the held batch and close the stream; idempotent.

        In a forked child it only marks this client closed: the parent's
        gRPC channel is not the child's to touch. Once the client knows that a
        newer process took its rank (before or while it closes: the stream's
        graceful end reads the server's status), it acknowledges nothing, closes,
        and raises ``FencedError``, each time it is called: the process was
        replaced and must not report a clean end.
        """
        if self._closed:
            self._raise_if_fenced()
            return
        if self._pid != os.getpid():
            self._connection.closed = True
            return
        try:
            if self._connection.note_fence(self._stream) is None:
                self._consume_held()
                self._connection.flush()
            self._connection.close()
        finally:
            if self._local is not None:  # the in-process server goes with its only client
                self._local.stop()
        self._raise_if_fenced()

    def __enter__(self) -> BatchClient:
        return self

    def __reduce__(self) -> Any:
        """Refused: a client is one process's live stream (a ``spawn`` worker makes its own)."""
        raise BatchClientError(
            "a BatchClient cannot be pickled: it holds one process's live gRPC stream of its rank; "
            "make the client in the process that trains (from its arguments), and keep "
            "DataLoader(num_workers=0) for BatchDataset"
        )

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            # the trainer failed on the held batch: not consumed, the next process (or a
            # state_dict() taken now) gets it again
            self._position.give_back()
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(FencedError):  # the exception on its way out goes on (a fence's too)
            self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        """Dropped without ``close()``: acknowledge what was consumed (not the held batch), then end.

        The graceful end waits for the server, so it runs on a thread of its
        own (it holds the stream, not this client) instead of in the garbage
        collector's caller.
        """
        try:
            connection = self._connection
            stream = connection.stream
            if connection.closed or stream is None or self._pid != os.getpid():
                return
            connection.closed = True
            stream.flush()
            # the thread holds the channel too: freed with this client, grpcio's channel would
            # cancel the call at once, before the acknowledgement just flushed has gone
            threading.Thread(
                target=_end_dropped,
                args=(stream, connection.channel, self._local),
                name="ladle-client-end",
                daemon=True,
            ).start()
        except Exception:
            pass


def _end_dropped(stream: Stream, channel: Any, local: Any = None) -> None:
    """End a dropped client's stream gracefully, then its channel and in-process server (on a thread)."""
    try:
        stream.close(join=1.0)
    finally:
        if channel is not None:
            channel.close()
        if local is not None:
            local.stop()


# Clients not closed when the interpreter exits are closed then, all at once, so what their trainers
# consumed is acknowledged. The batch each holds is not: an exit without close() may come from a
# failure on that batch (an uncaught exception, or sys.exit after a caught one), and the next
# process must get it again.
_LIVE: weakref.WeakSet[BatchClient] = weakref.WeakSet()


def _local_dataset(dataset: str | os.PathLike[str] | None, server: str | None) -> str | None:
    """The dataset to serve in this process: ``dataset``, else ``LADLE_DATASET`` when no server is named."""
    if dataset is not None and server is not None:
        raise ValueError("give server= or dataset= (served in this process), not both")
    if dataset is not None:
        return os.fspath(dataset)
    if server is None and not os.environ.get("LADLE_SERVER", "").strip():
        return os.environ.get("LADLE_DATASET", "").strip() or None
    return None


def _end(client: BatchClient) -> None:
    try:
        client._position.forget_held()
        client.close()
    except Exception:  # pragma: no cover - best effort at exit
        pass


@atexit.register
def _close_at_exit() -> None:
    ending = [
        threading.Thread(target=_end, args=(c,), daemon=True)
        for c in list(_LIVE)
        if not c._closed and c._pid == os.getpid()
    ]
    for thread in ending:
        thread.start()
    until = time.monotonic() + 2.0  # a server that hangs costs the exit at most this
    for thread in ending:
        thread.join(timeout=max(0.0, until - time.monotonic()))

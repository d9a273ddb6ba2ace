"""``RankPosition``: where one rank of one job is in its schedule, as a pure state machine (no I/O).

A checkpoint is the next batch's (epoch, step) and the schedule's
fingerprint; everything else is derived or comes back from the server. Each
event a rank's stream can bring is one method, and ``state_dict`` /
``load_state_dict`` round-trip exactly; the trade-off is that the caller
(``BatchClient``, or an in-process reader) does the I/O and the logging.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ladle.proto import codec

from .config import MAX_INDEX, is_fingerprint, is_int
from .errors import BatchClientError, StateDictError

__all__ = ["STATE_KEYS", "STATE_VERSION", "Claim", "RankPosition"]

STATE_VERSION = 1
STATE_KEYS = ("version", "job", "rank", "world_size", "epoch", "step", "schedule_fingerprint")

Step = tuple[int, int]  # (epoch, step)


@dataclass(frozen=True)
class Claim:
    """What the next Open claims: where to start (None: the stored cursor), the schedule, the last stream."""

    start: Step | None
    fingerprint: str | None
    generation: int | None
    incarnation: str


class RankPosition:
    """One rank's position: the next batch, the batch handed out but not yet consumed, and the schedule.

    The implementer's contract, for any reader of a rank's stream:

    - ``started`` at each stream's first frame, ``check_batch`` then
      ``took`` for each batch, ``ended`` for each epoch end; the next batch's
      position only moves forward within a stream.
    - ``consume`` when the trainer is done with the held batch (its return is
      what to acknowledge); ``give_back`` when it never reached the trainer.
    - ``state_dict`` is valid once ``known``; ``load_state_dict`` checks the
      whole state before it changes anything and never changes the caller's dict.

    ``epochs_ended`` and ``takes`` count epoch ends and batches taken, so an
    iteration can tell whether another one ended its epoch, or took a batch.
    """

    def __init__(self, job: str, rank: int, world_size: int, *, elastic: bool = False) -> None:
        self.job, self.rank, self.world_size, self.elastic = job, rank, world_size, elastic
        self.next: Step | None = None  # the next batch to receive (None: the server's stored cursor)
        self.held: Step | None = None  # handed out, not yet consumed
        self.fingerprint: str | None = None
        # what the last stream's start said; claimed back on a reconnect
        self.generation: int | None = None
        self.incarnation = ""
        self.replanned = False  # a state of another world size awaits the server's re-planned position
        self.loaded_epoch: int | None = None  # the epoch of a state just loaded (until the next batch)
        self.epochs_ended = 0
        self.takes = 0

    # --- checkpoints ---

    @property
    def known(self) -> bool:
        """The position a ``state_dict`` would hold is known without asking the server."""
        return self.next is not None and not self.replanned

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: a few integers and the schedule's fingerprint (StateDictError unless ``known``)."""
        if self.next is None or self.replanned:
            raise StateDictError(
                "the position is not known yet: the server has not said where the rank starts"
            )
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": int(self.next[0]),
            "step": int(self.next[1]),
            "schedule_fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go to ``state``'s position; StateDictError (nothing changed) if it is not this rank's checkpoint.

        With ``elastic``, a checkpoint of another world size (any of its
        ranks) is taken: the server re-plans, so the position stays
        ``replanned`` until the next ``started``.
        """
        if not isinstance(state, Mapping):
            raise StateDictError(f"state must be a mapping, got {type(state).__name__}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise StateDictError(f"state lacks {missing}; it was not made by BatchClient.state_dict()")
        version = state["version"]
        if not is_int(version) or version != STATE_VERSION:
            raise StateDictError(f"state version {version!r}; this client reads {STATE_VERSION}")
        for key in ("rank", "world_size", "epoch", "step"):
            value = state[key]
            if not is_int(value) or not 0 <= value <= MAX_INDEX:
                raise StateDictError(
                    f"state[{key!r}] must be a non-negative integer <= {MAX_INDEX}, got {value!r}"
                )
        if not isinstance(state["job"], str):
            raise StateDictError(f"state['job'] must be a string, got {state['job']!r}")
        resized = self.elastic and state["world_size"] != self.world_size
        for key, mine in (("job", self.job), ("rank", self.rank), ("world_size", self.world_size)):
            if key != "job" and resized:
                continue  # an elastic restart: any rank's checkpoint of the old world will do
            if state[key] != mine:
                hint = " (pass elastic=True to resume with another world size)" if key == "world_size" else ""
                raise StateDictError(
                    f"state is for {key}={state[key]!r}, this client has {key}={mine!r}{hint}"
                )
        fingerprint = state["schedule_fingerprint"]
        if fingerprint is not None and not is_fingerprint(fingerprint):
            raise StateDictError(
                f"state['schedule_fingerprint'] must be a string of at most {codec.MAX_FINGERPRINT_BYTES} "
                f"UTF-8 bytes, got {fingerprint!r:.100}"
            )
        self.next = (int(state["epoch"]), int(state["step"]))
        self.held = None
        self.fingerprint = fingerprint
        self.generation = None  # a restart from a checkpoint, not a reconnect
        self.replanned = resized
        self.loaded_epoch = None if resized else int(state["epoch"])

    def claim(self) -> Claim:
        """What the next stream's Open asks for."""
        return Claim(self.next, self.fingerprint, self.generation, self.incarnation)

    # --- a stream's events ---

    def started(
        self, epoch: int, step: int, fingerprint: str, generation: int, incarnation: str, world_size: int
    ) -> list[tuple[str, tuple[Any, ...]]]:
        """A stream's first frame: adopt its schedule, generation and position; the warnings to log.

        Each warning is a format string and its arguments (the caller logs them).
        """
        notes: list[tuple[str, tuple[Any, ...]]] = []
        if self.fingerprint is not None and fingerprint != self.fingerprint:
            notes.append(
                (
                    "rank %d: job %r was resized to %d ranks; continuing at epoch %d step %d of the "
                    "re-planned schedule %s",
                    (self.rank, self.job, world_size, epoch, step, fingerprint),
                )
            )
        if self.next is None and (epoch, step) != (0, 0):  # not a reconnect, not a load
            # a new run under an old name, or a restart whose model did not restart with it
            notes.append(
                (
                    "rank %d: job %r continues at epoch %d step %d, where the store left it (a restart "
                    "without load_state_dict; use another job name for a new run)",
                    (self.rank, self.job, epoch, step),
                )
            )
        self.generation, self.incarnation = generation, incarnation
        self.fingerprint = fingerprint
        self.next = (epoch, step)
        self.replanned = False
        return notes

    def check_batch(self, rank: int, epoch: int, step: int, fingerprint: str) -> None:
        """A received batch is the one expected next, of this schedule; the first one names the schedule."""
        if rank != self.rank:
            raise BatchClientError(f"server sent a batch for rank {rank} to rank {self.rank}")
        # the server normalises a step past an epoch's end to the next epoch's step 0
        expected = self.next
        if (
            expected is not None
            and (epoch, step) != expected
            and not (step == 0 and epoch == expected[0] + 1)
        ):
            raise BatchClientError(f"server sent epoch {epoch} step {step}, expected {expected}")
        if self.fingerprint is None:
            self.fingerprint = fingerprint
        elif fingerprint != self.fingerprint:
            raise StateDictError(f"server follows schedule {fingerprint}, this client {self.fingerprint}")

    def took(self, epoch: int, step: int) -> None:
        """A batch was handed out: it is held, and the next one follows it."""
        self.held = (epoch, step)
        self.next = (epoch, step + 1)
        self.takes += 1

    def ended(self, epoch: int, steps: int, *, first: bool = False) -> bool:
        """Epoch ``epoch`` (of ``steps`` batches) ended; True if a ``first`` take should go on into the next.

        That is the case when the last iteration stopped right after the
        epoch's last batch and this one starts at its end: it has no epoch of
        its own.
        """
        self.epochs_ended += 1
        after_last = first and self.next == (epoch, steps)
        self.next = (int(epoch) + 1, 0)
        return after_last

    def consume(self) -> Step | None:
        """The held batch is consumed: the position to acknowledge through (None if none was held)."""
        if self.held is None:
            return None
        held, self.held = self.held, None
        return (held[0], held[1] + 1)

    def give_back(self) -> bool:
        """The held batch was not used: it is the next one again. True if one was held."""
        if self.held is None:
            return False
        self.next, self.held = self.held, None
        return True

    def forget_held(self) -> None:
        """Neither consume nor give back the held batch (an exit without ``close``: not acknowledged)."""
        self.held = None

    def pop_loaded_epoch(self) -> int | None:
        """The epoch of a state just loaded, once: the first take after a load asks."""
        loaded, self.loaded_epoch = self.loaded_epoch, None
        return loaded

    def past(self, epoch: int) -> bool:
        """The next batch is in a later epoch than ``epoch`` (a state taken on its last batch)."""
        return self.next is not None and self.next[0] > epoch

    def at_end_of(self, steps_per_epoch: int) -> bool:
        """Stopped at the end of an epoch of ``steps_per_epoch``: the next iteration starts the next one."""
        return self.next is not None and self.next[1] >= steps_per_epoch > 0

"""One error hierarchy for all of ladle.

Every error a user can cause is a ``LadleError`` with a ``kind`` that the
network faces map once to a gRPC status code and an HTTP status, so a bad
request is always a typed, explained refusal and never a crash.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

__all__ = [
    "AlgorithmVersionError",
    "BinaryFileError",
    "ChatTemplateError",
    "CheckpointMismatchError",
    "CheckpointPositionError",
    "ConfigError",
    "CorruptFileError",
    "CursorRegressionError",
    "DatasetChangedError",
    "DatasetError",
    "DatasetNotFoundError",
    "EmptyDatasetError",
    "EmptySourceError",
    "EmptyTextError",
    "FencedError",
    "JobMismatchError",
    "JobNotFoundError",
    "LadleError",
    "LengthMismatchError",
    "MissingColumnsError",
    "OverlongSampleError",
    "ScheduleBusyError",
    "ScheduleError",
    "ScheduleLimitError",
    "SourceColumnError",
    "StoreCorruptError",
    "StoreCredentialsError",
    "StoreError",
    "StoreFormatError",
    "StoreUnavailableError",
    "TextSourceError",
    "TokenizerError",
    "TooManySkippedError",
    "UnreadableFileError",
    "WorldSizeMismatchError",
    "ZeroLengthRowsError",
    "reason_of",
]


def reason_of(exc: BaseException) -> str:
    """``exc``'s name for programs: its ``reason``, else its class name in snake case ("dataset_changed")."""
    given = getattr(exc, "reason", "")
    if given:
        return str(given)
    name = type(exc).__name__
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name.removesuffix("Error") or name).lower()


class LadleError(Exception):
    """Base of every error ladle raises on purpose.

    ``kind`` names the class of failure in gRPC's vocabulary
    (``invalid_argument``, ``not_found``, ``failed_precondition``...), so the
    gRPC servicer and the HTTP app map it in one place. ``reason`` is its
    name for programs (``ladle.v1.Error.reason``, see ``reason_of``).
    """

    kind: ClassVar[str] = "internal"
    reason: str = ""


class ConfigError(LadleError, ValueError):
    """A schedule or server option is invalid; ``field`` names it (reason ``bad_<field>``)."""

    kind = "invalid_argument"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = f"bad_{field}"
        super().__init__(f"{field}: {message}")


class ScheduleError(LadleError, ValueError):
    """The inputs cannot make a valid schedule (e.g. fewer rows than ranks)."""

    kind = "invalid_argument"


class ScheduleBusyError(LadleError):
    """The server is building as many schedules for inspection as it allows at once; ask again.

    ``retry_after`` is a number of seconds worth waiting (HTTP ``Retry-After``).
    """

    kind = "unavailable"

    def __init__(self, message: str, retry_after: int = 2) -> None:
        self.retry_after = retry_after
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ScheduleBusyError], tuple[str, int]]:
        return (type(self), (str(self), self.retry_after))


class ScheduleLimitError(LadleError):
    """Building another schedule would pass a limit on those no stream uses (``ladle serve --max-schedules``).

    The schedules a server built for Opens (and Describes) in the last minute
    that no stream is using count, with the builds in progress, against a
    limit per server and one per client; beyond either the request is
    refused (RESOURCE_EXHAUSTED, HTTP 429). ``reason`` says which
    (``too_many_schedules`` or ``too_many_schedules_per_client``), ``limit``
    names it as the metrics do, ``retry_after`` is the seconds until one of
    them may be dropped.
    """

    kind = "resource_exhausted"

    def __init__(self, message: str, reason: str = "too_many_schedules", retry_after: int = 60) -> None:
        self.reason = reason
        self.limit = "max_schedules_per_client" if reason.endswith("per_client") else "max_schedules"
        self.retry_after = retry_after
        super().__init__(message)

    def __reduce__(self) -> tuple[type[ScheduleLimitError], tuple[str, str, int]]:
        return (type(self), (str(self), self.reason, self.retry_after))


class OverlongSampleError(ScheduleError):
    """A sample is longer than ``max_seq_len`` and ``overlong="error"``."""

    def __init__(self, count: int, first_rows: list[int], max_seq_len: int) -> None:
        self.count = count
        self.first_rows = first_rows
        super().__init__(
            f"{count} sample(s) longer than max_seq_len={max_seq_len} "
            f"(first rows: {first_rows}); to accept them, set overlong='truncate' or 'drop' "
            "(--overlong truncate or --overlong drop on the command line)"
        )


class DatasetError(LadleError):
    """The dataset on disk cannot be served as it is."""

    kind = "failed_precondition"


class DatasetNotFoundError(DatasetError):
    kind = "not_found"


class DatasetChangedError(DatasetError):
    """A memory-mapped file of a served dataset changed on disk; ``file`` names it, ``detail`` says how.

    The server checks before it reads a batch (a read past the end of a
    truncated mapping would kill the process with SIGBUS), refuses the batch
    with this error and stays up.
    """

    def __init__(self, path: str, file: str, detail: str) -> None:
        self.path = path
        self.file = file
        self.detail = detail
        super().__init__(
            f"dataset file {file} changed on disk while it was served: {detail}. The server sends no "
            f"more batches of {path}. Write a changed dataset to a new folder, then restart the "
            "server on that folder under a new job name (the fingerprint does not see every edit, "
            "so a job resumed on rewritten data could mix old rows and new)"
        )

    def __reduce__(self) -> tuple[type[DatasetChangedError], tuple[str, str, str]]:
        return (type(self), (self.path, self.file, self.detail))


class MissingColumnsError(DatasetError):
    def __init__(
        self,
        path: str,
        missing: list[str],
        present: list[str],
        token_lists: list[str],
        role: str = "input_ids",
    ) -> None:
        """``missing``: the column looked for in the ``role`` (``input_ids``, ``loss_mask`` or ``labels``);
        ``token_lists``: the present columns that hold lists of integers (what could be named instead)."""
        self.missing = missing
        self.role = role
        hints = []
        known = ("input_ids", "loss_mask", "labels", "attention_mask")
        others = [name for name in token_lists if name not in known and name not in missing]
        if role == "input_ids" and others:
            hints.append(f"if {others[0]!r} holds the token ids: --column input_ids={others[0]}")
        elif role == "input_ids" and not token_lists:  # text, not tokens
            hints.append(
                "it holds no token lists: tokenize it first with `ladle make-dataset OUT --from-hf "
                f"{path} --text-column NAME --tokenizer TOKENIZER` (or JSONL, Parquet and text files: "
                "docs/data.md)"
            )
        named = "" if role == "input_ids" and missing == ["input_ids"] else f" (named for {role})"
        super().__init__(
            f"dataset {path} lacks column(s) {missing}{named}; it has {present}. "
            "ladle serves the token ids of input_ids (a list of int per row) and takes the loss mask "
            "from loss_mask, else from labels (-100: no loss), else puts loss on every token; "
            "--column ROLE=NAME names other columns" + "".join(f"; {hint}" for hint in hints)
        )


class EmptyDatasetError(DatasetError):
    pass


class LengthMismatchError(DatasetError):
    """Two length sources of one row disagree (seq_len, input_ids, loss_mask)."""

    def __init__(self, path: str, what: str, count: int, first_rows: list[int]) -> None:
        self.count = count
        self.first_rows = first_rows
        super().__init__(f"dataset {path}: {what} in {count} row(s) (first rows: {first_rows})")


class ZeroLengthRowsError(DatasetError):
    def __init__(self, path: str, count: int, first_rows: list[int]) -> None:
        self.count = count
        self.first_rows = first_rows
        super().__init__(
            f"dataset {path}: {count} row(s) have no tokens (first rows: {first_rows}); "
            "remove them before serving (a zero-length row cannot be trained on)"
        )


# --- text sources of `ladle make-dataset --from-text` -------------------------


class TextSourceError(DatasetError):
    """A file given to ``make-dataset --from-text`` cannot be used; ``path`` names it."""

    kind = "invalid_argument"

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")

    def __reduce__(self) -> tuple[type[TextSourceError], tuple[str, str]]:
        return (type(self), (self.path, self.detail))


class EmptyTextError(TextSourceError):
    """The file holds no text (empty, or only whitespace)."""


class BinaryFileError(TextSourceError):
    """The file is not UTF-8 text (a NUL byte or an invalid UTF-8 sequence)."""


class UnreadableFileError(TextSourceError):
    """The file does not exist or cannot be read (permissions, a directory loop, I/O)."""


# --- sources and tokenizers of `ladle make-dataset` (service/ingest) ----------
# A problem with a whole source (or the tokenizer) is one of these, raised
# before or as it is found, so nothing is written; a problem with one record is
# a counted skip that the summary names, and too many of them are
# ``TooManySkippedError``. Each pickles with its facts (it may cross from a
# worker process).


class CorruptFileError(TextSourceError):
    """A source's bytes are not what its format promises (a truncated ``.gz``, a damaged Parquet file)."""


class EmptySourceError(TextSourceError):
    """A source holds no records (an empty file, only blank lines, no rows)."""


class SourceColumnError(TextSourceError):
    """A column the options name is missing from a source; ``missing`` and ``present`` name the columns."""

    def __init__(self, path: str, missing: list[str], present: list[str], where: str = "") -> None:
        self.missing = list(missing)
        self.present = list(present)
        self.where = where
        super().__init__(
            path,
            f"has no column {', '.join(map(repr, self.missing))}{where}; the columns it has: {self.present} "
            "(name one with --text-column, --prompt-column/--completion-column, --messages-column "
            "or --ids-column)",
        )

    def __reduce__(self) -> tuple[type[SourceColumnError], tuple[str, list[str], list[str], str]]:  # type: ignore[override]
        return (type(self), (self.path, self.missing, self.present, self.where))


class TokenizerError(TextSourceError):
    """The tokenizer given to ``make-dataset`` cannot be used; ``path`` names it, ``detail`` says why."""


class ChatTemplateError(TokenizerError):
    """``--messages-column`` needs a chat template: there is none, or it cannot mark assistant turns."""


class TooManySkippedError(DatasetError):
    """More records were skipped than ``--max-skipped-fraction`` allows; nothing was written.

    ``skipped`` of ``rows`` records read; ``reasons`` maps each reason to its count.
    """

    kind = "invalid_argument"

    def __init__(self, skipped: int, rows: int, limit: float, reasons: dict[str, int], first: str) -> None:
        self.skipped = skipped
        self.rows = rows
        self.limit = limit
        self.reasons = dict(reasons)
        self.first = first
        counts = ", ".join(f"{reason} {count}" for reason, count in self.reasons.items())
        super().__init__(
            f"{skipped} of {rows} record(s) were skipped ({counts}; first: {first}), more than "
            f"--max-skipped-fraction {limit} allows; nothing was written. Fix the input or the column "
            "options, or raise --max-skipped-fraction to keep the rest"
        )

    def __reduce__(self) -> tuple[type[TooManySkippedError], tuple[int, int, float, dict[str, int], str]]:
        return (type(self), (self.skipped, self.rows, self.limit, self.reasons, self.first))


# --- the cursor store -------------------------------------------------------
# Each store error keeps its facts as attributes (the network faces and the
# jobs layer read them) and pickles with them, so it crosses process
# boundaries (multiprocessing, spawn) intact.


class StoreError(LadleError):
    """The cursor store refused an operation, or cannot serve it as it is."""

    kind = "failed_precondition"


class StoreUnavailableError(StoreError):
    """The backing store cannot be reached or used now (locked too long, I/O error, closed)."""

    kind = "unavailable"


class StoreCredentialsError(StoreUnavailableError):
    """Redis refused the URL's credentials: waiting for it will not help (``ladle serve --store-wait``)."""


class StoreCorruptError(StoreError):
    """A job's stored record cannot be read as this ladle writes it; nothing was changed.

    ``key`` names where it lies in the store (a Redis key), ``field`` what is
    wrong in it (a field of the job, or a rank), ``detail`` how. Not
    transient: the record stays unreadable until it is deleted.
    """

    reason = "store_corrupt"

    def __init__(self, job: str, key: str, field: str, detail: str) -> None:
        self.job = job
        self.key = key
        self.field = field
        self.detail = detail
        super().__init__(
            f"job {job!r} cannot be read from the cursor store: {key} {detail} (written by another "
            "ladle version or another tool, or edited by hand?); no trainer can resume it as it is: "
            f"delete it with `ladle jobs --delete {job} --force` (naming the server's store: --redis-url "
            "URL or --state FILE) and start it again"
        )

    def __reduce__(self) -> tuple[type[StoreCorruptError], tuple[str, str, str, str]]:
        return (type(self), (self.job, self.key, self.field, self.detail))


class StoreFormatError(StoreCorruptError):
    """A job stored in a format newer than this ladle's (a newer ladle wrote it); nothing was changed.

    ``version`` is the job's format version, ``supported`` the newest this
    ladle reads. The record is not damaged: a ladle that knows ``version``
    reads it, this one neither reads nor writes it. ``field`` is ``format``.
    """

    reason = "store_format_newer"

    def __init__(self, job: str, key: str, version: int, supported: int) -> None:
        self.version = version
        self.supported = supported
        self.job = job
        self.key = key
        self.field = "format"
        self.detail = f"has format version {version}, newer than this ladle's {supported}"
        StoreError.__init__(
            self,
            f"job {job!r} in the cursor store (key {key}) {self.detail}: upgrade ladle, or delete "
            f"the job with `ladle jobs --delete {job} --force` (naming the server's store: --redis-url "
            "URL or --state FILE)",
        )

    def __reduce__(self) -> tuple[type[StoreFormatError], tuple[str, str, int, int]]:  # type: ignore[override]
        return (type(self), (self.job, self.key, self.version, self.supported))


class JobNotFoundError(StoreError):
    """No job of this name is in the store (it was never opened, or was deleted)."""

    kind = "not_found"
    reason = "unknown_job"

    def __init__(self, job: str) -> None:
        self.job = job
        super().__init__(f"job {job!r} not found in the cursor store; open it first")

    def __reduce__(self) -> tuple[type[JobNotFoundError], tuple[str]]:
        return (type(self), (self.job,))


class JobMismatchError(StoreError):
    """A stored job's identity differs from the one asked for; ``differences`` names each field.

    ``differences`` holds ``(field, stored, given)`` triples, in the order
    ``dataset_fingerprint``, ``config_fingerprint``.
    """

    reason = "config_mismatch"

    def __init__(
        self, job: str, differences: tuple[tuple[str, str, str], ...], message: str | None = None
    ) -> None:
        self.job = job
        self.differences = differences
        detail = "; ".join(f"{f} differs: stored {old!r}, given {new!r}" for f, old, new in differences)
        super().__init__(
            message
            or f"job {job!r} exists with another identity ({detail}); refusing to resume it on other "
            "data or another schedule config. Use a new job name, or start it over from the "
            f"beginning: `ladle jobs --delete {job} --state FILE` (or `--redis-url URL`: the server's "
            "store; stop the job's trainers first), or from Python with "
            "ladle.service.jobs.JobRegistry.open(..., reset=True)"
        )

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the fields that differ."""
        return tuple(f for f, _, _ in self.differences)

    def __reduce__(self) -> tuple[type[JobMismatchError], tuple[str, tuple[tuple[str, str, str], ...]]]:
        return (type(self), (self.job, self.differences))


class AlgorithmVersionError(JobMismatchError):
    """A stored job was planned by an earlier version of ladle's schedule algorithm.

    The same config orders batches differently under this version, so the
    job cannot resume where it stopped (guarantee 6); refused with nothing
    changed, like any ``JobMismatchError``.
    """

    def __init__(
        self, job: str, stored: int, current: int, differences: tuple[tuple[str, str, str], ...]
    ) -> None:
        self.stored_version = stored
        self.current_version = current
        super().__init__(
            job,
            differences,
            f"job {job!r} was planned by version {stored} of ladle's schedule algorithm, and this "
            f"server runs version {current}, which orders the same config's batches differently, so "
            "the job cannot resume where it stopped. Finish it with the ladle release that started it, "
            "or start it over under a new job name (or delete it first, its trainers stopped: "
            f"`ladle jobs --delete {job} --state FILE` or `--redis-url URL`); a checkpoint of it "
            "cannot be loaded into the new job",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.job, self.stored_version, self.current_version, self.differences))


class CheckpointMismatchError(StoreError):
    """A loaded checkpoint that the job's schedule cannot continue (refused before anything changes).

    The client raises ``StateDictError`` for it, as for any state of another
    schedule (the same ``schedule_mismatch`` reason on the wire).
    """

    reason = "schedule_mismatch"


class CheckpointPositionError(CheckpointMismatchError):
    """A loaded checkpoint's position is not the job's (a step past its epoch's end): a bad argument."""

    kind = "invalid_argument"  # reason: schedule_mismatch, as BatchClient reads it (a StateDictError)


class WorldSizeMismatchError(StoreError):
    """A job's stored world size differs from the one a server or trainer gave."""

    reason = "world_size_mismatch"

    def __init__(self, job: str, stored: int, given: int) -> None:
        self.job = job
        self.stored = stored
        self.given = given
        super().__init__(
            f"job {job!r} runs with world_size={stored}, but world_size={given} was given; "
            f"start every trainer with world_size={stored}, or resume the job with the new size "
            "on purpose: BatchClient(..., elastic=True) re-plans the rest of the epoch for it"
        )

    def __reduce__(self) -> tuple[type[WorldSizeMismatchError], tuple[str, int, int]]:
        return (type(self), (self.job, self.stored, self.given))


class FencedError(StoreError):
    """A trainer process presented a generation that is not its rank's current one.

    ``generation < current``: a newer process joined for the same rank and job
    and this one was fenced off. ``generation > current``: the store has lost
    writes it once acknowledged (its state is older than the trainer's).
    """

    reason = "fenced"

    def __init__(self, job: str, rank: int, generation: int, current: int) -> None:
        self.job = job
        self.rank = rank
        self.generation = generation
        self.current = current
        if generation < current:
            why = (
                f"this trainer process was replaced by a newer one for rank {rank} of job {job!r} "
                f"(generation {generation}, current {current}); its cursor updates are refused, "
                "stop this process"
            )
        else:
            why = (
                f"generation {generation} for rank {rank} of job {job!r} is newer than the store's "
                f"{current}: the store has lost writes it acknowledged; join again to resynchronise"
            )
        super().__init__(why)

    def __reduce__(self) -> tuple[type[FencedError], tuple[str, int, int, int]]:
        return (type(self), (self.job, self.rank, self.generation, self.current))


class CursorRegressionError(StoreError):
    """``advance`` was asked to move a rank's cursor backwards; the stored position is kept.

    ``stored`` and ``given`` are ``(epoch, step)`` pairs.
    """

    def __init__(self, job: str, rank: int, stored: tuple[int, int], given: tuple[int, int]) -> None:
        self.job = job
        self.rank = rank
        self.stored = stored
        self.given = given
        super().__init__(
            f"rank {rank} of job {job!r} is at epoch {stored[0]} step {stored[1]}; advance cannot move "
            f"it back to epoch {given[0]} step {given[1]} (use rewind to load a checkpoint)"
        )

    def __reduce__(
        self,
    ) -> tuple[type[CursorRegressionError], tuple[str, int, tuple[int, int], tuple[int, int]]]:
        return (type(self), (self.job, self.rank, self.stored, self.given))

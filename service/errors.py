"""One error hierarchy for all of ladle.

Every error a user can cause is a ``LadleError`` with a ``kind`` that the
network faces map once to a gRPC status code and an HTTP status, so a bad
request is always a typed, explained refusal and never a crash.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ConfigError",
    "DatasetError",
    "DatasetNotFoundError",
    "EmptyDatasetError",
    "LadleError",
    "LengthMismatchError",
    "MissingColumnsError",
    "OverlongSampleError",
    "ScheduleError",
    "ZeroLengthRowsError",
]


class LadleError(Exception):
    """Base of every error ladle raises on purpose.

    ``kind`` names the class of failure in gRPC's vocabulary
    (``invalid_argument``, ``not_found``, ``failed_precondition``...), so the
    gRPC servicer and the HTTP app map it in one place.
    """

    kind: ClassVar[str] = "internal"


class ConfigError(LadleError, ValueError):
    """A schedule or server option is invalid; ``field`` names it."""

    kind = "invalid_argument"

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


class ScheduleError(LadleError, ValueError):
    """The inputs cannot make a valid schedule (e.g. fewer rows than ranks)."""

    kind = "invalid_argument"


class OverlongSampleError(ScheduleError):
    """A sample is longer than ``max_seq_len`` and ``overlong="error"``."""

    def __init__(self, count: int, first_rows: list[int], max_seq_len: int) -> None:
        self.count = count
        self.first_rows = first_rows
        super().__init__(
            f"{count} sample(s) longer than max_seq_len={max_seq_len} "
            f"(first rows: {first_rows}); set overlong='truncate' or 'drop' to accept them"
        )


class DatasetError(LadleError):
    """The dataset on disk cannot be served as it is."""

    kind = "failed_precondition"


class DatasetNotFoundError(DatasetError):
    kind = "not_found"


class MissingColumnsError(DatasetError):
    def __init__(self, path: str, missing: list[str], present: list[str]) -> None:
        self.missing = missing
        super().__init__(
            f"dataset {path} lacks column(s) {missing}; it has {present}. "
            "ladle needs input_ids (list of int) and loss_mask (list of int, same lengths)"
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

"""The schedule's one validated configuration object.

``ScheduleConfig`` is frozen and validated on construction; the CLI, the server,
the HTTP API and the tests all build it the same way (keyword arguments, a
mapping, a TOML file or CLI flags). Its ``fingerprint`` includes
``ALGORITHM_VERSION`` so that a changed algorithm can never silently change the
order a resumed run receives.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError

__all__ = [
    "ALGORITHM_VERSION",
    "MAX_BATCH_SIZE",
    "MAX_SEQ_LEN",
    "MAX_SORT_CHUNK",
    "MAX_TOKEN_BUDGET",
    "PRODUCTION_BOUNDS",
    "PRODUCTION_PRESET",
    "ScheduleConfig",
]

# Bump whenever any change alters the batches or their order for the same
# inputs; the golden test pins the current value's output.
ALGORITHM_VERSION = 2

# The bounds of the production run docs/product.md describes: `bucket_bounds = "production"`.
# Not the default: on real text they put 95-97% of rows in one bucket; "auto" fits
# edges to the dataset instead.
PRODUCTION_BOUNDS: tuple[int, ...] = (0, 770, 1216, 1728, 2432, 3296, 8193)
PRODUCTION_PRESET = "production"

# Upper bounds of the sizes, far above any real run: the schedule keeps int64
# arrays with one entry per length up to max_seq_len (and the last bucket edge)
# and packs row, length and chunk into 62-bit keys, and a batch frame must fit
# gRPC's 2 GiB message limit (about 5 bytes a token), so a config past them
# would overflow or exhaust memory later instead of being refused here.
MAX_SEQ_LEN = 2**24
MAX_TOKEN_BUDGET = 2**28
MAX_BATCH_SIZE = 2**20
MAX_SORT_CHUNK = 2**31


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class ScheduleConfig(BaseModel):
    """Everything that, with the dataset, the epoch and the world size, fixes a schedule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_bounds: tuple[int, ...] | Literal["auto"] = Field(
        default="auto",
        description="'auto' (default): the num_buckets edges that minimise padded tokens on this "
        "dataset. Or increasing edges [b0, b1, ..., bK]: bucket i holds lengths in [b_i, b_{i+1}). "
        "Or 'production': the edges of the production run in docs/product.md.",
    )
    num_buckets: int = Field(
        default=6,
        ge=1,
        le=64,
        description="Buckets made by 'auto' (unused with explicit edges, but part of the config's identity: "
        "give every replica the same value).",
    )
    max_seq_len: int = Field(default=8192, ge=1, le=MAX_SEQ_LEN, description="Longer samples are overlong.")
    token_budget: int = Field(
        default=49152, ge=1, le=MAX_TOKEN_BUDGET, description="rows x padded_len per batch."
    )
    max_batch_size: int = Field(
        default=64, ge=1, le=MAX_BATCH_SIZE, description="At most this many rows a batch."
    )
    pad_to_multiple_of: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="A batch's width is its longest (cut) row rounded up to this; rows are still cut "
        "at max_seq_len, so the width can exceed it.",
    )
    seed: int = Field(default=0, ge=0, lt=2**63)
    interleave: Literal["stride", "random"] = "stride"
    rank_mode: Literal["mixed", "sync"] = "mixed"
    grad_accum: int = Field(default=1, ge=1, le=4096)
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    remainder: Literal["split", "drop"] = "split"
    sort_chunk: int = Field(
        default=2048,
        ge=1,
        le=MAX_SORT_CHUNK,
        description="Rows of one bucket are dealt into random chunks of about this size and "
        "sorted by length inside each chunk before packing (padding vs randomness).",
    )

    @field_validator("bucket_bounds", mode="before")
    @classmethod
    def _parse_bounds(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text == "auto":
                return "auto"
            if text == PRODUCTION_PRESET:
                return PRODUCTION_BOUNDS
            try:
                return tuple(int(part) for part in text.replace(" ", "").strip("[]").split(","))
            except ValueError as exc:
                raise ValueError(
                    f"expected 'auto', '{PRODUCTION_PRESET}' or comma-separated integers, got {value!r}"
                ) from exc
        if isinstance(value, list):
            return tuple(value)
        return value

    @field_validator("bucket_bounds")
    @classmethod
    def _check_bounds(cls, value: tuple[int, ...] | str) -> tuple[int, ...] | str:
        if value == "auto":
            return value
        bounds = tuple(int(b) for b in value)
        if len(bounds) < 2:
            raise ValueError("needs at least two edges (one bucket)")
        if len(bounds) > 65:
            raise ValueError(f"at most 64 buckets, got {len(bounds) - 1}")
        if any(b < 0 for b in bounds):
            raise ValueError(f"edges must be non-negative, got {list(bounds)}")
        if bounds[-1] > MAX_SEQ_LEN + 1:
            raise ValueError(f"the last edge must be at most {MAX_SEQ_LEN + 1}, got {bounds[-1]}")
        if any(b >= a for a, b in zip(bounds[1:], bounds[:-1], strict=True)):
            raise ValueError(f"edges must be strictly increasing, got {list(bounds)}")
        return bounds

    @model_validator(mode="after")
    def _check_together(self) -> ScheduleConfig:
        if self.bucket_bounds != "auto":
            bounds = self.bucket_bounds
            if bounds[0] > 1:
                raise ValueError(
                    f"bucket_bounds: first edge {bounds[0]} leaves lengths 1..{bounds[0] - 1} "
                    "without a bucket; start at 0 or 1"
                )
            if bounds[-1] <= self.max_seq_len:
                default = (
                    f" (the '{PRODUCTION_PRESET}' edges, for one production mix)"
                    if bounds == PRODUCTION_BOUNDS
                    else ""
                )
                raise ValueError(
                    f"bucket_bounds: last edge {bounds[-1]}{default} must exceed max_seq_len="
                    f"{self.max_seq_len} (edges are half-open), e.g. {self.max_seq_len + 1}; "
                    "or --bucket-bounds auto, which fits edges to the dataset"
                )
        longest = round_up(self.max_seq_len, self.pad_to_multiple_of)
        if self.token_budget < longest:
            raise ValueError(
                f"token_budget: {self.token_budget} cannot hold one row of max_seq_len="
                f"{self.max_seq_len} padded to a multiple of {self.pad_to_multiple_of} ({longest})"
            )
        return self

    # --- construction helpers that turn pydantic's errors into ConfigError ---

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ScheduleConfig:
        """Build from a mapping (a TOML table, CLI flags); unknown keys are refused."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise _config_error(exc) from None

    @classmethod
    def from_toml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> ScheduleConfig:
        """Load a TOML file (its ``[schedule]`` table, or the top level), then apply overrides."""
        path = Path(path)
        try:
            with path.open("rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError("config", f"no such file: {path}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("config", f"{path} is not valid TOML: {exc}") from None
        except OSError as exc:  # a folder, no permission, an I/O error
            raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
        table = doc.get("schedule", doc)
        if not isinstance(table, dict):
            raise ConfigError("config", f"{path}: [schedule] must be a table")
        merged = {**table, **(overrides or {})}
        return cls.from_mapping(merged)

    def to_toml(self) -> str:
        """A ``[schedule]`` table of every field, which ``from_toml`` reads back to an equal config."""
        lines = ["[schedule]"]
        for key, value in self.model_dump(mode="json").items():
            lines.append(f"{key} = {json.dumps(value)}")
        return "\n".join(lines) + "\n"

    def replace(self, **changes: Any) -> ScheduleConfig:
        """A validated copy with some fields changed."""
        return self.from_mapping({**self.model_dump(), **changes})

    # --- identity ---

    def canonical_json(self, algorithm_version: int | None = None) -> str:
        # Every field, num_buckets too beside explicit edges (where it shapes nothing): jobs stored
        # under these hashes must keep resuming, so the hash changes only with ALGORITHM_VERSION.
        data = self.model_dump(mode="json")
        data["algorithm_version"] = ALGORITHM_VERSION if algorithm_version is None else algorithm_version
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def fingerprint(self, algorithm_version: int | None = None) -> str:
        """A stable hash of every field plus the algorithm version (hex, 16 chars).

        ``algorithm_version`` names what this config's fingerprint was under an
        earlier version, so a job planned by it is told apart from a job of
        another config (``JobRegistry``).
        """
        return hashlib.sha256(self.canonical_json(algorithm_version).encode()).hexdigest()[:16]

    def planned_by(self, fingerprint: str) -> int | None:
        """The earlier algorithm version under which this config had ``fingerprint``, if any.

        Version 1's default edges were the production preset, so a job that
        it planned with the defaults counts as this config's when this one
        takes the default ``auto``.
        """
        for version in range(ALGORITHM_VERSION - 1, 0, -1):
            if self.fingerprint(version) == fingerprint:
                return version
        if self.bucket_bounds == "auto":
            as_v1 = self.model_copy(update={"bucket_bounds": PRODUCTION_BOUNDS})
            if as_v1.fingerprint(1) == fingerprint:
                return 1
        return None


def _config_error(exc: ValidationError) -> ConfigError:
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first.get("loc", ())) or "config"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":  # a misspelt key: name the field it most likely meant
        known = sorted(ScheduleConfig.model_fields)
        close = difflib.get_close_matches(loc, known, n=1, cutoff=0.6)
        guess = f"did you mean {close[0]!r}? " if close else ""
        message = f"is not a schedule setting; {guess}the settings are {known}"
    if loc == "config" and ":" in message:
        # model-level checks name their field at the start of the message
        loc, message = (part.strip() for part in message.split(":", 1))
    return ConfigError(loc, message)

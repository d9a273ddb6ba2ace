"""Progress of ``ladle make-dataset`` on stderr, and its closing summary.

On a terminal one line is redrawn in place (``\\r``) a few times a second;
otherwise (a log, CI) a line is printed every ``LOG_EVERY_S`` seconds, so a
long run is visible either way. The line shows rows, tokens, tokens/s, and
the share done and the ETA from the input read over its total (bytes, or
rows for Arrow sources) when the total is known.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["LOG_EVERY_S", "Progress", "format_summary"]

LOG_EVERY_S = 5.0
_TTY_EVERY_S = 0.2


def _si(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Counts rows, tokens and input work done; draws them at most every so often (``enabled``)."""

    def __init__(
        self,
        total: int | None,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        what: str = "tokenizing",
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.what = what
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.began = time.perf_counter()
        self._last = self.began
        self.rows = 0
        self.tokens = 0
        self.work = 0
        self._drawn = False

    def update(self, rows: int, tokens: int, work: int) -> None:
        self.rows += rows
        self.tokens += tokens
        self.work += work
        now = time.perf_counter()
        if self.enabled and now - self._last >= (_TTY_EVERY_S if self.tty else LOG_EVERY_S):
            self._last = now
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        elapsed = (time.perf_counter() if now is None else now) - self.began
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.what}: {self.rows:,} rows", f"{_si(self.tokens)} tokens", f"{_si(rate)} tokens/s"]
        if self.total:
            done = min(1.0, self.work / self.total)
            eta = elapsed * (1 - done) / done if done > 0 else None
            parts.append(f"{100 * done:.0f}%" + (f" ETA {_clock(eta)}" if eta is not None else ""))
        parts.append(f"elapsed {_clock(elapsed)}")
        return ", ".join(parts)

    def _draw(self, now: float) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + self.line(now))
            self._drawn = True
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line (a terminal keeps the last one)."""
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def format_summary(summary: dict[str, Any], seconds: float) -> str:
    """The summary of a run, a few lines for people (``summary`` as the manifest records it)."""
    lines = [
        f"read {summary['records']:,} records, wrote {summary['rows']:,} rows of "
        f"{summary['tokens']:,} tokens "
        f"in {seconds:.1f}s ({_si(summary['tokens'] / seconds if seconds > 0 else 0)} tokens/s)"
    ]
    if summary["chunked"]:
        lines.append(
            f"cut {summary['chunked']:,} long document(s) into {summary['chunks']:,} chunks of at most "
            f"{summary['max_seq_len']} tokens"
        )
    if summary["truncated"]:
        lines.append(
            f"truncated {summary['truncated']:,} long document(s) to {summary['max_seq_len']} tokens"
        )
    skipped = summary["skipped_records"]
    if skipped:
        total = sum(entry["count"] for entry in skipped.values())
        lines.append(f"skipped {total:,} record(s):")
        for reason, entry in skipped.items():
            lines.append(f"  {reason}: {entry['count']:,} (first: {', '.join(entry['first'])})")
    else:
        lines.append("skipped no record")
    return "\n".join(lines)

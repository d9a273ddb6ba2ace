"""``ladle make-dataset`` from the formats people have: JSONL, Parquet, ``save_to_disk`` folders, text.

One concept per module: ``sources`` (the inputs, streamed in raw batches),
``tokenizer`` (which tokenizer, loaded offline), ``encode`` (a record into
tokens and a loss mask, cut to ``max_seq_len``), ``workers`` (processes that
tokenize, results in input order), ``writer`` (rows streamed into Arrow
shards), ``progress`` (the progress line and the summary), ``make`` (the
pipeline and its manifest) and ``command`` (the CLI's arguments).

Importing this package is cheap; ``make_dataset_from`` imports the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .encode import Options
    from .make import Made, make_dataset_from
    from .sources import Source

__all__ = ["Made", "Options", "Source", "make_dataset_from"]


def __getattr__(name: str) -> Any:
    if name in ("Made", "make_dataset_from"):
        from . import make

        return getattr(make, name)
    if name == "Options":
        from .encode import Options

        return Options
    if name == "Source":
        from .sources import Source

        return Source
    raise AttributeError(name)

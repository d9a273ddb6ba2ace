"""ladle: length-bucketed, proportionally interleaved batches for LLM training.

The distribution maps three folders of the repository to import names:
``ladle.service`` (schedule, dataset access, server, CLI), ``ladle.client``
(``BatchClient``) and ``ladle.proto`` (the gRPC contract). ``ladle.ScheduleSampler``,
``ladle.pad_collate`` and ``ladle.lengths_of`` put the schedule in a plain ``DataLoader``.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["ScheduleSampler", "__version__", "lengths_of", "pad_collate"]

# In-process use without a server (ladle.client.sampler), imported on first use: `import ladle`
# stays light for the trainer's client and the CLI.
_LAZY = {"ScheduleSampler", "lengths_of", "pad_collate"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ladle.client import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module 'ladle' has no attribute {name!r}")

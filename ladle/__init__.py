"""ladle: length-bucketed, proportionally interleaved batches for LLM training.

The distribution maps three folders of the repository to import names:
``ladle.service`` (schedule, dataset access, server, CLI), ``ladle.client``
(``BatchClient``) and ``ladle.proto`` (the gRPC contract).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""ladle's benchmarks: ``python -m benchmarks.run`` (``make bench``)."""

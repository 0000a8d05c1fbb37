"""PolyLoop's benchmarks: the kernel measured beside hand-written floors and peer libraries.

Run them with ``python -m bench`` (``--help`` lists them; ``bench/README.md`` says what
each measures). Every figure that matters is a ratio between two measurements taken in
the same process run.
"""

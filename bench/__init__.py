"""PolyLoop's benchmarks: the kernel measured beside hand-written floors and peer libraries.

Run them with ``python bench/run.py`` (see ``bench/README.md``). Every figure that
matters is a ratio between two measurements taken in the same process run.
"""

"""Benchmark: prompt sets, the interleaved harness and its report (``m2r2 bench``)."""

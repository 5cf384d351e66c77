"""Other tuners run under the same workloads, tolerance and trial budget as ours, for benchmarks/.

Peers live in a separate environment (`.venv-bench`, see benchmarks/requirements-bench.txt) and are imported
lazily, so the package itself never depends on them.
"""

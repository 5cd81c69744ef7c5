"""Benchmarks for lifecycle-serve. ``python -m bench --help`` lists the CLI's subcommands.

The older fixed-scenario scripts (``bench_engine.py``, ``bench_graph.py``, ``bench_observability.py``)
still run on their own. This package's ``__init__`` imports nothing so those scripts stay cheap.
"""

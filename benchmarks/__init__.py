"""Speed, memory, communication and convergence benchmarks, one package per family.

Each entry point runs from the repository root as ``python -m benchmarks.<family>.<name>`` (see
docs/architecture.md's benchmark map) and writes its JSON and markdown under ``benchmarks/<family>/results/``.
Tests import the helpers (tests/test_benchmarks.py); they never run a benchmark in full.
"""

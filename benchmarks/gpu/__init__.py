"""The GPU check's sections (``benchmarks/gpu/check.py``): one module per section, each ``run(ctx, sec)``
filling its ``Section`` (rows, skipped cases, notes) and stopping at the section's time budget; their
results from lent GPUs are in ``results/``."""

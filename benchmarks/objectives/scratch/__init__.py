"""The from-scratch benchmark (``python -m benchmarks.objectives.scratch``): CLIP towers trained from random
init by ``toolkit train`` on Unicode glyphs drawn by many fonts, every objective tuned per cell on a
validation style and scored on a held-out style.

``main`` (arguments, cells, tuning), ``methods`` (the compared objectives and their grids), ``glyphset``
(the set, its training shards and retrieval sets, built by the project's own stages), ``runs`` (one
``toolkit train`` run, the pool and its run cache), ``report`` (tables, curves, JSON).
"""

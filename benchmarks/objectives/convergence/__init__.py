"""The convergence benchmark (``python -m benchmarks.objectives.convergence``): every objective trained
through the trainer's own step on LiT features of emoji drawings, tuned per cell, scored on a held-out artist.

``main`` (arguments, cells, tuning), ``methods`` (the compared objectives and their knob grids), ``runs`` (one
training run through ``toolkit.train.loop.train_step``, the worker pool and its run cache), ``report``
(tables, curves, JSON), ``emoji_artists`` (the frozen-tower feature cache of the artists' drawings).
"""

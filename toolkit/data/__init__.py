"""Data stages, from image sources to training batches.

- ``acquire/``: URL lists, ``fetch`` (img2dataset), ``shard`` (local files), the emoji ``demo``, ``serve``;
- ``raw/``: the raw shard layout those write, failure reasons, and a reader for damaged tars;
- ``trainset/``: the training-shard format (reader and writer), ``precompute`` and the training loader;
- ``inspect``: counts, skip reasons and a contact sheet of either kind of shard folder;
- ``images``: decoding to RGB at a fixed size, shared by precompute, inspect, acquire and benchmarks.
"""

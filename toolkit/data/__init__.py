"""Data stages: fetch (img2dataset), shard, demo, serve, precompute, loaders.

Raw shards everywhere follow img2dataset's webdataset layout: ``00000.tar`` with ``<key>.jpg``,
``<key>.txt`` and ``<key>.json`` per sample, plus ``00000_stats.json`` and ``00000.parquet``.
"""

"""Data stages: fetch, shard, demo sources, precompute, inspect, and the webdataset training loader."""

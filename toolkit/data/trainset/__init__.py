"""Training shards: the ``cliptk-train-v1`` format, reader and writer together (``format``), ``precompute``
from raw shards (its per-shard work in ``precompute_worker``) and the training ``loader``."""

"""Training shards: the ``cliptk-train-v1`` format (``format``, ``writer``), the storage modes (``storage/``),
``precompute/`` from raw shards, the batch ``order`` and the training ``loader``."""

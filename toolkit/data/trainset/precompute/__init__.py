"""``toolkit data precompute``: raw shards -> training shards with dense global ids.

``stage`` (config and ``run``), ``job`` (what every raw shard shares, decided once), ``worker`` (one raw
shard, in forked workers), ``ids`` (dense ids over all shards), ``resume`` (reuse of finished raw shards),
``dist`` and ``rank`` (several processes or nodes). The storage modes write the files
(:mod:`toolkit.data.trainset.storage`)."""

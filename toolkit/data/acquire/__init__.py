"""Getting images and captions into raw shards: URL lists (``urllist``), ``fetch`` with img2dataset (and
its subprocess, ``fetch_worker``), local files (``shard``), the emoji ``demo`` set and a local HTTP server
(``serve``) to fetch it from."""

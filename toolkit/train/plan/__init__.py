"""Memory and traffic planning: ``planner`` (``toolkit plan``), ``traffic`` (bytes per step by mode),
``memprobe`` (measured activation constants), ``automicro`` (``--micro-batch-size auto``), ``hostmem``
(glibc's release of freed host memory)."""

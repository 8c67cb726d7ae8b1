"""Memory and traffic planning: ``planner`` (``toolkit plan``: its ``config``, ``memory`` model and
``report``), ``traffic`` (bytes per step by mode), ``memprobe`` (measured activation constants),
``estimate`` (a CUDA plan without a GPU), ``fsdp_memory`` (``--fsdp``'s sharded rows), ``automicro``
(``--micro-batch-size auto``)."""

"""The trainer's ranks' preemption flag (``signals``); starting the ranks is toolkit.core.launch's
``launch_job`` (one process, torchrun's ranks, SLURM), shared with precompute's ranks."""

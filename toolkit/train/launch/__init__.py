"""Launching the trainer's ranks: ``launcher`` (one process, torchrun's ranks, SLURM: the trainer's config
on toolkit.core.launch, whose agent and supervisor precompute's ranks share), ``signals`` (the ranks'
preemption flag)."""

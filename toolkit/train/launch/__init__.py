"""Launching the trainer's ranks: ``launcher`` (one process, torchrun's ranks, SLURM), ``agent`` (torchrun's
elastic agent in a child process), ``supervise`` (the launcher's waits and signals), ``signals`` (the
ranks' preemption flag)."""

"""Checkpoints: ``format`` (the directory format, its manifest and checks), ``resume`` (which checkpoint,
and the refusal of another configuration), ``state`` (the trainer's part ``StateIO``: write, resume, load)."""

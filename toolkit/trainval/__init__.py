"""Training with in-training evaluation: the glue neither ``train`` nor ``eval`` may own (they never import
each other). It sits above both and below ``pipeline`` and ``cli``."""

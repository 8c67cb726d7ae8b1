"""Objective benchmarks: the convergence comparison of every objective, NeuCLIP validation, LiT recipe
validation."""

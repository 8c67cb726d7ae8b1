"""End-to-end trainer benchmarks against open_clip_train: throughput, largest batch under a memory budget."""

"""The reference-model benchmark (``python -m benchmarks.objectives.reference``): the convergence benchmark's
cells with students that read a cliptk-trained reference's embeddings (DRRho-CLIP; distill where registered).

``main`` (arguments, cells, tuning), ``teacher`` (the reference trained on fewer artists, the timed reference
pass), ``bench`` (runs whose batches carry the reference's rows), ``methods`` (the objectives by registry
kind), ``report`` (tables, targets, costs).
"""

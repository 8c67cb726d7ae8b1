"""Distillation from a reference (teacher) model (``--loss distill``): ``loss.DistillLoss``, its tiled KL
(``kl``), its settings (``config.DistillConfig``) and its registry ``spec``."""

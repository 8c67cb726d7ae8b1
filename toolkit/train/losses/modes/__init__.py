"""The softmax (CLIP) loss across K ranks in its distributed modes: ``contrastive`` (the entry point
``contrastive_loss``; gather, disco), ``ring`` (Inf-CL), ``anchors`` (the fastclip mode), ``common`` (what
they share). SigLIP keeps its own modes in ``losses/siglip/``."""

from toolkit.train.losses.modes.contrastive import MODES, contrastive_loss, mean_over_ranks

__all__ = ["MODES", "contrastive_loss", "mean_over_ranks"]

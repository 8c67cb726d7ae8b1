"""DRRho-CLIP (arXiv 2505.06699): FastCLIP's estimators on the excess pairwise loss over a frozen reference
model whose features the training set caches (``loss.py``; docs/objectives.md, "DRRho-CLIP")."""

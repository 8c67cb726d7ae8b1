"""NeuCLIP (arXiv 2511.08417): FastCLIP's robust global contrastive loss with each sample's log-normaliser
predicted by a small prototype network instead of per-sample moving averages.

- ``loss.NeuCLIPLoss``: the objective behind ``TrainingLoss`` (``--loss neuclip``) and its alternating
  update of the network (in ``end_step``); ``network.NormaliserNetwork``: the prototypes, their AdaGrad
  update and restarts.
See docs/neuclip.md. Import from the modules: the package stays empty.
"""

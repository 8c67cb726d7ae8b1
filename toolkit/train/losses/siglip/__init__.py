"""The sigmoid (SigLIP) objective: ``modes`` (the global-batch loss in the gather, ring and fastclip modes)
and ``loss`` (``SigLIPLoss``, the ``TrainingLoss`` registered as ``siglip``)."""

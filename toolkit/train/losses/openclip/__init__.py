"""The OpenCLIP baseline (``--loss openclip``): ``loss.OpenCLIPLoss`` and its registry ``spec``."""

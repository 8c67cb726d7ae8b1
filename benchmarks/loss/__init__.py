"""Loss benchmarks: loss memory and time (CLIP, SigLIP) and the feature bytes each distributed mode sends."""

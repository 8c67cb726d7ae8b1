"""Zero-shot evaluation (clip-benchmark metrics), evaluation-set builders and reports."""

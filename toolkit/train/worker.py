"""The default entry of launched ranks (no evaluation callback): ``python -m toolkit.train.worker CONFIG.yaml``.

The CLI and the pipeline launch ``toolkit.pipeline.train_stage`` instead, which adds zero-shot evaluation.
"""

from toolkit.train.run import worker_main

if __name__ == "__main__":
    worker_main()

"""The trainer's entry for launched ranks:
``python -m toolkit.train.worker CONFIG.yaml [--eval-factory MODULE:FUNCTION]``.

``toolkit train``, the pipeline and a user's own ``torchrun``/``srun`` start every rank here;
``--eval-factory`` names the function that builds the rank's evaluation callback (``toolkit.trainval``
passes its own).
"""

from toolkit.train.run import worker_main

if __name__ == "__main__":
    worker_main()

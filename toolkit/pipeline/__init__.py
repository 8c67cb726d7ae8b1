"""YAML pipelines: the runner (``runner``), the registry of stage kinds (``kinds``) and the ``shell``
stage."""

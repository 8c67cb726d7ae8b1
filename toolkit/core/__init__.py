"""Config, logging/progress, fsspec file helpers, stage manifests: the layer everything else stands on."""

"""Config, logging/progress, fsspec io, stage manifests: the layer everything else stands on."""

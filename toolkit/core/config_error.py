"""``ConfigError``: a config value is unknown, missing, of the wrong type or out of range (core.config builds
configs and raises it; it lives in a module of its own so that a config module may raise it without
importing the loader)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is unknown, missing, of the wrong type or out of range."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {message}")

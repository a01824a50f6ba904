"""The one error a configuration raises (``refimpl.config``, ``refimpl.model_config``)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which field and why."""


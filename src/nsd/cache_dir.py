"""Where nsd keeps what it fetches, derives and measures (models, converted folders,
derived weights, calibrations): one root, read at every call so tests and users can move
it with ``$NSD_CACHE``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Cache root: ``$NSD_CACHE`` if set, else ``~/.cache/nsd`` (read on every call)."""
    override = os.environ.get("NSD_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "nsd"

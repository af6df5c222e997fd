"""Model backends: one small interface (:class:`ModelBackend`), one file per engine."""

from nsd.backends.base import ModelBackend

__all__ = ["ModelBackend"]

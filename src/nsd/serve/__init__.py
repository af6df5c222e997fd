"""An OpenAI-compatible HTTP server over one :class:`nsd.api.Engine`.

``nsd serve`` parses flags and calls :func:`run_server`; tests build the app directly with
:func:`create_app` around any engine-like object. Layers: ``protocol`` (request models,
response and error bodies), ``worker`` (the decode slots and their FIFO queue),
``metrics`` (Prometheus), ``app`` (routes), ``server`` (uvicorn, signals).
"""

from nsd.serve.app import create_app
from nsd.serve.config import ServerConfig
from nsd.serve.server import run_server

__all__ = ["ServerConfig", "create_app", "run_server"]

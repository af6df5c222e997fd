"""Server settings: one frozen dataclass, filled by the CLI, read by the app and server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nsd import options as optspec
from nsd.api import GenerationConfig
from nsd.errors import NSDError


@dataclass(frozen=True)
class ServerConfig:
    """How ``nsd serve`` listens and schedules. ``defaults`` holds the decoding settings a
    request gets for every field it leaves out (the server's decoding flags)."""

    model_name: str
    defaults: GenerationConfig = field(default_factory=GenerationConfig)
    host: str = "127.0.0.1"  # loopback unless the operator asks otherwise
    port: int = 8000
    api_key: str | None = None
    queue_size: int = 16  # requests allowed to wait behind the one being decoded
    request_timeout_s: float = 600.0  # from arrival to the last token, queueing included
    shutdown_timeout_s: float = 30.0  # grace for in-flight requests after SIGINT/SIGTERM
    max_body_bytes: int = 4 << 20
    # KV snapshots of recent sequences kept for reuse (MiB; 0: only the live cache is reused).
    prefix_cache_mb: float = 1024.0
    parallel: int = optspec.default("parallel")  # requests decoded at once (1: one at a time)
    prefill_chunk: int = optspec.default("prefill_chunk")  # tokens per step of a long forward
    max_stop: int = optspec.default("max_stop")  # stop strings a request may give

    def __post_init__(self) -> None:
        if not self.model_name:
            raise NSDError("the served model name is empty")
        if not 0 <= self.port <= 65535:
            raise NSDError(f"port must be in [0, 65535], got {self.port}")
        optspec.check("parallel", self.parallel)
        optspec.check("prefill_chunk", self.prefill_chunk)
        optspec.check("max_stop", self.max_stop)
        if self.queue_size < 0:
            raise NSDError(f"queue size must be >= 0, got {self.queue_size}")
        for name in ("request_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise NSDError(f"{name.removesuffix('_s').replace('_', ' ')} must be a positive "
                               f"number of seconds, got {value}")
        if not (self.prefix_cache_mb >= 0 and math.isfinite(self.prefix_cache_mb)):
            raise NSDError(f"the prefix cache budget must be a number of MiB >= 0, got "
                           f"{self.prefix_cache_mb}")
        if self.api_key is not None and not self.api_key.strip():
            raise NSDError("the API key is empty")

"""Prometheus metrics for NSD, registered in the worker process that verifies.

They reach the server's ``/metrics`` when prometheus_client runs in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set before the worker starts, which ``vllm serve`` does);
D per token is ``nsd:deviation_total / nsd:verified_tokens_total``.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram


class NSDMetrics:
    def __init__(self) -> None:
        self.relaxed = Counter("nsd:relaxed_accepts", "Draft tokens accepted only thanks to the relaxed set")
        self.deviation = Counter("nsd:deviation", "Sum of charged deviation λ·E over all verified positions")
        self.tokens = Counter("nsd:verified_tokens", "Tokens emitted by verification steps")
        self.per_request = Histogram("nsd:request_deviation", "Deviation D of each finished request",
                                     buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0))

    def on_step(self, relaxed: int, deviation: float, tokens: int) -> None:
        self.relaxed.inc(relaxed)
        self.deviation.inc(max(deviation, 0.0))
        self.tokens.inc(tokens)

    def on_finish(self, deviation: float) -> None:
        self.per_request.observe(deviation)

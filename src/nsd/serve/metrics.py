"""Prometheus metrics of one server, in a registry of its own (so apps built side by side
in one process, as in tests, do not collide). Every decode statistic comes from
:class:`nsd.decode.DecodeStats` via ``GenerationResult.stats``."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nsd.api import GenerationResult

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
TAU_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12, 17)
DEVIATION_BUCKETS = (0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)


# The prefix cache's figures: (name, help, kind); read from PrefixCache.stats() at scrape time.
PREFIX_CACHE_METRICS = (
    ("hits", "generations that reused cached KV for part of their prompt", "counter"),
    ("misses", "generations that prefilled their whole prompt", "counter"),
    ("reused_tokens", "prompt tokens whose KV was reused instead of prefilled", "counter"),
    ("draft_reused_tokens", "context tokens the draft model found in its cache when it first "
     "drafted, instead of reading them again", "counter"),
    ("prompt_tokens", "prompt tokens of the generations counted by hits and misses", "counter"),
    ("restores", "saved sequences loaded back into the models", "counter"),
    ("saves", "sequences saved (snapshots of the models' KV caches)", "counter"),
    ("evictions", "saved sequences dropped to stay within the budget", "counter"),
    ("bytes_held", "bytes of saved KV snapshots, in the process's memory (at most "
     "nsd_prefix_cache_budget_bytes; see process_resident_memory_bytes)", "gauge"),
    ("entries", "saved sequences", "gauge"),
    ("budget_bytes", "most bytes the saved snapshots may take (--prefix-cache-mb): what the "
     "server's memory may grow by past its models and KV caches", "gauge"),
)


class _PrefixCacheCollector:
    def __init__(self, cache: Callable[[], Any]) -> None:
        self._cache = cache

    def collect(self):
        cache = self._cache()
        stats = cache.stats() if cache is not None else {}
        for name, text, kind in PREFIX_CACHE_METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"nsd_prefix_cache_{name}", text, value=stats.get(name, 0))


class _BatchCollector:
    """The slots' batched forwards (see nsd.backends.sequences.BatchStats), read at scrape
    time; zero while the server decodes one request at a time."""

    def __init__(self, batcher: Callable[[], Any], running: Callable[[], int]) -> None:
        self._batcher, self._running = batcher, running

    def collect(self):
        batcher = self._batcher()
        stats = batcher.stats if batcher is not None else None
        yield GaugeMetricFamily("nsd_requests_decoding", "requests being decoded now",
                                value=self._running())
        yield CounterMetricFamily("nsd_batch_forwards", "model forwards run for several "
                                  "requests' sequences at once (one per model per batch)",
                                  value=stats.forwards if stats else 0)
        yield CounterMetricFamily("nsd_batch_sequences", "request sequences those forwards "
                                  "carried (divided by nsd_batch_forwards: the mean batch)",
                                  value=stats.sequences if stats else 0)
        yield CounterMetricFamily("nsd_batch_tokens", "tokens those forwards carried",
                                  value=stats.tokens if stats else 0)
        # The draft lengths chosen for the whole batch (nsd.draftlen.batchplan): cycles in which the
        # batch drafted together, and those in which it stepped plainly.
        cycles = getattr(getattr(batcher, "plan", None), "cycles", (0, 0))
        family = CounterMetricFamily("nsd_batch_plan_cycles", "cycles the batch's joint draft "
                                     "length plan chose: drafting together (k + 1 rounds "
                                     "each) or plain steps (one round each); a request alone "
                                     "plans none", labels=["plan"])
        family.add_metric(["draft"], cycles[1])
        family.add_metric(["plain"], cycles[0])
        yield family


class ServeMetrics:
    def __init__(self, queue_depth: Callable[[], int],
                 prefix_cache: Callable[[], Any] = lambda: None,
                 batcher: Callable[[], Any] = lambda: None,
                 running: Callable[[], int] = lambda: 0) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_PrefixCacheCollector(prefix_cache))
        # The process's memory (process_resident_memory_bytes, ...), beside the cache's share.
        ProcessCollector(registry=r)
        r.register(_BatchCollector(batcher, running))
        self.requests = Counter("nsd_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.rejections = Counter("nsd_rejections", "generation requests refused before decoding "
                                  "(queue_full, shutting_down)", ["reason"], registry=r)
        self.cancellations = Counter("nsd_cancellations", "generations stopped early "
                                     "(disconnect, timeout, shutdown)", ["reason"], registry=r)
        self.errors = Counter("nsd_generation_errors", "generations that failed", registry=r)
        self.prompt_tokens = Counter("nsd_prompt_tokens", "prompt tokens of finished generations",
                                     registry=r)
        self.completion_tokens = Counter("nsd_completion_tokens", "generated tokens", ["method"],
                                         registry=r)
        self.ttft = Histogram("nsd_time_to_first_token_seconds", "arrival to first text, "
                              "queueing included", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("nsd_queue_wait_seconds", "arrival to start of decoding",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("nsd_request_duration_seconds", "arrival to last token",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("nsd_tokens_per_second", "new tokens per second of "
                                      "decoding, per request", ["method"], buckets=RATE_BUCKETS,
                                      registry=r)
        self.tau = Histogram("nsd_tau", "mean accepted length (tokens per target pass), per "
                             "request", ["method"], buckets=TAU_BUCKETS, registry=r)
        self.target_passes = Counter("nsd_target_passes", "target forward passes after prefill",
                                     ["method"], registry=r)
        self.drafted = Counter("nsd_drafted_tokens", "draft tokens proposed", ["method"], registry=r)
        self.accepted = Counter("nsd_accepted_tokens", "draft tokens accepted", ["method"], registry=r)
        self.relaxed = Counter("nsd_relaxed_accepts", "draft tokens accepted only thanks to the "
                               "nucleus (they failed the exact test)", ["method"], registry=r)
        self.position_attempts = Counter("nsd_position_attempts", "blocks that reached draft "
                                         "position i", ["position"], registry=r)
        self.position_accepts = Counter("nsd_position_accepts", "accepts at draft position i",
                                        ["position"], registry=r)
        self.acceptance = Gauge("nsd_acceptance_by_position", "accepts / attempts at draft "
                                "position i since start", ["position"], registry=r)
        self.deviation = Counter("nsd_deviation", "summed deviation D (bound on total variation)",
                                 ["method"], registry=r)
        self.deviation_per_token = Histogram("nsd_deviation_per_token", "D / new tokens, per "
                                             "request", ["method"], buckets=DEVIATION_BUCKETS,
                                             registry=r)
        self.queue_depth = Gauge("nsd_queue_depth", "requests waiting behind the running ones",
                                 registry=r)
        self.queue_depth.set_function(queue_depth)
        self.in_progress = Gauge("nsd_requests_in_progress", "generation requests admitted and "
                                 "not yet answered", registry=r)
        self._attempts: dict[int, float] = {}
        self._accepts: dict[int, float] = {}

    def observe(self, result: GenerationResult, method: str, ttft_s: float | None,
                queue_s: float, duration_s: float) -> None:
        """Count one finished generation under ``method``, the method the request asked
        for (as its usage reports it), not the one the library names after the fact."""
        stats = result.stats
        m = method
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.completion_tokens.labels(m).inc(stats.new_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.queue_wait.observe(queue_s)
        self.duration.observe(duration_s)
        self.tokens_per_s.labels(m).observe(stats.tokens_per_s)
        self.tau.labels(m).observe(stats.tau)
        self.target_passes.labels(m).inc(stats.target_passes)
        self.drafted.labels(m).inc(stats.drafted_tokens)
        self.accepted.labels(m).inc(stats.accepted_tokens)
        self.relaxed.labels(m).inc(stats.relaxed_accepts)
        self.deviation.labels(m).inc(stats.deviation)
        if stats.new_tokens:
            self.deviation_per_token.labels(m).observe(stats.deviation / stats.new_tokens)
        for i, (n, a) in enumerate(zip(stats.position_attempts, stats.position_accepts)):
            self.position_attempts.labels(str(i)).inc(n)
            self.position_accepts.labels(str(i)).inc(a)
            self._attempts[i] = self._attempts.get(i, 0) + n
            self._accepts[i] = self._accepts.get(i, 0) + a
            if self._attempts[i]:
                self.acceptance.labels(str(i)).set(self._accepts[i] / self._attempts[i])

    def render(self) -> bytes:
        return generate_latest(self.registry)

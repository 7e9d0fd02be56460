"""Prometheus metrics of the OpenAI server (``GET /metrics``).

Engine state (running/waiting requests, KV usage, prefix cache) is read from the scheduler at
scrape time, so an idle server reports the truth rather than the last busy step. Latency
histograms (TTFT, TPOT, end-to-end) are observed by the frontend when a request finishes, i.e.
they include the rings and output processing but not HTTP.

Each server owns its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import msgspec
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from shm_engine.engine.output_processor import RequestOutput
from shm_engine.engine.protocol import SchedulerStats

_PREFIX = "shm_engine_"
_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The server's metric families and how engine stats and finished requests update them."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_PREFIX + name, doc, labels, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        # NOTE: the block pool counts these in tokens (a hit block adds block_size).
        self.prefix_hit_rate = gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
        )
        self.prefix_queries = gauge(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache since start."
        )
        self.prefix_hits = gauge(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache since start."
        )
        self.preemptions = gauge("num_preemptions", "Requests preempted since start.")
        self.spec_drafts = gauge(
            "spec_decode_num_draft_tokens", "Speculative draft tokens checked since start."
        )
        self.spec_accepted = gauge(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens found right since start."
        )
        self.frontend_inflight = gauge(
            "frontend_requests_in_flight", "Requests the HTTP frontend is serving."
        )
        self.engine_alive = gauge("engine_alive", "1 while the engine process is running.")

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(_PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(
                model_name
            )

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds", "Mean inter-token time per request.", _TPOT_BUCKETS
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last token.", _E2E_BUCKETS)
        self.prompt_tokens = Counter(
            _PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            _PREFIX + "generation_tokens", "Tokens generated.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            _PREFIX + "request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._model_name = model_name

    def update_stats(self, stats: SchedulerStats, alive: bool) -> None:
        """Engine state at scrape time; a dead engine runs nothing and holds no KV cache.

        The totals since start (prefix cache, preemptions) keep their last values.
        """
        if not alive:
            stats = msgspec.structs.replace(stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.set(stats.prefix_cache_hits)
        q = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / q if q else 0.0)
        self.preemptions.set(stats.num_preemptions)
        self.spec_drafts.set(stats.spec_draft_tokens)
        self.spec_accepted.set(stats.spec_accepted_tokens)
        self.engine_alive.set(1 if alive else 0)

    def observe_finished(self, out: RequestOutput) -> None:
        """Called once per request that ended without an error: finished, or aborted (a client
        that went away; as in vLLM, its tokens count). A prompt counts once its prefill ran
        (a first token came): an aborted request may never have been scheduled."""
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self._success.labels(self._model_name, c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.last_token_time is not None:
            self.e2e.observe(max(0.0, m.last_token_time - m.arrival_time))
            per_completion = max((len(c.token_ids) for c in out.outputs), default=0)
            if per_completion > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (per_completion - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

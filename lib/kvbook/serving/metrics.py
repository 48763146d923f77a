"""The server's Prometheus metrics (GET /metrics), named like vLLM's with a `kvbook:` prefix.

Each app has its own CollectorRegistry, so several servers in one process (the tests, the book) keep separate
counts. Gauges read the scheduler when scraped; counters and histograms are updated by the request handlers in
the event loop. Token counts include the tokens of requests whose client went away.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# CPU decoding of the full-size model is slower than vLLM on a GPU: its buckets, stretched to tens of seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int],
                 kv_usage: Callable[[], float], kv_bytes: Callable[[], int], model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, read: Callable[[], float]) -> Gauge:
            metric = Gauge(name, doc, list(labels), registry=r)
            metric.labels(**labels).set_function(read)
            return metric

        gauge("kvbook:num_requests_running", "Requests in the running batch (prefilling or decoding).", running)
        gauge("kvbook:num_requests_waiting", "Requests queued for the running batch.", waiting)
        gauge("kvbook:kv_cache_usage_perc",
              "KV-cache usage, 0 to 1: blocks held / pool blocks (paged), running sequences / max_num_seqs "
              "(contiguous).", kv_usage)
        gauge("kvbook:kv_cache_reserved_bytes",
              "KV-cache bytes held by running sequences (paged: their blocks; contiguous: max_cache_len each).",
              kv_bytes)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        self.prompt_tokens = counter("kvbook:prompt_tokens", "Prompt tokens of requests that were prefilled.")
        self.generation_tokens = counter("kvbook:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter("kvbook:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("kvbook:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = counter("kvbook:request_success", "Requests finished, by finish reason.",
                                       ("finished_reason",))
        self.request_rejected = counter("kvbook:request_rejected",
                                        "Requests refused before queueing, by reason (queue_full, invalid, ...).",
                                        ("reason",))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r)

        self.ttft = histogram("kvbook:time_to_first_token_seconds",
                              "From the request's arrival to its first token.", TTFT_BUCKETS)
        self.itl = histogram("kvbook:inter_token_latency_seconds", "Between two tokens of one request.",
                             ITL_BUCKETS)
        self.tpot = histogram("kvbook:request_time_per_output_token_seconds",
                              "A finished request's mean time per output token after the first.", ITL_BUCKETS)
        self.e2e = histogram("kvbook:e2e_request_latency_seconds", "From a request's arrival to its last token.",
                             E2E_BUCKETS)
        self._labels = labels

    def _child(self, metric, **extra):
        return metric.labels(**self._labels, **extra)

    def first_token(self, prompt_tokens: int, cached_tokens: int, ttft_s: float, prefix_caching: bool) -> None:
        self._child(self.prompt_tokens).inc(prompt_tokens)
        self._child(self.generation_tokens).inc()
        self._child(self.ttft).observe(ttft_s)
        if prefix_caching:
            self._child(self.prefix_cache_queries).inc(prompt_tokens)
            self._child(self.prefix_cache_hits).inc(cached_tokens)

    def next_token(self, gap_s: float) -> None:
        self._child(self.generation_tokens).inc()
        self._child(self.itl).observe(gap_s)

    def finished(self, reason: str, e2e_s: float, tpot_s: float | None) -> None:
        self._child(self.request_success, finished_reason=reason).inc()
        self._child(self.e2e).observe(e2e_s)
        if tpot_s is not None:
            self._child(self.tpot).observe(tpot_s)

    def rejected(self, reason: str) -> None:
        self._child(self.request_rejected, reason=reason).inc()

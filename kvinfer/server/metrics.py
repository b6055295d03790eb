"""Prometheus metrics for the server: engine gauges and counters read at scrape time, latency histograms."""
from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvinfer.spec.speculator import acceptance

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector:
    """Reads the engine thread's latest stats snapshot on every scrape, so nothing has to be pushed."""

    def __init__(self, stats: Callable[[], object], model_name: str):
        self._stats = stats
        self._labels = {"model_name": model_name}

    def _gauge(self, name, doc, value):
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name, doc, value):
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self):
        s = self._stats()
        yield self._gauge("kvinfer_num_requests_running", "Sequences in the running batch.", s.running)
        yield self._gauge("kvinfer_num_requests_waiting", "Sequences waiting to be scheduled.", s.waiting)
        yield self._gauge("kvinfer_kv_blocks_used", "KV cache blocks (or slots) in use.", s.kv_blocks_used)
        yield self._gauge("kvinfer_kv_blocks_total", "KV cache blocks (or slots) reserved at start-up.",
                          s.kv_blocks_total)
        yield self._gauge("kvinfer_kv_cache_usage_ratio", "Fraction of KV blocks in use.",
                          s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield self._gauge("kvinfer_prefix_cache_hit_rate", "Prefix-cache hits / full prompt blocks looked up.",
                          s.prefix_cache_hit_rate)
        yield self._counter("kvinfer_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.",
                            s.prefix_cache_queries)
        yield self._counter("kvinfer_prefix_cache_hits", "Prompt blocks served from the prefix cache.",
                            s.prefix_cache_hits)
        yield self._counter("kvinfer_num_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions)
        yield self._counter("kvinfer_prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens)
        yield self._counter("kvinfer_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield self._counter("kvinfer_engine_steps", "Engine steps run.", s.steps)
        g = GaugeMetricFamily("kvinfer_kv_cache_bytes_per_token", "KV cache bytes per token (K and V, all layers), "
                              "by the cache's element type.", labels=[*self._labels, "kv_dtype"])
        g.add_metric([*self._labels.values(), s.kv_dtype], s.kv_bytes_per_token)
        yield g
        yield self._counter("kvinfer_spec_decode_num_drafts", "Verifications of speculative proposals.",
                            s.spec_drafts)
        yield self._counter("kvinfer_spec_decode_num_draft_tokens", "Proposed tokens verified.", s.spec_draft_tokens)
        yield self._counter("kvinfer_spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                            s.spec_accepted_tokens)
        rate, length = acceptance(s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens)
        yield self._gauge("kvinfer_spec_decode_acceptance_rate", "Accepted / proposed tokens since start-up.", rate)
        yield self._gauge("kvinfer_spec_decode_mean_accepted_length",
                          "Tokens emitted per verification (accepted proposals + the target's own).", length)


class _StoreCollector(_EngineCollector):
    def __init__(self, store, model_name: str):
        self.store = store
        self._labels = {"model_name": model_name}

    def collect(self):
        st = self.store
        yield self._gauge("kvinfer_responses_stored", "Responses kept for previous_response_id and GET.", len(st.items))
        yield self._gauge("kvinfer_responses_store_bytes", "Bytes (as UTF-8 JSON) the stored responses hold.", st.bytes)
        yield self._gauge("kvinfer_responses_store_limit_bytes", "The store's budget (--responses-store-size).",
                          st.max_bytes)
        yield self._counter("kvinfer_responses_evicted", "Stored responses dropped, oldest first, to stay within "
                                                          "the budget.", st.evicted)


class ServerMetrics:
    """One registry per server, so two servers in a process (tests, benchmarks) never share counters."""

    def __init__(self, stats: Callable[[], object], model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("kvinfer_time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("kvinfer_inter_token_latency_seconds", "Time between consecutive tokens of a sample.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._requests = Counter("kvinfer_request_success", "Requests finished, by finish reason.",
                                 labels + ["finished_reason"], registry=self.registry)
        self._model = model_name

    def watch_store(self, store) -> None:
        """Report a Responses store's size, budget and evictions at scrape time."""
        self.registry.register(_StoreCollector(store, self._model))

    access_log = None  # a logging.Logger: one line per finished request (`kvinfer serve` without --quiet)

    def request_done(self, out) -> None:
        for o in out.outputs:
            self.request_finished(o.finish_reason)
        if self.access_log is not None:
            from kvinfer.server.activity import access_line

            self.access_log.info(access_line(out))

    def request_finished(self, reason: Optional[str]) -> None:
        self._requests.labels(self._model, reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyTracker:
    """Turns one request's stream of outputs into TTFT and inter-token latency observations."""

    __slots__ = ("_metrics", "_last")

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self._last: dict[str, float] = {}  # request id -> engine time of its last token

    def observe(self, out) -> None:
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        prev = self._last.get(out.request_id)
        if prev is None:
            self._metrics.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        else:
            new = len(out.outputs[0].delta_token_ids) if out.outputs else 0
            if new and m.last_token_time > prev:
                gap = (m.last_token_time - prev) / new
                for _ in range(new):
                    self._metrics.itl.observe(gap)
        self._last[out.request_id] = m.last_token_time
        if out.finished:
            self._metrics.request_done(out)

"""/metrics counters of the KV tiers below the pool (kv/tiers.py): per tier hits, misses, bytes in/out, evictions,
errors, read at scrape time."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

DOCS = {"hits": "Blocks restored from the tier into the pool.",
        "misses": "Blocks looked up in the tier and not found or not usable.",
        "bytes_in": "Bytes restored from the tier.", "bytes_out": "Bytes written to the tier.",
        "evictions": "Blocks the tier dropped to stay within its budget.",
        "errors": "Corrupt, truncated or foreign blocks, failed writes, an unreachable server.",
        "slow_skips": "Lookups that passed the tier by: fetching had measured slower than recomputing."}


class TierCollector:
    """kvinfer_kv_tier_<counter>{tier=...} for each tier of the engine (nothing when it has none)."""

    def __init__(self, engine, model_name: str):
        self._engine = engine  # the LLMEngine: its kv_tiers is set at start-up and never replaced while serving
        self._model = model_name

    def collect(self):
        tiers = getattr(self._engine, "kv_tiers", None)
        if tiers is None:
            return
        counters = tiers.counters()
        for field, doc in DOCS.items():
            c = CounterMetricFamily(f"kvinfer_kv_tier_{field}", doc, labels=["model_name", "tier"])
            for name, stats in counters.items():
                c.add_metric([self._model, name], stats[field])
            yield c
        held = {"blocks": GaugeMetricFamily("kvinfer_kv_tier_blocks", "Blocks the tier holds now (RAM; disk: files "
                                            "in its directory).", labels=["model_name", "tier"]),
                "bytes": GaugeMetricFamily("kvinfer_kv_tier_bytes", "Bytes the tier holds now (RAM; disk: files "
                                           "in its directory).", labels=["model_name", "tier"])}
        for t in tiers.snapshot():
            for k, fam in held.items():
                if t[k] is not None:
                    fam.add_metric([self._model, t["name"]], t[k])
        yield from held.values()
        g = GaugeMetricFamily("kvinfer_kv_tier_dropped_writes", "Blocks not written through to the persistent "
                              "tiers because the writer was behind.", labels=["model_name"])
        g.add_metric([self._model], tiers.dropped_writes)
        yield g
        q = GaugeMetricFamily("kvinfer_kv_tier_queued_bytes", "Bytes of computed blocks waiting to be written "
                              "through to the persistent tiers.", labels=["model_name"])
        q.add_metric([self._model], tiers.queued_bytes)
        yield q


def register_tier_metrics(registry, engine, model_name: str) -> None:
    registry.register(TierCollector(engine, model_name))

"""Stored Responses are counted in bytes (metadata, schemas and tools included) against one budget, the oldest
dropped first, and /metrics says so (issue 46, item 3)."""
from __future__ import annotations

import httpx

from server_helpers import engine_config, metric, start_server


def test_store_counts_metadata_bytes_and_evicts_the_oldest():
    s = start_server(engine_config(), responses_store_bytes=1 << 20)
    try:
        big = {f"k{i}": "v" * 12_500 for i in range(16)}  # 200 KB of metadata, which the prompt does not see
        ids = []
        for _ in range(8):
            r = httpx.post(s.url + "/v1/responses", timeout=120, json={
                "input": "hi", "max_output_tokens": 1, "metadata": big})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        text = httpx.get(s.url + "/metrics").text
        stored, used = metric(text, "kvinfer_responses_stored"), metric(text, "kvinfer_responses_store_bytes")
        assert metric(text, "kvinfer_responses_store_limit_bytes") == 1 << 20
        assert 0 < used <= 1 << 20 and 0 < stored < 8, (stored, used)
        assert metric(text, "kvinfer_responses_evicted_total") == 8 - stored
        # oldest first: the newest are kept, the first ones are gone (404 naming the budget)
        assert httpx.get(f"{s.url}/v1/responses/{ids[-1]}").status_code == 200
        gone = httpx.get(f"{s.url}/v1/responses/{ids[0]}")
        assert gone.status_code == 404 and "--responses-store-size" in gone.json()["error"]["message"]
    finally:
        s.stop()

"""Helpers for the server tests: start a real uvicorn server on a free localhost port in a thread."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvinfer.config import EngineConfig
from kvinfer.engine.async_engine import AsyncLLMEngine
from kvinfer.server.app import ServerThread, create_app

# The built-in model by default; KVINFER_TEST_SERVER_MODEL points the server tests at another one.
TEST_MODEL = os.environ.get("KVINFER_TEST_SERVER_MODEL") or None


def engine_config(**kw) -> EngineConfig:
    base = dict(model=TEST_MODEL, kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=64)
    base.update(kw)
    return EngineConfig(**base)


@dataclass
class RunningServer:
    engine: AsyncLLMEngine
    server: ServerThread
    model_name: str
    owns_engine: bool = True

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        if self.owns_engine:
            self.engine.shutdown()


def start_server(config: Optional[EngineConfig] = None, engine: Optional[AsyncLLMEngine] = None,
                 max_queue: int = 256, **app_kwargs) -> RunningServer:
    """A server over a new engine (from `config`) or over an existing, shared one."""
    owns = engine is None
    if engine is None:
        engine = AsyncLLMEngine.from_config(config or engine_config(), max_queue=max_queue)
    app = create_app(engine, **app_kwargs)
    name = app.state.server.model_name
    return RunningServer(engine, ServerThread(app).start(), name, owns)


def kv_blocks_used(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("kvinfer_kv_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("kvinfer_kv_blocks_used missing from /metrics")


def metric(metrics_text: str, name: str) -> float:
    """Sum of every sample of `name` (any labels)."""
    total, found = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise AssertionError(f"{name} missing from /metrics")
    return total


def assert_error_shape(resp, status: int, param: Optional[str] = "__any__") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param != "__any__":
        assert err["param"] == param, body
    return err

"""The app's process-level behaviour, in-process with a stand-in engine: a dead engine stops
the server, idle connections are closed, internal errors stay in the log."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import uvicorn
from starlette.testclient import TestClient

from jaxllm.server import app as app_module
from jaxllm.server.app import build_app, uvicorn_config
from jaxllm.server.testing import free_port


def stand_in_serving():
    engine = SimpleNamespace(is_healthy=True)
    return SimpleNamespace(engine=engine, tokenizer=None, models=lambda: 1 / 0, max_model_len=128,
                           adapters=None)


def test_a_dead_engine_stops_the_server(monkeypatch):
    monkeypatch.setattr(app_module, "_WATCHDOG_PERIOD_S", 0.01)
    serving, stopped = stand_in_serving(), threading.Event()
    app = build_app(serving, on_engine_dead=stopped.set)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        assert not stopped.wait(0.1)
        serving.engine.is_healthy = False
        assert stopped.wait(5)
        assert http.get("/health").status_code == 503


def test_internal_errors_carry_no_internals():
    app = build_app(stand_in_serving(), on_engine_dead=lambda: None)
    with TestClient(app, raise_server_exceptions=False) as http:
        response = http.get("/v1/models")  # models() divides by zero
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == 500 and "division" not in error["message"]


def test_a_connection_that_sends_nothing_is_closed():
    app = build_app(stand_in_serving(), on_engine_dead=lambda: None)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning",
                                           timeout_keep_alive=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            start = time.monotonic()
            assert idle.recv(1) == b""  # closed by the server
            assert time.monotonic() - start < 5
    finally:
        server.should_exit = True
        thread.join(10)


def test_one_model_by_id_and_tokenizer_info(tiny_tokenizer):
    from functools import partial

    from jaxllm.engine.input_processor import InputProcessor
    from jaxllm.server.protocol import ModelCard, ModelList
    from jaxllm.server.serving import OpenAIServing

    serving = SimpleNamespace(engine=SimpleNamespace(is_healthy=True), max_model_len=128,
                              tokenizer=tiny_tokenizer,
                              chat_template=None, adapters=None,
                              processor=InputProcessor(tiny_tokenizer, 128, 384),
                              models=lambda: ModelList([ModelCard("tiny", 128),
                                                        ModelCard("org/tiny-2", 128)]))
    for name in ("model", "tokenizer_info", "require_tokenizer"):
        setattr(serving, name, partial(getattr(OpenAIServing, name), serving))
    with TestClient(build_app(serving, on_engine_dead=lambda: None)) as http:
        assert http.get("/tokenizer_info").status_code == 404  # off unless asked, as vLLM
        assert http.get("/v1/models/org/tiny-2").json()["id"] == "org/tiny-2"
        missing = http.get("/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `other` does not exist."
    app = build_app(serving, on_engine_dead=lambda: None, enable_tokenizer_info_endpoint=True)
    with TestClient(app) as http:
        info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tiny_tokenizer).__name__
    assert info["vocab_size"] == len(tiny_tokenizer) and info["model_max_length"] == 128
    assert info["eos_token"] == tiny_tokenizer.eos_token

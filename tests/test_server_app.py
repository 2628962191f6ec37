"""The app's process-level behaviour, in-process with a stand-in engine: a dead engine stops
the server, idle connections are closed, internal errors stay in the log."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
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


@contextlib.contextmanager
def running(app, **config):
    """The app under a real uvicorn server on a thread; yields its port."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, log_level="warning",
                                           **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_connection_that_sends_nothing_is_closed():
    app = build_app(stand_in_serving(), on_engine_dead=lambda: None)
    with running(app, timeout_keep_alive=1) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            start = time.monotonic()
            assert idle.recv(1) == b""  # closed by the server
            assert time.monotonic() - start < 5


def detokenizing_serving():
    """A stand-in that answers /detokenize."""
    async def off_loop(function, *args):
        return function(*args)
    serving = stand_in_serving()
    serving.check_model = serving.require_tokenizer = lambda _: None
    serving.off_loop = off_loop
    serving.processor = SimpleNamespace(detokenize=lambda ids: " ".join(map(str, ids)))
    return serving


def trickle(port: int, head: bytes, rest: bytes, period: float = 0.1) -> tuple[bytes, float]:
    """Sends `head`, then `rest` a byte every `period` seconds, until the server answers or
    closes; returns what it answered and when it closed (seconds after the head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=period) as conn:
        conn.sendall(head)
        start, answer = time.monotonic(), b""
        for byte in rest:
            with contextlib.suppress(OSError):
                conn.sendall(bytes([byte]))
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                break
            if not chunk:
                break
            answer += chunk
        return answer, time.monotonic() - start


def json_post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n"


def test_slow_senders_are_cut_off_and_the_server_goes_on():
    app = build_app(detokenizing_serving(), on_engine_dead=lambda: None, request_body_timeout=1)
    with running(app, request_header_timeout=1, request_body_timeout=1) as port:
        url = f"http://127.0.0.1:{port}"
        body = b'{"tokens": [1, 2, 3]}' + b" " * 200
        # A body a byte every 0.1 s: 408 in OpenAI's shape after 1 s, and the connection closes.
        answer, closed_after = trickle(port, json_post("/detokenize", body), body)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
        assert json.loads(payload)["error"] == {
            "message": "The request body did not arrive within 1 seconds.",
            "type": "RequestTimeoutError", "param": None, "code": 408}
        assert 0.9 <= closed_after < 3
        # A head a byte every 0.1 s: closed after 1 s (each byte used to restart no timer).
        answer, closed_after = trickle(port, b"GET /health HTTP/1.1\r\n", b"X-Slow: 1\r\n" * 30)
        assert answer == b"" and 0.9 <= closed_after < 3
        # A body nobody reads, still trickling after its response: closed after 1 s.
        answer, closed_after = trickle(port, json_post("/health", body).replace(b"POST", b"GET"),
                                       body)
        assert answer.startswith(b"HTTP/1.1 200 ") and 0.9 <= closed_after < 3
        # Normal requests, one with its body in two parts within the limit, are served.
        assert httpx.get(url + "/health").status_code == 200
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(json_post("/detokenize", body) + body[:10])
            time.sleep(0.5)
            conn.sendall(body[10:])
            answer = conn.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"prompt":"1 2 3"}')
        assert httpx.post(url + "/detokenize", json={"tokens": [4]}).json() == {"prompt": "4"}


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

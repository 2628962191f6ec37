"""RemoteServer: a real `python -m jaxllm.server` process on loopback, for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """Starts the server, waits (bounded) until /health answers 200; `close()` kills it."""

    def __init__(self, model: str | None, args: list[str], api_key: str | None = None,
                 startup_timeout: float = 300.0) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        env.pop("JAXLLM_API_KEY", None)
        cmd = [sys.executable, "-m", "jaxllm.server", *([model] if model else []),  # None: the default
               "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="jaxllm-server-", suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_until_healthy(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-num_chars:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # openai is a test dependency: benchmarks (serve_sweep.py) use this class without it.
    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY",
                             max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs):
        import openai
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY",
                                  max_retries=0, timeout=120, **kwargs)

    def wait_idle(self, timeout: float = 30.0, kv_free: bool = True) -> dict[str, float]:
        """Waits until nothing runs or waits (and, with kv_free, no KV block is held); returns
        the metrics then, or fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            metrics = self.metrics()
            if (metrics["jaxllm:num_requests_running"] == metrics["jaxllm:num_requests_waiting"]
                    == 0 and (not kv_free or metrics["jaxllm:kv_cache_usage_perc"] == 0)):
                return metrics
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: {self.metrics()}")

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: `jaxllm:name` (or `name_bucket{le}`) -> value."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.split("{")[0]] = float(value)
        return values

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.log.close()

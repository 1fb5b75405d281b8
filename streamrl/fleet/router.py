"""Launch and drive the real sglang-router (PyPI `sglang-router`, a Rust binary).

    router = Router.start(["http://127.0.0.1:30001", ...], log_path=run_dir / "router.log")
    router.url                     # POST /generate here
    router.add_worker(url); router.remove_worker(url); router.workers()
    router.stop()

Behaviour of sglang-router 0.3.2 as observed on loopback (docs/engine.md has
the full list): `POST /workers` and `DELETE /workers/{id}` answer 202 and do
the work in the background, so `add_worker` / `remove_worker` wait until
`GET /workers` shows the change; a worker registers only after its `/health`,
`/server_info` and `/model_info` answer; pause, continue, abort and weight
calls are not routed (404) and go to each engine directly.

The router's Prometheus exporter binds 0.0.0.0:29000 unless told otherwise,
so every router gets a loopback host and a free port. Calls here are
synchronous (launch-time code); wrap them in a thread from async code.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from streamrl.process import ChildProcess, ProcessDied, free_port, spawn, wait_http_ready

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")
PORT_ATTEMPTS = 3
PORT_TAKEN = "Address already in use"
"""What sglang-router prints when a port it was given is bound by another process."""


class RouterError(RuntimeError):
    pass


def _normal(url: str) -> str:
    return url.rstrip("/")


class Router:
    """A running sglang-router process and its worker list."""

    def __init__(self, process: ChildProcess, url: str, prometheus_port: int) -> None:
        self.process = process
        self.url = url
        self.prometheus_port = prometheus_port
        self._http = httpx.Client(base_url=url, timeout=30.0)

    @classmethod
    def start(
        cls,
        worker_urls: Sequence[str],
        *,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "cache_aware",
        prometheus_port: int | None = None,
        extra_args: Sequence[str] = (),
        timeout_s: float = 120.0,
    ) -> Router:
        """Start the router and return once it answers and every worker is registered and
        healthy. Ports left to it are picked free (`free_port`), and picked again, up to
        `PORT_ATTEMPTS` times, when the router exits because one was taken before it bound
        it (another process can bind a port between the pick and the router's start)."""
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        attempt = 1
        while True:
            logged = log_path.stat().st_size if log_path.exists() else 0
            try:
                return cls._start_once(
                    worker_urls, log_path=log_path, host=host,
                    port=port or free_port(host),
                    prometheus_port=prometheus_port or free_port("127.0.0.1"),
                    policy=policy, extra_args=extra_args, timeout_s=timeout_s,
                )  # fmt: skip
            except ProcessDied:
                chosen_here = port is None or prometheus_port is None
                this_start = log_path.read_bytes()[logged:].decode(errors="replace")
                if not (chosen_here and PORT_TAKEN in this_start) or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("sglang-router found its port taken; starting it on other ports")
            attempt += 1

    @classmethod
    def _start_once(
        cls,
        worker_urls: Sequence[str],
        *,
        log_path: Path,
        host: str,
        port: int,
        prometheus_port: int,
        policy: str,
        extra_args: Sequence[str],
        timeout_s: float,
    ) -> Router:
        argv = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            host,
            "--port",
            str(port),
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prometheus_port),
            *extra_args,
        ]
        if worker_urls:
            argv += ["--worker-urls", *map(_normal, worker_urls)]
        process = spawn("sglang-router", argv, log_path=log_path)
        router = cls(process, f"http://{host}:{port}", prometheus_port)
        try:
            wait_http_ready(router.url, timeout_s=timeout_s, process=process, path="/workers")
            router.wait_for_workers(worker_urls, timeout_s=timeout_s)
        except BaseException:
            router.stop()
            raise
        return router

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (then SIGKILL after `timeout_s`); returns the exit code."""
        self._http.close()
        return self.process.stop(timeout_s)

    def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RouterError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise RouterError(f"{self.url}{path}: HTTP {response.status_code}: {response.text}")
        return response

    def workers(self) -> list[dict]:
        """`GET /workers`: one dict per worker (`id`, `url`, `is_healthy`, `load`, ...)."""
        return self._call("GET", "/workers").json().get("workers", [])

    def worker_urls(self, *, healthy_only: bool = True) -> list[str]:
        return [
            _normal(w["url"]) for w in self.workers() if w.get("is_healthy") or not healthy_only
        ]

    def _wait(self, is_done, what: str, timeout_s: float, *, healthy_only: bool = True) -> None:
        """Poll `GET /workers` (growing interval) until `is_done(urls)`."""
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if not self.process.is_alive():
                raise ProcessDied(
                    f"sglang-router exited with code {self.process.poll()} while waiting for "
                    f"{what}; last lines of {self.process.log_path}:\n{self.process.log_tail()}"
                )
            urls = set(self.worker_urls(healthy_only=healthy_only))
            if is_done(urls):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router {self.url}: {what} not done after {timeout_s:.0f} s "
                    f"(healthy workers: {sorted(urls)}); see {self.process.log_path}"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)

    def wait_for_workers(self, urls: Sequence[str], *, timeout_s: float = 120.0) -> None:
        """Return once every URL is registered and healthy."""
        wanted = {_normal(url) for url in urls}
        self._wait(lambda present: wanted <= present, f"registering {sorted(wanted)}", timeout_s)

    def add_worker(self, url: str, *, timeout_s: float = 120.0) -> None:
        """Register a worker (its /health must answer 200) and wait until the router uses it."""
        self._call("POST", "/workers", json={"url": _normal(url)})
        self.wait_for_workers([url], timeout_s=timeout_s)

    def remove_worker(self, url: str, *, timeout_s: float = 60.0) -> None:
        """Deregister a worker (found by URL) and wait until it is gone; unknown URLs are an error."""
        url = _normal(url)
        ids = [w["id"] for w in self.workers() if _normal(w["url"]) == url]
        if not ids:
            raise RouterError(f"router {self.url} has no worker {url}")
        for worker_id in ids:
            self._call("DELETE", f"/workers/{worker_id}")
        self._wait(
            lambda present: url not in present, f"removing {url}", timeout_s, healthy_only=False
        )

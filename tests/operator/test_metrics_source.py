"""Scraping data-plane pods: real HTTP servers serving what the data plane's own metrics registry renders."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from modelfleet.dataplane.server.metrics import ServerMetrics
from modelfleet.operator.metrics_source import ScrapeError, parse_metrics, pod_address, scrape_pods
from modelfleet.operator.reconcile.windows import windows


class MetricsServer:
    """A tiny /metrics endpoint on 127.0.0.1 over a real `ServerMetrics` registry."""

    def __init__(self) -> None:
        self.metrics = ServerMetrics()
        metrics = self.metrics

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = metrics.render() if self.path == "/metrics" else b""
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def serve(self, model: str, version: str, *, ok: int, failed: int = 0, seconds: float = 0.2) -> None:
        for status, count in (("200", ok), ("500", failed)):
            for _ in range(count):
                self.metrics.requests.labels(model, version, status).inc()
                self.metrics.e2e.labels(model, version).observe(seconds)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def servers() -> Iterator[list[MetricsServer]]:
    running = [MetricsServer(), MetricsServer()]
    yield running
    for server in running:
        server.close()


def pod(name: str, port: int, phase: str = "Running", ip: str = "127.0.0.1") -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "server", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": phase, "podIP": ip},
    }


def test_counters_of_the_model_are_read_from_the_data_plane_exposition():
    metrics = ServerMetrics()
    metrics.requests.labels("chat", "v2", "200").inc(7)
    metrics.requests.labels("chat", "v2", "503").inc(2)
    metrics.requests.labels("other", "v9", "200").inc(100)  # another model's series
    metrics.e2e.labels("chat", "v2").observe(0.3)
    parsed = parse_metrics(metrics.render().decode(), "chat")
    assert set(parsed) == {"v2"}
    assert parsed["v2"].statuses == {"200": 7.0, "503": 2.0}
    assert parsed["v2"].buckets["0.25"] == 0.0 and parsed["v2"].buckets["0.5"] == 1.0
    assert parsed["v2"].buckets["+Inf"] == 1.0


def test_every_running_pod_is_scraped_and_windows_sum_them(servers):
    a, b = servers
    a.serve("chat", "v1", ok=10)
    b.serve("chat", "v2", ok=3)
    pods = [pod("chat-a", a.port), pod("chat-b", b.port), pod("chat-pending", b.port, phase="Pending")]
    first = scrape_pods(pods, "chat", default_port=8000)
    assert set(first) == {"chat-a", "chat-b"}

    a.serve("chat", "v2", ok=4, failed=1, seconds=3.0)
    b.serve("chat", "v2", ok=15, seconds=0.2)
    later = windows(first, scrape_pods(pods, "chat", default_port=8000))
    assert later["v2"].statuses == {"200": 19, "500": 1} and later["v2"].errors == 1
    assert later["v1"].requests == 0
    # 20 observations: 15 in (0.1, 0.25], 5 in (2.5, 5]; the 19th lies in the slow bucket.
    assert later["v2"].p95_seconds == pytest.approx(2.5 + 2.5 * (19 - 15) / 5)


def test_a_silent_pod_is_left_out_and_no_pod_at_all_is_an_error(servers):
    a, _ = servers
    a.serve("chat", "v1", ok=1)
    dead = MetricsServer()
    dead.close()
    sample = scrape_pods(
        [pod("chat-a", a.port), pod("chat-dead", dead.port)], "chat", default_port=8000, timeout=2
    )
    assert set(sample) == {"chat-a"}
    with pytest.raises(ScrapeError, match=r"no data-plane pod of chat answered /metrics \(chat-dead: "):
        scrape_pods([pod("chat-dead", dead.port)], "chat", default_port=8000, timeout=2)
    with pytest.raises(ScrapeError, match="no running data-plane pod of chat"):
        scrape_pods([pod("chat-x", a.port, phase="Pending")], "chat", default_port=8000)


def test_pod_addresses_use_the_named_port_and_bracket_ipv6():
    assert pod_address(pod("a", 9000), 8000) == "http://127.0.0.1:9000"
    assert pod_address(pod("a", 9000, ip="fd00::5"), 8000) == "http://[fd00::5]:9000"
    bare = {
        "metadata": {"name": "a"},
        "spec": {"containers": [{}]},
        "status": {"phase": "Running", "podIP": "10.0.0.9"},
    }
    assert pod_address(bare, 8000) == "http://10.0.0.9:8000"

"""Control-plane benchmark: requests/s and latency of a model GET and a traffic POST with 50 concurrent
clients, on SQLite and on PostgreSQL, against `GET /health` (no database, no auth) as the baseline of
the same run. Traffic POSTs are measured twice: all clients on one model (most are refused with 409 by
the optimistic lock, as they should be) and spread over one model per client. The server runs in its
own process (uvicorn, one worker); prints one JSON line.

    python bench/controlplane.py [--clients 50] [--requests 2000] [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ADMIN_KEY = "bench-admin-key-0123456789abcdef"
PEPPER = "bench-pepper-0123456789abcdef"


def _serve(database_url: str, port: int) -> None:
    import uvicorn
    from modelfleet.controlplane.cluster import NoCluster
    from modelfleet.controlplane.core.config import Settings
    from modelfleet.controlplane.main import create_app

    settings = Settings(database_url=database_url, admin_key=ADMIN_KEY, key_pepper=PEPPER, cluster="none")
    uvicorn.run(create_app(settings, cluster=NoCluster()), host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(base: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the control plane at {base} did not become ready in {timeout_s:.0f}s")


def _setup(base: str, models: int) -> tuple[list[str], dict[str, str]]:
    """A tenant, a key, and `models` models with versions v1 and v2; the models' URLs and the key."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base, timeout=60) as client:
        client.post("/api/v1/tenants", json={"name": "bench"}, headers=admin).raise_for_status()
        key = client.post("/api/v1/tenants/bench/keys", json={}, headers=admin).json()["key"]
        headers = {"Authorization": f"Bearer {key}"}
        urls = []
        for index in range(models):
            body = {"name": f"chat-{index}"}
            client.post("/api/v1/tenants/bench/models", json=body, headers=headers).raise_for_status()
            url = f"/api/v1/tenants/bench/models/chat-{index}"
            for version in ("v1", "v2"):
                body = {"version": version, "source": {"uri": f"pvc://models/chat/{version}"}}
                client.post(f"{url}/versions", json=body, headers=headers).raise_for_status()
            urls.append(url)
        return urls, headers


async def _load(base: str, clients: int, total: int, make_request) -> dict[str, Any]:
    """`total` requests spread over `clients` concurrent connections; latency percentiles and rate."""
    latencies: list[float] = []
    statuses: dict[int | str, int] = {}
    counter = iter(range(total))

    async def worker(client: httpx.AsyncClient) -> None:
        for index in counter:
            started = time.perf_counter()
            try:
                status = (await make_request(client, index)).status_code
            except httpx.TransportError as error:  # counted, so a dropped connection shows in the report
                status = type(error).__name__
            latencies.append(time.perf_counter() - started)
            statuses[status] = statuses.get(status, 0) + 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "requests_per_s": round(total / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
        "statuses": {str(code): count for code, count in sorted(statuses.items(), key=str)},
    }


def _run_backend(database_url: str, clients: int, total: int) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(database_url, port), daemon=True
    )
    server.start()
    try:
        _wait_ready(base)
        models, headers = _setup(base, clients)
        splits = [
            [{"version": "v1", "weight": 100 - w}, {"version": "v2", "weight": w}] for w in (10, 50, 90)
        ]

        def health(client, _):
            return client.get("/health")

        def get_model(client, _):
            return client.get(models[0], headers=headers)

        def post_traffic(client, index, model=None):
            body = {"traffic": splits[index % len(splits)], "reason": "bench"}
            return client.post(f"{model or models[0]}/traffic", json=body, headers=headers)

        def post_traffic_spread(client, index):
            return post_traffic(client, index, models[index % len(models)])

        cases = {
            "health_baseline": health,  # no auth, no database: the server and client overhead
            "get_model": get_model,
            "post_traffic": post_traffic,  # every client on one model: optimistic locking refuses the losers
            "post_traffic_spread": post_traffic_spread,  # one model per client: writes that rarely collide
        }
        results = {name: asyncio.run(_load(base, clients, total, request)) for name, request in cases.items()}
        return results
    finally:
        server.terminate()
        server.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement")
    parser.add_argument("--backends", default="sqlite,postgresql")
    args = parser.parse_args(argv)

    # The throwaway PostgreSQL server of the control-plane tests.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "controlplane"))
    import pgserver

    report: dict[str, Any] = {"bench": "controlplane", "clients": args.clients, "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="modelfleet-bench-") as folder:
        for backend in args.backends.split(","):
            if backend == "sqlite":
                report[backend] = _run_backend(
                    f"sqlite:///{Path(folder)}/bench.db", args.clients, args.requests
                )
            elif backend == "postgresql":
                reason = pgserver.missing_reason()
                if reason:
                    report[backend] = {"skipped": reason}
                    continue
                server = pgserver.PostgresServer()
                try:
                    report[backend] = _run_backend(
                        server.create_database("bench"), args.clients, args.requests
                    )
                finally:
                    server.close()
            else:
                print(
                    f"error: --backends: unknown backend {backend!r}; use sqlite and/or postgresql",
                    file=sys.stderr,
                )
                return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

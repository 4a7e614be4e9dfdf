"""The kopf peering pre-flight: a missing peering CRD or object is a WARNING and a /healthz line, never
a silent pause. Against kmock: the check alone, then kopf itself with our handlers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import socket
import time

import aiohttp
import kopf
import modelfleet.operator.handlers  # noqa: F401  (registers the handlers, before the pre-flight's)
import pytest
import test_operator_kmock
from kubernetes import client
from modelfleet.operator import preflight
from modelfleet.operator.kube import Kube
from modelfleet.operator.preflight import PeeringCheck, PeeringObject, check_peering, peering_objects
from test_handlers_kmock import JOBS, NS, ApplyingEmulator, obj
from test_operator_kmock import VERBS, eventually

pytestmark = pytest.mark.kmock(cls=ApplyingEmulator)
emulated_cluster = test_operator_kmock.emulated_cluster  # the fixture: kopf against kmock
OBJECT = PeeringObject("modelfleet", NS)
JOB = "chat-v1-convert-nvidia-h100-torch-bf16"


@pytest.fixture()
def api(kmock) -> Kube:
    config = client.Configuration()
    config.host = str(kmock.url).rstrip("/")
    return Kube(client.ApiClient(config))


def serve_peering_crd(kmock, with_object: bool, clusterwide: bool = False) -> None:
    kind = "ClusterKopfPeering" if clusterwide else "KopfPeering"
    resource = f"kopf.dev/v1/{kind.lower()}s"
    kmock.resources[resource] = {"kind": kind, "namespaced": not clusterwide, "verbs": VERBS}
    if with_object:
        meta = {"name": "modelfleet", "resourceVersion": "1", **({} if clusterwide else {"namespace": NS})}
        kmock.objects[resource, None if clusterwide else NS, "modelfleet"] = {
            "apiVersion": "kopf.dev/v1",
            "kind": kind,
            "metadata": meta,
        }


def test_the_objects_kopf_waits_for():
    assert peering_objects("mf", ["a", "b"], clusterwide=False) == [
        PeeringObject("mf", "a"),
        PeeringObject("mf", "b"),
    ]
    assert peering_objects("mf", [], clusterwide=True) == [PeeringObject("mf")]
    assert (
        str(PeeringObject("mf")) == "ClusterKopfPeering mf" and str(OBJECT) == f"KopfPeering {NS}/modelfleet"
    )
    assert PeeringObject("mf").path("kopf.dev/v1") == "/apis/kopf.dev/v1/clusterkopfpeerings/mf"
    assert peering_objects("mf", ["team-*"], clusterwide=False) == []  # a pattern names no object


async def test_missing_crd_names_the_kind_the_object_and_both_ways_out(kmock, api):
    [problem] = await asyncio.to_thread(check_peering, api, [OBJECT])
    assert "the KopfPeering CRD is not installed" in problem
    assert "kopfpeerings.kopf.dev" in problem and f"KopfPeering {NS}/modelfleet" in problem
    assert "crds/kopf-peering.yaml" in problem and "--standalone" in problem
    assert f"kind KopfPeering, name modelfleet, namespace {NS}" in problem


async def test_missing_object_is_named(kmock, api):
    serve_peering_crd(kmock, with_object=False)
    [problem] = await asyncio.to_thread(check_peering, api, [OBJECT])
    assert problem.startswith(f"kopf peering: KopfPeering {NS}/modelfleet does not exist")
    assert "MODELFLEET_OPERATOR_PEERING" in problem and "--standalone" in problem


async def test_present_object_is_no_problem(kmock, api):
    serve_peering_crd(kmock, with_object=True)
    assert await asyncio.to_thread(check_peering, api, [OBJECT]) == []


async def test_an_unreadable_peering_is_reported_not_raised(kmock, api):
    serve_peering_crd(kmock, with_object=False)
    kmock[re.compile(r".*/kopfpeerings/modelfleet$")] << 403 << {"kind": "Status", "message": "forbidden"}
    [problem] = await asyncio.to_thread(check_peering, api, [OBJECT])
    assert problem.startswith(f"kopf peering: cannot read KopfPeering {NS}/modelfleet (forbidden)")


async def test_the_check_warns_once_rechecks_for_the_probe_and_says_when_found(kmock, api, caplog):
    check = PeeringCheck(api, [OBJECT])
    assert check.report() == "not checked yet"
    with caplog.at_level(logging.INFO, logger=preflight.__name__):
        await asyncio.to_thread(check.run)
        await asyncio.to_thread(check.report)  # still missing: no second warning
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "the KopfPeering CRD is not installed" in warnings[0].getMessage()
        serve_peering_crd(kmock, with_object=True)
        assert await asyncio.to_thread(check.report) == f"ok: KopfPeering {NS}/modelfleet"
    assert caplog.records[-1].levelno == logging.INFO and "found" in caplog.records[-1].getMessage()
    before = len(list(kmock))
    await asyncio.to_thread(check.report)  # found: the probe costs no API call any more
    assert len(list(kmock)) == before


async def test_the_probe_never_waits_long_for_the_api(monkeypatch):
    class SlowCheck(PeeringCheck):
        def run(self) -> list[str]:
            time.sleep(0.5)  # an API server that answers slowly
            return super().run()

    check = SlowCheck(None, [OBJECT])  # type: ignore[arg-type]
    check.problems = ["kopf peering: KopfPeering team-a/modelfleet does not exist"]
    monkeypatch.setattr(preflight, "check_peering", lambda kube, objects: [])
    monkeypatch.setattr(preflight, "PROBE_SECONDS", 0.05)
    memo = kopf.Memo(peering_check=check)
    assert await preflight.peering_probe(memo=memo) == check.problems[0]  # the last word, at once
    assert await preflight.peering_probe(memo=kopf.Memo()) == "standalone"
    await asyncio.sleep(0.6)  # the re-check went on in the background
    assert check.last_report() == f"ok: KopfPeering {NS}/modelfleet"


def test_the_command_gives_the_pre_flight_its_namespaces_and_peering(monkeypatch):
    """`modelfleet operator -n team-a`: kopf runs with our peering name, and the namespaces in its memo
    (kopf gives handlers no other way to learn them)."""
    from modelfleet.operator import main
    from modelfleet.operator.settings import get_settings

    ran = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: ran.update(kwargs))
    monkeypatch.setenv("MODELFLEET_OPERATOR_METRICS_PORT", "0")
    get_settings.cache_clear()
    try:
        args = argparse.Namespace(namespace=["team-a"], all_namespaces=False, standalone=False, peering=None)
        assert main._run(args) == 0
    finally:
        get_settings.cache_clear()
    assert (ran["peering_name"], ran["standalone"], ran["clusterwide"]) == ("modelfleet", None, False)
    assert ran["memo"].namespaces == ["team-a"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def run_operator(port: int, stop: asyncio.Event) -> asyncio.Task:
    # Cluster-wide: kmock cannot list namespaces, which kopf does for a list of namespaces.
    return asyncio.create_task(
        kopf.operator(
            clusterwide=True,
            peering_name="modelfleet",
            priority=100,
            liveness_endpoint=f"http://127.0.0.1:{port}/healthz",
            memo=kopf.Memo(namespaces=[]),
            stop_flag=stop,
        )
    )


async def healthz(port: int) -> dict | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as rsp:
            return await rsp.json() if rsp.status == 200 else None
    except aiohttp.ClientConnectionError:
        return None


async def test_kopf_without_peering_warns_at_once_and_healthz_says_so(emulated_cluster, caplog):
    kmock, port, stop = emulated_cluster, free_port(), asyncio.Event()
    caplog.set_level(logging.INFO, logger=preflight.__name__)
    task = await run_operator(port, stop)
    try:

        async def warned():
            return [
                r for r in caplog.records if r.name == preflight.__name__ and r.levelno == logging.WARNING
            ]

        [warning] = await eventually(warned)
        assert "the ClusterKopfPeering CRD is not installed" in warning.getMessage()
        assert "it waits for ClusterKopfPeering modelfleet" in warning.getMessage()
        health = await eventually(lambda: healthz(port))
        assert "the ClusterKopfPeering CRD is not installed" in health["peering"]
        # kopf is paused indeed: the models are there, but no conversion Job is made (with the peering
        # object, the next test sees one within a second).
        await asyncio.sleep(1)
        assert await obj(kmock, JOBS, JOB) is None
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


async def test_kopf_with_its_peering_object_reconciles_and_says_ok(emulated_cluster, caplog):
    kmock, port, stop = emulated_cluster, free_port(), asyncio.Event()
    serve_peering_crd(kmock, with_object=True, clusterwide=True)
    caplog.set_level(logging.INFO, logger=preflight.__name__)
    task = await run_operator(port, stop)
    try:
        assert await eventually(lambda: obj(kmock, JOBS, JOB)), "kopf never resumed: no conversion Job"
        health = await eventually(lambda: healthz(port))
        assert health["peering"] == "ok: ClusterKopfPeering modelfleet"
        assert not [
            r for r in caplog.records if r.name == preflight.__name__ and r.levelno >= logging.WARNING
        ]
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)

"""Each data-plane pod counts its live peers through a headless Service over the model's ready pods, so
the API keys' limits are split by the replicas serving now, not by replicas.max."""

from __future__ import annotations

import asyncio
import copy

import kubernetes_validate
import pytest
from modelfleet.dataplane.server.auth import KeyLimits, RateLimiter
from modelfleet.dataplane.server.peers import ReplicaCount
from modelfleet.dataplane.server.settings import ServerSettings
from modelfleet.operator.api import InferenceModel
from modelfleet.operator.reconcile import serving
from modelfleet.operator.reconcile.plan import serving_plan, version_views
from modelfleet.operator.reconcile.traffic import plan_traffic
from modelfleet.operator.settings import OperatorSettings

SETTINGS = OperatorSettings(dataplane_image="registry.example/modelfleet:1.2.3")


def applied(im: dict, mvs: list[dict]) -> dict[tuple[str, str], dict]:
    """The serving plan's objects by (kind, name)."""
    spec = InferenceModel.model_validate(im).spec
    planned = plan_traffic(spec, version_views(mvs, im["metadata"]["name"]), SETTINGS)
    return {(o["kind"], o["metadata"]["name"]): o for o in serving_plan(im, spec, planned, SETTINGS).apply}


@pytest.fixture()
def autoscaled(example_objects) -> dict:
    im = copy.deepcopy(example_objects["chat"])
    im["spec"]["replicas"] = {"min": 1, "max": 4}
    return im


@pytest.mark.parametrize("k8s_version", ["1.30.0", "1.37.0"])
def test_a_headless_service_selects_the_serving_pods(autoscaled, example_objects, k8s_version):
    objects = applied(autoscaled, [example_objects["chat-v1"]])
    peers, deployment = objects["Service", "chat-peers"], objects["Deployment", "chat"]
    kubernetes_validate.validate(peers, k8s_version, strict=True)
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is False
    assert peers["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert peers["metadata"]["ownerReferences"][0]["uid"] == autoscaled["metadata"]["uid"]
    # Traffic still goes through the model's Service, which keeps its cluster IP.
    assert sorted(name for kind, name in objects if kind == "Service") == ["chat", "chat-peers"]
    assert "clusterIP" not in objects["Service", "chat"]["spec"]


def test_pods_resolve_the_headless_service_and_fall_back_to_the_most_replicas(
    autoscaled, example_objects, monkeypatch
):
    objects = applied(autoscaled, [example_objects["chat-v1"]])
    container = objects["Deployment", "chat"]["spec"]["template"]["spec"]["containers"][0]
    for var in container["env"]:
        if var["name"].startswith("MODELFLEET_") and "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    settings = ServerSettings()
    peers = objects["Service", "chat-peers"]["metadata"]
    assert settings.peers_dns == f"{peers['name']}.{peers['namespace']}.svc" == "chat-peers.team-a.svc"
    assert settings.replicas == 4  # replicas.max: the share until a lookup answers

    async def two_ready(name: str) -> set[str]:
        assert name == settings.peers_dns
        return {"10.0.0.7", "10.0.0.9"}

    replicas = ReplicaCount(settings.replicas, settings.peers_dns, resolve=two_ready)
    limiter = RateLimiter(replicas=replicas)
    limits = KeyLimits(tokens_per_minute=1200)
    assert limiter.shares(limits) == (300, 0)
    asyncio.run(replicas.refresh())
    assert limiter.shares(limits) == (600, 0)  # two pods serve now: each takes half


def test_fixed_replicas_also_count_live_peers(example_objects):
    im = copy.deepcopy(example_objects["chat"])
    im["spec"]["replicas"] = {"min": 2, "max": 2}
    spec = InferenceModel.model_validate(im).spec
    container = serving.deployment(im, spec, SETTINGS)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MODELFLEET_REPLICAS"] == "2"
    assert env["MODELFLEET_PEERS_DNS"] == serving.peers_dns(im) == "chat-peers.team-a.svc"

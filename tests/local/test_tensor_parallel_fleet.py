"""hardware.count on cpu through the local fleet: the operator asks for tensor_parallel_size 2, the
replica's `modelfleet serve` runs the model over two engine processes, and its greedy tokens are those
of the same artifact run in one process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
from local_fleet import model, version_doc, wait_for
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.local.fleet import Fleet
from modelfleet.operator.api import API_VERSION

PROMPT = "Tensor parallel on the CPU"


@pytest.fixture(scope="module")
def split_fleet(pvc_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    running = Fleet(tmp_path_factory.mktemp("tp-fleet"), pvc_root=pvc_root, port=0).start()
    spec = {
        "hardware": {"accelerator": "cpu", "count": 2},
        "engine": {"maxModelLen": 128, "maxNumSeqs": 4},
        "traffic": [{"version": "v1", "weight": 100}],
        "loading": {"mode": "eager"},
    }
    im = {"apiVersion": API_VERSION, "kind": "InferenceModel", "metadata": {"name": "chat"}, "spec": spec}
    try:
        target = {"accelerator": "cpu", "format": "torch", "dtype": "fp32"}
        running.apply([im, version_doc("v1", "pvc://models/chat/v1", targets=[target])])
        wait_for(lambda: (model(running).get("status") or {}).get("endpoint"), 240, "a ready endpoint")
        wait_for(lambda: _ready(running), 120, "the split engine to be ready")
        yield running
    finally:
        running.stop()


def _ready(fleet: Fleet) -> bool:
    import httpx

    url = fleet.endpoint("chat")
    try:
        ready = httpx.get(url.removesuffix("/v1") + "/ready", timeout=5).json() if url else {}
    except httpx.HTTPError:
        return False
    return any(v["state"] == "loaded" for v in ready.get("versions", []))


def test_two_engine_processes_serve_the_one_process_tokens(split_fleet, pvc_root: Path):
    (replica,) = split_fleet.deployments.replicas.values()
    manifest = (replica.container.folder / "volumes" / "manifest" / "manifest.yaml").read_text()
    assert "tensor_parallel_size: 2" in manifest
    # Rank 1 runs in a process of its own under the server (rank 0 is the server's engine).
    assert psutil.Process(replica.container.process.pid).children(recursive=True)

    api = openai.OpenAI(base_url=split_fleet.endpoint("chat"), api_key="unused", max_retries=0, timeout=120)
    served = api.completions.create(model="chat", prompt=PROMPT, max_tokens=12, temperature=0)

    (mv,) = split_fleet.kube.list(API_VERSION, "ModelVersion", "default")
    (artifact,) = mv["status"]["artifacts"]
    one = LLM(pvc_root / artifact["uri"].removeprefix("pvc://"), max_model_len=128, device="cpu")
    alone = one.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert served.choices[0].text == alone.text
    assert served.usage.completion_tokens == len(alone.token_ids)

"""spec.engine.speculative from an InferenceModel to the data plane's engine: the operator renders it into
the serving manifest (a draft model is another ModelVersion of the model, by its torch artifact), and the
server's loader builds the engine config from that manifest."""

from __future__ import annotations

import copy
import json

import pytest
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.manifest import ServingManifest
from modelfleet.dataplane.server.loading import engine_kwargs
from modelfleet.dataplane.server.model_manager import VersionSpec
from modelfleet.operator.api import InferenceModel, Speculative
from modelfleet.operator.reconcile.plan import serving_plan, version_views
from modelfleet.operator.reconcile.traffic import draft_artifact, plan_traffic
from modelfleet.operator.settings import OperatorSettings
from pydantic import ValidationError

SETTINGS = OperatorSettings(
    dataplane_image="registry.example/modelfleet:1.2.3", dataplane_api_keys_secret="k"
)


def version(name: str, version: str, path: str, fmt: str = "torch") -> dict:
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "ModelVersion",
        "metadata": {"name": name, "namespace": "team-a", "generation": 1},
        "spec": {
            "model": "chat",
            "version": version,
            "source": {"uri": "pvc://models/x", "format": "hf-safetensors"},
        },
        "status": {
            "phase": "Ready",
            "artifacts": [{"accelerator": "cpu", "format": fmt, "dtype": "fp32", "uri": f"file://{path}"}],
        },
    }


def inference_model(speculative: dict) -> dict:
    return {
        "apiVersion": "modelfleet.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u-1", "generation": 1},
        "spec": {
            "hardware": {"accelerator": "cpu", "count": 1},
            "engine": {"maxNumSeqs": 4, "kvCacheBytes": 1 << 22, "speculative": speculative},
            "traffic": [{"version": "v1", "weight": 100}],  # the draft takes no traffic
        },
    }


def served_engine_config(im: dict, mvs: list[dict]) -> tuple[EngineConfig, dict]:
    """The engine config the data plane builds from the ConfigMap the operator renders."""
    spec = InferenceModel.model_validate(im).spec
    views = version_views(mvs, "chat")
    planned = plan_traffic(spec, views, SETTINGS)
    plan = serving_plan(im, spec, planned, SETTINGS, draft_artifact(spec, views, SETTINGS))
    (configmap,) = [o for o in plan.apply if o["kind"] == "ConfigMap"]
    (model,) = ServingManifest.from_yaml(configmap["data"]["manifest.yaml"]).models
    (served,) = model.versions
    engine_config = tuple(sorted((k, json.dumps(v)) for k, v in model.engine.items()))
    kwargs = engine_kwargs(
        VersionSpec(model="chat", version=served.name, artifact=served.artifact, engine_config=engine_config)
    )
    return EngineConfig.from_kwargs(served.artifact, **kwargs), kwargs


def test_a_draft_version_reaches_the_engine_config_and_the_engine_speculates(tiny_model_dir, tmp_path):
    draft_dir = tmp_path / "draft"
    draft_dir.mkdir()
    for item in tiny_model_dir.iterdir():  # the draft: another artifact of the same tokenizer
        (draft_dir / item.name).symlink_to(item)
    mvs = [version("chat-v1", "v1", str(tiny_model_dir)), version("chat-draft", "draft", str(draft_dir))]
    im = inference_model({"proposer": "draft", "numTokens": 3, "draftVersion": "draft"})
    config, kwargs = served_engine_config(im, mvs)
    assert (config.speculative_proposer, config.num_speculative_tokens) == ("draft", 3)
    assert config.speculative_draft_model == str(draft_dir)
    assert config.model == str(tiny_model_dir)
    llm = LLM(config.model, device="cpu", dtype="float32", **kwargs)
    out = llm.generate(
        [[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 12
    assert llm.stats().spec_num_draft_tokens > 0


def test_ngram_needs_no_version_and_a_missing_draft_leaves_speculation_off(tiny_model_dir):
    mvs = [version("chat-v1", "v1", str(tiny_model_dir))]
    config, _ = served_engine_config(inference_model({"proposer": "ngram", "numTokens": 5}), mvs)
    assert (config.speculative_proposer, config.num_speculative_tokens) == ("ngram", 5)
    config, _ = served_engine_config(inference_model({}), mvs)
    assert config.speculative_proposer == "none"  # off by default
    # A draft version without a torch artifact (not converted yet, or only ONNX): no speculation yet.
    onnx_draft = version("chat-draft", "draft", str(tiny_model_dir), fmt="onnx")
    im = inference_model({"proposer": "draft", "draftVersion": "draft"})
    for others in ([], [onnx_draft]):
        config, _ = served_engine_config(copy.deepcopy(im), mvs + others)
        assert config.speculative_proposer == "none"


def test_draft_version_goes_with_the_draft_proposer():
    assert Speculative().proposer == "none"
    with pytest.raises(ValidationError, match="draftVersion"):
        Speculative(proposer="draft")
    with pytest.raises(ValidationError, match="draftVersion"):
        Speculative(proposer="ngram", draftVersion="small")
    with pytest.raises(ValidationError):
        Speculative(proposer="ngram", numTokens=0)

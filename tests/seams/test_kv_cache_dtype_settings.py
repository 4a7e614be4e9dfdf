"""spec.engine.kvCacheDtype from an InferenceModel to the data plane's engine: the operator renders it into
the serving manifest, the server's loader builds the engine config from it, and the engine then keeps its
KV cache in e4m3 (emulated on the CPU): four times float32's blocks in the same kvCacheBytes."""

from __future__ import annotations

import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams
from modelfleet.operator.api import Engine
from pydantic import ValidationError

from tests.seams.test_speculative_settings import inference_model as speculative_inference_model
from tests.seams.test_speculative_settings import served_engine_config, version

KV_CACHE_BYTES = 1 << 19  # 64 float32 blocks of the tiny model: below what 4 sequences could fill


def inference_model(engine: dict) -> dict:
    """The speculative seam's InferenceModel (no proposer) with `engine` and a smaller kvCacheBytes."""
    im = speculative_inference_model({})
    im["spec"]["engine"].update(kvCacheBytes=KV_CACHE_BYTES, **engine)
    return im


def test_fp8_reaches_the_engine_and_its_cache(tiny_model_dir):
    mvs = [version("chat-v1", "v1", str(tiny_model_dir))]
    runners = {}
    for value in ("auto", "fp8"):
        config, kwargs = served_engine_config(inference_model({"kvCacheDtype": value}), mvs)
        assert config.kv_cache_dtype == value
        assert ("kv_cache_dtype" in kwargs) == (value == "fp8")  # the default is left unsaid
        llm = LLM(config.model, device="cpu", dtype="float32", **kwargs)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        runners[value] = llm.engine.runner
    assert runners["auto"].kv_cache.dtype == torch.float32
    assert runners["fp8"].kv_cache.dtype == torch.float8_e4m3fn
    assert runners["fp8"].num_blocks == 4 * runners["auto"].num_blocks == KV_CACHE_BYTES // 2048


def test_unset_is_auto_and_other_values_are_refused(tiny_model_dir):
    mvs = [version("chat-v1", "v1", str(tiny_model_dir))]
    config, kwargs = served_engine_config(inference_model({}), mvs)
    assert config.kv_cache_dtype == "auto" and "kv_cache_dtype" not in kwargs
    assert Engine().kv_cache_dtype == "auto"
    with pytest.raises(ValidationError, match="kvCacheDtype"):
        Engine(kvCacheDtype="int8")


def test_fp8_on_an_accelerator_without_fp8_is_refused_before_any_pod_starts():
    from modelfleet.operator.validation import InvalidResource, validate_inference_model

    im = inference_model({"kvCacheDtype": "fp8"})
    for accelerator in ("cpu", "nvidia-h100"):  # cpu emulates it; an H100 has fp8
        im["spec"]["hardware"]["accelerator"] = accelerator
        assert validate_inference_model(im).spec.engine.kv_cache_dtype == "fp8"
    im["spec"]["hardware"]["accelerator"] = "nvidia-a100"
    with pytest.raises(InvalidResource, match="kvCacheDtype fp8 needs an accelerator with fp8; nvidia-a100"):
        validate_inference_model(im)

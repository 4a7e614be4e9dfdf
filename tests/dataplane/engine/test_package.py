"""The package's public names, and that importing it (or the plain parameter classes) stays light."""

import subprocess
import sys

import pytest
from modelfleet.dataplane.sampling_params import SamplingParams


def test_public_names_import_from_the_package():
    from modelfleet import dataplane
    from modelfleet.dataplane import LLM, AsyncLLM, EngineConfig, RequestOutput

    assert {LLM.__name__, AsyncLLM.__name__, EngineConfig.__name__, RequestOutput.__name__} == {
        "LLM",
        "AsyncLLM",
        "EngineConfig",
        "RequestOutput",
    }
    assert SamplingParams().max_tokens == 16
    with pytest.raises(AttributeError):
        _ = dataplane.NoSuchName


def test_package_and_parameters_import_without_torch():
    code = (
        "import sys; from modelfleet.dataplane import SamplingParams, EngineConfig; "
        "from modelfleet.dataplane.engine import scheduler, block_manager; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 2}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted():
    assert SamplingParams(stop="END").stop == ["END"]

"""Fixtures shared by every component's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never reach the network: transformers loads everything from local folders.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


BENCH = Path(__file__).parents[1] / "bench"
INTERPRETER_TEST = "test_triton_interpreter.py::test_kernel_cases_pass_under_the_triton_interpreter"
_interpreter_run = pytest.StashKey[object]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session that will run the Triton-interpreter cases starts their pytest now, in the background
    (about two minutes of one core), so that it runs beside the tests before it."""
    if os.environ.get("TRITON_INTERPRET") == "1" or session.config.option.collectonly:
        return
    if any(item.nodeid.endswith(INTERPRETER_TEST) for item in session.items):
        from tests.dataplane.kernels.interpreter import InterpreterRun
        from tests.dataplane.kernels.test_triton_interpreter import interpreter_cases

        session.config.stash[_interpreter_run] = InterpreterRun(interpreter_cases()[0])


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.config.stash.get(_interpreter_run, None)
    if run is not None:
        run.stop()  # a session that ended early (-x, Ctrl-C) leaves nothing running


@pytest.fixture
def interpreter_run(request: pytest.FixtureRequest) -> object:
    """The interpreter cases' pytest the session started, or None (then the test starts its own)."""
    return request.config.stash.get(_interpreter_run, None)


@pytest.fixture
def bench_scripts(monkeypatch: pytest.MonkeyPatch) -> Path:
    """bench/ on sys.path for this test, so that its scripts import as modules (`import serve`)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return BENCH


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model (seed 0), written once per test session. Treat it as read-only."""
    from modelfleet.dataplane.demo import create_demo_model

    return create_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama checkpoint (float32, no tokenizer) with head_dim 16, the smallest the Triton
    kernels tile, for engine tests on the GPU. Written once per test session; treat it as read-only."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    out_dir = tmp_path_factory.mktemp("llama") / "tiny-llama"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir

"""Tensor parallelism on GPUs (NCCL): decode under CUDA graphs captured per rank, with the broadcast and
all-reduces inside them, gives TP=1's tokens, in process and in the server's engine process; NVLink
multicast stays off; a killed rank fails the engine process. Skipped without two GPUs."""

from __future__ import annotations

import asyncio
import os
import signal

import psutil
import pytest
import torch
from modelfleet.dataplane import LLM, SamplingParams

from .test_tensor_parallel import wait_gone

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
pytestmark = [pytest.mark.gpu, two_gpus]

# float32: the ranks' partial sums round like one rank's matmul, so greedy tokens agree exactly.
SETTINGS = dict(device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (1, 9, 40, 90, 17, 3)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(tiny_llama_dir, **SETTINGS)
    assert llm.engine.runner.decode_graphs is not None
    return tokens(llm)


@pytest.mark.parametrize("tp", [2, 4])
def test_graph_decode_over_ranks_gives_one_ranks_tokens(tiny_llama_dir, one_rank, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    llm = LLM(tiny_llama_dir, tensor_parallel_size=tp, **SETTINGS)
    try:
        runner = llm.engine.runner
        assert runner.decode_graphs is not None and runner.device == torch.device("cuda", 0)
        replays = 0
        run = runner.decode_graphs.run

        def counting_run(*args, **kwargs):
            nonlocal replays
            replays += 1
            return run(*args, **kwargs)

        runner.decode_graphs.run = counting_run
        assert tokens(llm) == one_rank
        assert replays > 20
        assert os.environ["NCCL_NVLS_ENABLE"] == "0"
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        # Each rank's KV cache holds only its KV heads (2 KV heads: one per rank over 2, shared over 4).
        assert runner.kv_cache.shape[4] == 1
    finally:
        llm.engine.close()


def test_engine_process_over_two_gpus_and_a_killed_rank(tiny_llama_dir, one_rank):
    """The server's GPU layout; then a rank killed mid-stream: the stream ends with an error naming it
    (the engine process exits: an NCCL collective would wait on the dead rank for good)."""
    from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess, EngineProcessError

    engine = AsyncLLMProcess(tiny_llama_dir, tensor_parallel_size=2, **SETTINGS)
    engine_pid = engine._process.pid

    async def streamed():
        async def one(prompt):
            return [t async for o in engine.generate(prompt, GREEDY) for t in o.new_token_ids]

        return await asyncio.gather(*(one(p) for p in prompts()))

    async def killed():
        outputs = engine.generate(
            prompts()[2], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        )
        await anext(outputs)
        workers = [p for p in psutil.Process(engine_pid).children(recursive=True) if p.ppid() != engine_pid]
        os.kill(workers[0].pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match=r"tensor-parallel rank 1 \(pid \d+\) exited"):
            async for _ in outputs:
                pass

    below = [p.pid for p in psutil.Process(engine_pid).children(recursive=True)]
    try:
        assert asyncio.run(streamed()) == one_rank
        asyncio.run(killed())
        assert engine.failure is not None
        assert wait_gone([engine_pid, *below]) == []
    finally:
        engine.close()

"""Decode steps under CUDA graphs give the eager engine's tokens; the CPU path never builds graphs."""

import pytest
import torch

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# 5 prompts over max_num_seqs 3: batches 1..3 replay padded graphs, prefills run eagerly
GPU_SETTINGS = dict(device="cuda", dtype="float32", max_num_seqs=3, max_num_batched_tokens=64)


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (1, 7, 40, 90, 17)]


def test_cpu_runner_has_no_graphs(tiny_llama_dir):
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", max_num_seqs=4)
    assert llm.engine.runner.decode_graphs is None
    out = llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [3, 3]


def test_enforce_eager_must_be_a_bool(tmp_path):
    from modelfleet.dataplane import EngineConfig

    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model=str(tmp_path), enforce_eager="yes")


@pytest.mark.gpu
@cuda_only
def test_graph_decode_matches_eager_on_gpu(tiny_llama_dir):
    from modelfleet.dataplane import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    graphs = LLM(tiny_llama_dir, **GPU_SETTINGS)
    runner = graphs.engine.runner
    assert runner.decode_graphs is not None and sorted(runner.decode_graphs.graphs) == [
        (n, head) for n in (1, 2, 3) for head in (False, True)
    ]
    replays = 0
    run = runner.decode_graphs.run

    def counting_run(*args, **kwargs):
        nonlocal replays
        replays += 1
        return run(*args, **kwargs)

    runner.decode_graphs.run = counting_run
    got = [o.token_ids for o in graphs.generate(prompts(), greedy)]
    got_seeded = [o.token_ids for o in graphs.generate(prompts(), seeded)]
    assert replays > 20
    eager = LLM(tiny_llama_dir, enforce_eager=True, **GPU_SETTINGS)
    assert eager.engine.runner.decode_graphs is None
    assert got == [o.token_ids for o in eager.generate(prompts(), greedy)]
    assert got_seeded == [o.token_ids for o in eager.generate(prompts(), seeded)]


@pytest.mark.gpu
@cuda_only
def test_engine_process_on_gpu_gives_the_in_process_tokens(tiny_llama_dir):
    """The server's GPU layout: the engine (CUDA graphs, Triton kernels) in a spawned child process."""
    import asyncio

    from modelfleet.dataplane import LLM, SamplingParams
    from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess

    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama_dir, **GPU_SETTINGS).generate(prompts(), greedy)]

    async def streamed(engine):
        async def one(prompt):
            return [t async for o in engine.generate(prompt, greedy) for t in o.new_token_ids]

        return await asyncio.gather(*(one(p) for p in prompts()))

    engine = AsyncLLMProcess(tiny_llama_dir, **GPU_SETTINGS)
    try:
        assert asyncio.run(streamed(engine)) == want
    finally:
        engine.close()
    assert not engine._process.is_alive()

"""Steps with prompt tokens under piecewise CUDA graphs give the eager engine's tokens; the token counts
captured; attention writing into a given buffer (what the pieces read)."""

import itertools

import pytest
import torch

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# budget 64: prompts are chunked, decodes join chunks, steps of 2..64 tokens pad to 16, 32 or 64
GPU_SETTINGS = dict(device="cuda", dtype="float32", max_num_seqs=3, max_num_batched_tokens=64)


def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (1, 7, 40, 90, 17, 130)]


def test_token_counts_cover_the_budget_in_steps_that_grow():
    from modelfleet.dataplane.kernels.piecewise_graphs import default_token_counts

    counts = default_token_counts(8192)
    assert counts[:6] == [16, 32, 64, 128, 256, 512]
    assert counts[6:12] == [768, 1024, 1280, 1536, 1792, 2048]
    assert counts[-2:] == [7680, 8192]
    assert all(b <= 2 * a for a, b in itertools.pairwise(counts))  # padding at most doubles
    assert default_token_counts(100) == [16, 32, 64, 100]
    assert default_token_counts(16) == [16]


def test_piecewise_graphs_must_be_a_bool(tmp_path):
    from modelfleet.dataplane import EngineConfig

    with pytest.raises(ValueError, match="piecewise_graphs"):
        EngineConfig(model=str(tmp_path), piecewise_graphs="yes")


def test_cpu_runner_has_no_piecewise_graphs(tiny_llama_dir):
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", max_num_seqs=4)
    assert llm.engine.runner.piecewise_graphs is None
    out = llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [2, 2]


def test_torch_attention_writes_into_the_given_buffer():
    """The pieces read attention's output where they were captured to: the backend writes it there."""
    from modelfleet.dataplane.attention import AttentionMetadata
    from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention

    torch.manual_seed(0)
    backend = TorchPagedAttention()
    kv_cache = torch.randn(2, 8, 4, 2, 16)
    for query_lens, seq_lens in (([5], [9]), ([3, 1, 4], [3, 6, 12])):  # one group, several groups
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=[[1, 2, 3], [4, 5], [6, 7, 0]][: len(seq_lens)],
            block_size=4,
        )
        query = torch.randn(sum(query_lens), 4, 16)
        want = backend.forward(query, kv_cache, meta, 0.25)
        out = torch.full_like(query, float("nan"))
        got = backend.forward(query, kv_cache, meta, 0.25, out=out)
        assert got.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
@cuda_only
def test_piecewise_steps_match_eager_on_gpu(tiny_llama_dir):
    from modelfleet.dataplane import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    graphs = LLM(tiny_llama_dir, **GPU_SETTINGS)
    runner = graphs.engine.runner
    assert runner.piecewise_graphs is not None
    assert sorted(runner.piecewise_graphs.pieces) == [16, 32, 64]
    layers = runner.model_config.num_layers
    assert all(len(g) == layers + 1 and len(a) == layers for g, a in runner.piecewise_graphs.pieces.values())
    steps = []
    run = runner.piecewise_graphs.run

    def counting_run(inputs, padded, max_query_len):
        steps.append(len(inputs[0]))
        return run(inputs, padded, max_query_len)

    runner.piecewise_graphs.run = counting_run
    got = [o.token_ids for o in graphs.generate(prompts(), greedy)]
    got_seeded = [o.token_ids for o in graphs.generate(prompts(), seeded)]
    assert len(steps) > 6 and max(steps) == 64 and min(steps) < 16  # chunks, and short prompts padded
    eager = LLM(tiny_llama_dir, piecewise_graphs=False, **GPU_SETTINGS)
    assert eager.engine.runner.piecewise_graphs is None
    assert eager.engine.runner.decode_graphs is not None
    assert got == [o.token_ids for o in eager.generate(prompts(), greedy)]
    assert got_seeded == [o.token_ids for o in eager.generate(prompts(), seeded)]


def mixed_step(block_size: int):
    """A mixed step's host arrays (ModelRunner's StepInputs) and its longest query: a chunk of 30 tokens
    over 20 cached ones, a new prompt of 17, and two decodes whose tokens are still in flight (rows 1 and
    3 of sampled_ids)."""
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(20, 30), (0, 17), (40, 1), (9, 1)]  # (context tokens, new tokens)
    blocks = iter(range(1, 200))
    query_lens = np.array([n for _, n in shapes])
    starts = np.array([c for c, _ in shapes])
    seq_lens = starts + query_lens
    tables = [[next(blocks) for _ in range(-(-int(n) // block_size))] for n in seq_lens]
    width = max(map(len, tables))
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32)
    cu_query = np.concatenate([[0], np.cumsum(query_lens)])
    num_tokens = int(cu_query[-1])
    seq_index = np.repeat(np.arange(len(shapes)), query_lens)
    positions = np.arange(num_tokens) - cu_query[seq_index] + starts[seq_index]
    slots = block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
    slot_mapping = slots + positions % block_size
    input_ids = rng.integers(5, 500, num_tokens)
    src_rows = np.full(num_tokens, -1)
    src_rows[cu_query[2:4]] = [1, 3]
    inputs = (input_ids, src_rows, positions, slot_mapping, cu_query, seq_lens, block_tables)
    return inputs, int(query_lens.max())


def test_the_pieces_run_eagerly_compute_the_models_forward(tiny_llama_dir):
    """What the replays compute, run eagerly on the CPU: a mixed step staged into the pieces' buffers
    (its 49 tokens padded to 64) and the forward with each attention call split out to the shared query
    and output buffers give the model's own hidden states and KV-cache writes."""
    from modelfleet.dataplane import EngineConfig
    from modelfleet.dataplane.engine.model_runner import ModelRunner
    from modelfleet.dataplane.kernels.piecewise_graphs import PiecewiseGraphRunner

    config = EngineConfig(model=tiny_llama_dir, device="cpu", dtype="float32", max_num_seqs=8)
    runner = ModelRunner(config, 256)
    backend = runner.model.attention_backend
    pieces = PiecewiseGraphRunner(
        runner.model, runner.kv_caches, runner.sampled_ids, max_tokens=128, max_seqs=8, max_blocks_per_seq=16
    )
    assert pieces.token_counts == [16, 32, 64, 128]
    runner.sampled_ids[:4] = torch.tensor([11, 12, 13, 14])
    runner.kv_cache.normal_()  # the cached context's keys and values
    before = runner.kv_cache.clone()
    inputs, max_query_len = mixed_step(runner.block_size)
    with torch.inference_mode():
        metadata = pieces.stage(inputs, 64)
        assert metadata.max_query_len == max_query_len
        with pieces.split_attention():
            pieces.forward(64, metadata)
        assert runner.model.attention_backend is backend
        got, written = pieces.hidden[:49].clone(), runner.kv_cache.clone()
        runner.kv_cache.copy_(before)
        want = runner._forward_eager(*inputs, max_query_len)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(written, runner.kv_cache)  # the same KV written, none for the padding


@pytest.mark.gpu
@cuda_only
def test_piecewise_hidden_states_match_the_eager_forward_on_gpu(tiny_llama_dir):
    """The mixed step through the captured pieces against the model run eagerly on the same inputs, in
    bfloat16."""
    from modelfleet.dataplane import EngineConfig
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    config = EngineConfig(model=tiny_llama_dir, device="cuda", dtype="bfloat16", max_num_seqs=8)
    runner = ModelRunner(config, 256)
    runner.capture_piecewise(128)
    pieces = runner.piecewise_graphs
    assert pieces is not None and pieces.token_counts == [16, 32, 64, 128]
    runner.sampled_ids[:4] = torch.tensor([11, 12, 13, 14], device="cuda")
    runner.kv_cache.normal_()
    inputs, max_query_len = mixed_step(runner.block_size)
    cache_before = runner.kv_cache.clone()
    got = runner._forward(False, inputs, max_query_len).clone()
    cache_after = runner.kv_cache.clone()
    runner.kv_cache.copy_(cache_before)
    want = runner._forward_eager(*inputs, max_query_len)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache_after, runner.kv_cache)  # the same KV written, and no more
    assert pieces.padded_count(len(inputs[0])) == 64


@pytest.mark.gpu
@cuda_only
def test_out_of_memory_capturing_pieces_leaves_prompt_steps_eager(tiny_llama_dir, monkeypatch, caplog):
    """A capture that runs out of memory (the KV cache took it) is a warning, not a failed start: the
    engine serves, its prompt steps eager, and the stream is out of capture mode."""
    from modelfleet.dataplane import LLM, SamplingParams
    from modelfleet.dataplane.kernels import piecewise_graphs

    forward = piecewise_graphs.PiecewiseGraphRunner.forward

    def short_of_memory(self, count, metadata):
        forward(self, count, metadata)
        if self._capturing is not None:  # in the middle of a capture, as an allocation there would
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(piecewise_graphs.PiecewiseGraphRunner, "forward", short_of_memory)
    with caplog.at_level("WARNING"):
        llm = LLM(tiny_llama_dir, **GPU_SETTINGS)
    assert llm.engine.runner.piecewise_graphs is None
    assert "piecewise CUDA graphs off (CUDA out of memory" in caplog.text
    assert not torch.cuda.is_current_stream_capturing()
    out = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4] * len(prompts())

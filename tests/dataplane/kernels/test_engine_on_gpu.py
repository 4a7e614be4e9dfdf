"""The engine on a GPU with the Triton backend gives the CPU engine's greedy tokens (float32 on both)."""

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT_SEED = 5


def prompts():
    g = torch.Generator().manual_seed(PROMPT_SEED)
    long = torch.randint(5, 500, (300,), generator=g).tolist()
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (1, 20, 130)] + [
        long,
        [*long[:200], 7, 8, 9],
        long[:160],
    ]  # shared prefixes: cached-context prefill


def test_engine_on_gpu_with_triton_matches_cpu(device, tiny_llama_dir):
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU")
    from modelfleet.dataplane import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    settings = dict(dtype="float32", max_num_batched_tokens=128, max_num_seqs=4)  # chunked prefill too
    gpu = LLM(tiny_llama_dir, device="cuda", **settings)
    assert gpu.engine.runner.model.attention_backend.name == "triton"
    got = [o.token_ids for o in gpu.generate(prompts(), params)]
    cpu = LLM(tiny_llama_dir, device="cpu", **settings)
    want = [o.token_ids for o in cpu.generate(prompts(), params)]
    assert got == want


def test_fused_sampler_path_is_seeded_batch_independent_and_greedy_exact(device, tiny_llama_dir):
    """Temperature-only batches take the one-kernel sampler: greedy rows still give the torch sampler's
    argmax tokens, and a seeded request draws the same tokens alone and inside any batch."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU")
    from modelfleet.dataplane import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", max_num_seqs=8)
    sampler = llm.engine.runner.sampler
    assert sampler.fused
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fused_greedy = [o.token_ids for o in llm.generate(prompts(), greedy)]
    sampler.fused = False
    assert fused_greedy == [o.token_ids for o in llm.generate(prompts(), greedy)]
    sampler.fused = True

    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts()[1], seeded)[0].token_ids
    others = [SamplingParams(temperature=t, max_tokens=24, ignore_eos=True) for t in (0.0, 0.7, 1.3)]
    batch = llm.generate(prompts()[:4], [others[0], seeded, others[1], others[2]])
    assert batch[1].token_ids == alone
    unseeded = [o.token_ids for o in llm.generate([prompts()[1]] * 4, others[2])]
    assert len({tuple(t) for t in unseeded}) > 1  # unseeded rows draw different noise


def test_decode_graphs_sample_in_the_graph_as_the_eager_engine_does(device, tiny_llama_dir, monkeypatch):
    """Temperature-only decode steps replay one graph (forward, logits, fused sampler); their tokens
    equal the eager engine's, greedy and seeded; a step with a row the head cannot sample (logprobs)
    takes the plain graph and the sampler, and the rows beside it keep their tokens."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU")
    from modelfleet.dataplane import LLM, SamplingParams
    from modelfleet.dataplane.engine.model_runner import ModelRunner

    heads = []
    launch_head = ModelRunner._launch_graph_sampled

    def counted(self, out, inputs):
        heads.append(len(out.scheduled))
        return launch_head(self, out, inputs)

    monkeypatch.setattr(ModelRunner, "_launch_graph_sampled", counted)
    settings = dict(device="cuda", dtype="float32", max_num_seqs=4)
    graphs = LLM(tiny_llama_dir, **settings)
    assert graphs.engine.runner.decode_graphs.head is not None
    eager = LLM(tiny_llama_dir, enforce_eager=True, **settings)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True)
    logprobs = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    for params in ([greedy] * 4, [greedy, seeded, greedy, seeded], [greedy, logprobs, seeded, greedy]):
        heads.clear()
        got = [o.token_ids for o in graphs.generate(prompts()[:4], params)]
        sampled_in_graph = len(heads)
        assert got == [o.token_ids for o in eager.generate(prompts()[:4], params)]
        if logprobs in params:  # decode rows ran with the logprobs row until it finished with the rest
            assert sampled_in_graph == 0
        else:
            assert sampled_in_graph >= 20  # the decode steps

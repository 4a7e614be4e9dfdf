"""DecodeGraphRunner: replayed graphs give what eager runs give, padding rows never leak out."""

import pytest
import torch
from modelfleet.dataplane.kernels.cuda_graphs import DecodeGraphRunner

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 8, 2, 64, 16, 64, 6
HIDDEN, VOCAB = 128, 100
CAPTURED = [1, 2, 4, 8]


class ToyDecoder:
    """One attention layer over a paged KV cache, shaped like a model's decode step."""

    def __init__(self, device, dtype):
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen).to(device, dtype)
        self.norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(device, dtype)
        qkv_size = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        self.w_qkv = (torch.randn(qkv_size, HIDDEN, generator=gen) / HIDDEN**0.5).to(device, dtype)
        self.w_out = (torch.randn(HIDDEN, NUM_HEADS * HEAD_DIM, generator=gen) / 16).to(device, dtype)
        self.kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(
            device, dtype
        )

    def __call__(self, views):
        from modelfleet.dataplane.attention import AttentionMetadata
        from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention
        from modelfleet.dataplane.kernels.rms_norm import rms_norm

        backend = TritonPagedAttention()
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            max_query_len=1,
            max_seq_len=MAX_BLOCKS * BLOCK_SIZE,
        )
        hidden = rms_norm(self.embed[views["input_ids"]], self.norm_weight, 1e-6)
        qkv = hidden @ self.w_qkv.T
        q = qkv[:, : NUM_HEADS * HEAD_DIM].view(-1, NUM_HEADS, HEAD_DIM)
        k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
            -1, NUM_KV_HEADS, HEAD_DIM
        )
        v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(-1, NUM_KV_HEADS, HEAD_DIM)
        backend.write_kv(k, v, self.kv_cache, meta.slot_mapping)
        out = backend.forward(q, self.kv_cache, meta, HEAD_DIM**-0.5)
        return out.reshape(-1, NUM_HEADS * HEAD_DIM) @ self.w_out.T


def static_buffers(device, max_batch):
    return {
        "input_ids": torch.zeros(max_batch, dtype=torch.long, device=device),
        "slot_mapping": torch.full((max_batch,), -1, dtype=torch.long, device=device),
        "query_start_loc": torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.zeros(max_batch, dtype=torch.int32, device=device),
        "block_tables": torch.zeros(max_batch, MAX_BLOCKS, dtype=torch.int32, device=device),
    }


PAD_VALUES = {"slot_mapping": -1, "seq_lens": 0}


def decode_inputs(batch_size, device, seed):
    """Sequences with disjoint blocks, each appending its next token at the end of its context."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    seq_lens = torch.randint(1, 4 * BLOCK_SIZE, (batch_size,), generator=gen)
    width = int(-(-seq_lens.max() // BLOCK_SIZE))
    tables = blocks[: batch_size * width].view(batch_size, width)
    last = seq_lens - 1
    slots = tables[torch.arange(batch_size), last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    return {
        "input_ids": torch.randint(0, VOCAB, (batch_size,), generator=gen).to(device),
        "slot_mapping": slots.to(device),
        "seq_lens": seq_lens.to(torch.int32).to(device),
        "block_tables": tables.to(torch.int32).to(device),
    }


def eager_inputs(inputs, batch_size, device):
    full = dict(inputs)
    full["query_start_loc"] = torch.arange(batch_size + 1, dtype=torch.int32, device=device)
    return full


@pytest.mark.gpu
def test_replayed_graphs_match_eager_runs(device):
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU (graphs cannot be captured under the interpreter)")
    graph_model, eager_model = ToyDecoder(device, torch.float32), ToyDecoder(device, torch.float32)
    runner = DecodeGraphRunner(
        graph_model,
        static_buffers(device, max(CAPTURED)),
        CAPTURED,
        pad_values=PAD_VALUES,
        static_inputs=lambda n: {"query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=device)},
    )
    runner.capture()
    assert sorted(runner.graphs) == [(size, False) for size in CAPTURED]
    eager_model.kv_cache.copy_(graph_model.kv_cache)  # the warm-up runs wrote to it
    for step, batch_size in enumerate([1, 3, 5, 8, 2, 11, 4, 7]):
        inputs = decode_inputs(batch_size, device, seed=step)
        # every other step gives host data (numpy), which goes through the pinned staging buffers
        given = {k: v.cpu().numpy() for k, v in inputs.items()} if step % 2 else inputs
        # staging made inside inference mode (step 1) must still serve steps outside it (step 3)
        with torch.inference_mode(step % 4 == 1):
            got = runner.run(given, batch_size).clone()
        want = eager_model(eager_inputs(inputs, batch_size, device))
        assert got.shape == want.shape == (batch_size, HIDDEN)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the same K/V landed in the cache, and padding rows (slot -1) wrote nothing
        torch.testing.assert_close(graph_model.kv_cache, eager_model.kv_cache, atol=1e-5, rtol=1e-5)
    assert runner.padded_size(11) is None  # larger than any graph: ran eagerly


def test_runner_without_cuda_runs_eagerly():
    calls = []

    def forward(views):
        calls.append({name: t.shape[0] for name, t in views.items()})
        return views["x"] * 2

    runner = DecodeGraphRunner(forward, {"x": torch.zeros(4)}, [1, 2, 4])
    runner.capture()  # nothing to capture on the CPU
    assert not runner.enabled and not runner.graphs
    out = runner.run({"x": torch.tensor([1.0, 2.0, 3.0])}, 3)
    assert out.tolist() == [2.0, 4.0, 6.0]
    assert calls == [{"x": 3}]


def test_a_head_runs_after_the_forward_only_when_asked():
    runner = DecodeGraphRunner(
        lambda v: v["x"] * 2, {"x": torch.zeros(4)}, [1, 2, 4], head=lambda v, out: out + v["x"]
    )
    x = torch.tensor([1.0, 2.0])
    assert runner.run({"x": x}, 2).tolist() == [2.0, 4.0]
    assert runner.run({"x": x}, 2, head=True).tolist() == [3.0, 6.0]
    with pytest.raises(ValueError, match="head=True"):
        DecodeGraphRunner(lambda v: v["x"], {"x": torch.zeros(2)}, [1, 2]).run({"x": x}, 2, head=True)


def test_eager_fallback_needs_every_input_past_the_buffers():
    runner = DecodeGraphRunner(
        lambda v: v["x"] + v["k"][:-1], {"x": torch.zeros(2), "k": torch.ones(3)}, [1, 2]
    )
    assert runner.run({"x": torch.zeros(2)}, 2).tolist() == [1.0, 1.0]  # k from its buffer
    with pytest.raises(ValueError, match="'k' is needed"):
        runner.run({"x": torch.zeros(3)}, 3)


def test_runner_rejects_buffers_smaller_than_the_largest_batch():
    with pytest.raises(ValueError, match="fewer rows"):
        DecodeGraphRunner(lambda v: v["x"], {"x": torch.zeros(2)}, [1, 4])


def test_default_batch_sizes():
    from modelfleet.dataplane.kernels.cuda_graphs import default_batch_sizes

    assert default_batch_sizes(5) == [1, 2, 4, 5]
    assert default_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert default_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.gpu
def test_llama_decode_graphs_match_eager(device):
    """A small random Llama (the real model code, Triton backend): graph replays equal eager decode."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU (graphs cannot be captured under the interpreter)")
    from modelfleet.dataplane.attention import AttentionMetadata, get_backend
    from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner
    from modelfleet.dataplane.models import ModelConfig
    from modelfleet.dataplane.models.llama import LlamaForCausalLM
    from modelfleet.dataplane.registration import register_builtins

    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "eos_token_id": 2,
    }  # fmt: skip
    config = ModelConfig.from_hf_dict(hf_config)
    torch.manual_seed(0)
    register_builtins()  # as an engine's start: the "triton" backend and the Triton ops
    model = LlamaForCausalLM(config, get_backend("triton")).to(device, torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    model.after_load(device)
    head_dim = 256 // 8
    kv = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, 2, head_dim, device=device, dtype=torch.bfloat16)
    graph_caches, eager_caches = list(kv.clone().unbind(0)), list(kv.clone().unbind(0))
    runner = model_decode_runner(model, graph_caches, max_batch_size=8, max_blocks_per_seq=MAX_BLOCKS)
    runner.capture()
    assert sorted(runner.graphs) == [(n, False) for n in (1, 2, 4, 8)]
    for step, batch_size in enumerate([1, 3, 8, 6, 9]):  # 9: past the largest graph, eager
        inputs = decode_inputs(batch_size, device, seed=10 + step)
        inputs["positions"] = inputs["seq_lens"].long() - 1
        with torch.inference_mode():
            got = runner.run(inputs, batch_size).clone()
            meta = AttentionMetadata(
                slot_mapping=inputs["slot_mapping"],
                query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
                seq_lens=inputs["seq_lens"],
                block_tables=inputs["block_tables"],
                max_query_len=1,
                max_seq_len=int(inputs["seq_lens"].max()),
            )
            want = model(inputs["input_ids"], inputs["positions"], eager_caches, meta)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
        for g, e in zip(graph_caches, eager_caches, strict=True):
            torch.testing.assert_close(g, e, atol=1e-2, rtol=1e-2)


def test_packed_buffers_send_a_steps_host_inputs_in_one_copy():
    """The buffers' layout (the largest last, 16-byte aligned), their contents kept, and a send: the whole
    mirror up to the rows asked of the last buffer, around the buffers a device input owns."""
    from modelfleet.dataplane.kernels.cuda_graphs import PackedBuffers

    given = {
        "tables": torch.arange(4 * 6, dtype=torch.int32).view(4, 6),
        "ids": torch.arange(4, dtype=torch.long) + 100,
        "lens": torch.full((4,), 7, dtype=torch.int32),
    }
    packed = PackedBuffers(given)
    assert packed.last == "tables"
    assert all(offset % 16 == 0 for offset in packed.offsets.values())
    assert max(packed.offsets, key=packed.offsets.__getitem__) == "tables"
    for name, buf in given.items():
        assert torch.equal(packed.device_views[name], buf)
    copies = []
    real_copy = packed._copy
    packed._copy = lambda start, end: (copies.append((start, end)), real_copy(start, end))

    packed.host_views["ids"][:2] = [5, 6]
    packed.host_views["tables"][:2] = -1
    packed.host_views["tables"][2:] = -2  # rows past the ones sent stay on the host
    packed.send(last_rows=2)
    assert len(copies) == 1
    assert packed.device_views["ids"].tolist() == [5, 6, 102, 103]
    assert (packed.device_views["tables"][:2] == -1).all()
    assert torch.equal(packed.device_views["tables"][2:], given["tables"][2:])

    copies.clear()
    packed.device_views["ids"].fill_(9)  # written on the device: its mirror is stale
    packed.host_views["ids"][:] = 0
    packed.host_views["lens"][:] = 1
    packed.send(last_rows=4, skip={"ids"})
    assert len(copies) == 2  # around "ids", between the smaller "lens" and "tables"
    assert packed.device_views["ids"].tolist() == [9] * 4
    assert packed.device_views["lens"].tolist() == [1] * 4
    assert (packed.device_views["tables"][2:] == -2).all()


def test_packed_buffers_refuse_a_strided_buffer():
    from modelfleet.dataplane.kernels.cuda_graphs import PackedBuffers

    with pytest.raises(ValueError, match="'x' must be contiguous"):
        PackedBuffers({"x": torch.zeros(4, 4).t()})


def test_a_shared_mirror_lies_in_shared_memory_or_falls_back_to_the_processs(monkeypatch, caplog):
    """A mirror asked for in shared memory (the masked head's, which a grammar process fills) is there; a
    host without shared memory gets one of the process's own, said, and the buffers work the same."""
    from modelfleet.dataplane.engine import shared_host
    from modelfleet.dataplane.kernels.cuda_graphs import PackedBuffers

    given = {
        "bits": torch.arange(8, dtype=torch.int32).view(2, 4),
        "flags": torch.zeros(2, dtype=torch.int32),
    }
    shared = PackedBuffers(given, shared=True)
    place = shared_host.place_of(shared.host_tensors["bits"])
    assert place is not None and place.offset == shared.offsets["bits"]

    def no_shared_memory(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "/dev/shm")

    monkeypatch.setattr(shared_host, "shared_bytes", no_shared_memory)
    private = PackedBuffers(given, shared=True)
    assert shared_host.place_of(private.host_tensors["bits"]) is None
    assert "not in shared memory" in caplog.text
    private.host_views["bits"][:] = 5
    private.send(last_rows=2)
    assert (private.device_views["bits"] == 5).all()

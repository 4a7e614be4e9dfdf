"""Kernel benchmark: Triton paged decode attention against the device's copy bandwidth and the torch
backend, in the same run; plus the prefill kernel, the small fused ops and the fused sampler against their
torch versions, and one decode step of a Llama-3.2-1B-shaped model, eager against CUDA graphs, against
its roofline.

Prints one JSON line. Needs a CUDA GPU with Triton. Each timed call reads a different KV cache (several
are rotated), so the numbers are not served from the L2 cache.
    python bench/kernels.py [--dtype bfloat16] [--quick] [--sampler-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

# The kernels' torch references and random paged batches live beside their tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, query heads, KV heads, head dim): the attention shapes of Llama-3.2-1B and Llama-3-8B
SHAPES = [("llama-1b", 32, 8, 64), ("llama-8b", 32, 8, 128)]
DECODE_CASES = [(1, 32768), (8, 8192), (64, 2048), (256, 512)]  # (batch, context)
PREFILL_CASES = [(4, 2048)]  # (batch, prompt length), no cached context
BLOCK_SIZE = 16
ROTATE_BYTES = 1 << 30  # rotate inputs until the set read by consecutive calls exceeds the L2 many times


def median_us(fn, inputs: list) -> float:
    from triton.testing import do_bench

    cycle = itertools.cycle(inputs)
    return 1000 * do_bench(lambda: fn(next(cycle)), warmup=50, rep=300, return_mode="median")


def copy_bandwidth_gbps(device: torch.device) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = median_us(lambda _: dst.copy_(src), [None])
    return 2 * src.numel() / us / 1e3  # bytes read + written


def kv_bytes(batch) -> int:
    per_token = 2 * batch.kv_cache.shape[3] * batch.kv_cache.shape[4] * batch.kv_cache.element_size()
    return int(batch.seq_lens.sum()) * per_token


def make_batches(seq_lens, query_lens, shape, dtype, device, count):
    from tests.dataplane.kernels.paged_batches import random_paged_batch

    _, num_heads, num_kv_heads, head_dim = shape
    return [
        random_paged_batch(
            seq_lens,
            query_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=BLOCK_SIZE,
            dtype=dtype,
            device=device,
            spare_blocks=0,
            seed=i,
        )
        for i in range(count)
    ]


def metadata(batch):
    from modelfleet.dataplane.attention import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=batch.q.device),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )


def bench_attention(shape, num_seqs, length, decode: bool, dtype, device, copy_gbps) -> dict:
    from modelfleet.dataplane.attention.torch_paged import TorchPagedAttention
    from modelfleet.dataplane.attention.triton_paged import TritonPagedAttention

    seq_lens = [length] * num_seqs
    query_lens = [1 if decode else length] * num_seqs
    one = make_batches(seq_lens, query_lens, shape, dtype, device, 1)[0]
    count = max(2, min(8, ROTATE_BYTES // max(kv_bytes(one), 1)))
    batches = [one, *make_batches(seq_lens, query_lens, shape, dtype, device, count - 1)]
    scale = shape[3] ** -0.5
    metas = [(b, metadata(b)) for b in batches]
    ours, torch_ref = TritonPagedAttention(), TorchPagedAttention()

    def run(backend):
        return lambda item: backend.forward(item[0].q, item[0].kv_cache, item[1], scale)

    got, want = run(ours)(metas[0]), run(torch_ref)(metas[0])
    max_err = (got.float() - want.float()).abs().max().item()
    triton_us = median_us(run(ours), metas)
    torch_us = median_us(run(torch_ref), metas)
    result = {
        "kernel": "decode" if decode else "prefill",
        "shape": shape[0],
        "batch": num_seqs,
        "context": length,
        "triton_us": round(triton_us, 1),
        "torch_us": round(torch_us, 1),
        "speedup_vs_torch": round(torch_us / triton_us, 2),
        "max_abs_err_vs_torch": round(max_err, 5),
    }
    if decode:
        moved = kv_bytes(one) + 2 * one.q.numel() * one.q.element_size()
        result["triton_gbps"] = round(moved / triton_us / 1e3, 1)
        result["pct_of_copy_bandwidth"] = round(100 * moved / triton_us / 1e3 / copy_gbps, 1)
    else:
        _, num_heads, _, head_dim = shape
        flops = 4 * num_heads * head_dim * num_seqs * length * (length + 1) / 2  # causal: half the pairs
        result["triton_tflops"] = round(flops / triton_us / 1e6, 1)
    return result


def bench_small_ops(dtype, device) -> list[dict]:
    from modelfleet.dataplane.kernels.activation import silu_and_mul
    from modelfleet.dataplane.kernels.rms_norm import rms_norm
    from modelfleet.dataplane.kernels.rotary import rotary_embedding

    from tests.dataplane.kernels import reference

    tokens, hidden, inter, heads, kv_heads, head_dim = 256, 4096, 14336, 32, 8, 128
    n = 8
    xs = [torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(n)]
    res = [torch.randn_like(x) for x in xs]
    w = torch.randn(hidden, device=device, dtype=dtype)
    gate_up = [torch.randn(tokens, 2 * inter, device=device, dtype=dtype) for _ in range(n)]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    cos, sin = reference.rope_cos_sin(inv_freq, torch.randint(0, 8192, (tokens,), device=device), dtype)
    qs = [torch.randn(tokens, heads, head_dim, device=device, dtype=dtype) for _ in range(n)]
    ks = [torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(n)]
    cases = {
        "fused_add_rms_norm": (
            lambda i: rms_norm(xs[i], w, 1e-5, res[i]),
            lambda i: reference.rms_norm_native(xs[i], w, 1e-5, res[i]),
        ),
        "silu_and_mul": (
            lambda i: silu_and_mul(gate_up[i]),
            lambda i: reference.silu_and_mul_native(gate_up[i]),
        ),
        "rotary_embedding": (
            lambda i: rotary_embedding(qs[i], ks[i], cos, sin),
            lambda i: reference.rotary_embedding_native(qs[i], ks[i], cos, sin),
        ),
    }
    results = []
    for name, (fused, native) in cases.items():
        fused_us, native_us = median_us(fused, list(range(n))), median_us(native, list(range(n)))
        results.append(
            {
                "op": name,
                "tokens": tokens,
                "triton_us": round(fused_us, 1),
                "torch_us": round(native_us, 1),
                "speedup_vs_torch": round(native_us / fused_us, 2),
            }
        )
    return results


SAMPLER_VOCAB = 128256  # Llama 3


def torch_sampler_chain(logits: torch.Tensor, temperature: torch.Tensor | None):
    """The unfused sampler: float copy, NaN check, then argmax or softmax / exponential noise / argmax."""
    x = logits.float()
    bad = torch.isnan(x).any(dim=1)
    x = x.masked_fill(bad.unsqueeze(1), 0.0)
    if temperature is None:
        return x.argmax(dim=-1), bad
    probs = torch.softmax(x / temperature.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1), bad


def bench_sampler(device, copy_gbps, batch_sizes=(1, 256), dtypes=(torch.float32, torch.bfloat16)) -> list:
    """The fused sampling kernel against the torch chain, greedy and at temperature 1, for a 128k vocab:
    eager (rotated inputs, launch costs included) and replayed from a CUDA graph (GPU time alone)."""
    results = []
    for dtype, rows in itertools.product(dtypes, batch_sizes):
        row_bytes = SAMPLER_VOCAB * torch.finfo(dtype).bits // 8
        count = max(2, min(256, ROTATE_BYTES // (rows * row_bytes)))
        inputs = [torch.randn(rows, SAMPLER_VOCAB, device=device, dtype=dtype) for _ in range(count)]
        for greedy in (True, False):
            results.append(bench_sampler_case(inputs, greedy, copy_gbps))
        del inputs
        torch.cuda.empty_cache()
    return results


def bench_sampler_case(inputs: list[torch.Tensor], greedy: bool, copy_gbps: float) -> dict:
    from modelfleet.dataplane.kernels.sampling import sample_tokens
    from triton.testing import do_bench_cudagraph

    rows, vocab = inputs[0].shape
    device = inputs[0].device
    temperature = torch.full((rows,), 0.0 if greedy else 1.0, device=device)
    seeds = torch.arange(rows, device=device)

    def ours(x):
        return sample_tokens(x, temperature, seeds)

    def chain(x):
        return torch_sampler_chain(x, None if greedy else temperature)

    ours_us, chain_us = median_us(ours, inputs), median_us(chain, inputs)
    ours_graph_us = 1000 * do_bench_cudagraph(lambda: ours(inputs[0]), return_mode="median")
    chain_graph_us = 1000 * do_bench_cudagraph(lambda: chain(inputs[0]), return_mode="median")
    moved = inputs[0].numel() * inputs[0].element_size()
    result = {
        "op": "sampler",
        "mode": "greedy" if greedy else "temperature_1",
        "dtype": str(inputs[0].dtype).removeprefix("torch."),
        "batch": rows,
        "vocab": vocab,
        "triton_us": round(ours_us, 1),
        "torch_us": round(chain_us, 1),
        "speedup_vs_torch": round(chain_us / ours_us, 2),
        "triton_graph_us": round(ours_graph_us, 1),
        "torch_graph_us": round(chain_graph_us, 1),
        "graph_speedup_vs_torch": round(chain_graph_us / ours_graph_us, 2),
        "triton_graph_gbps": round(moved / ours_graph_us / 1e3, 1),
        "pct_of_copy_bandwidth": round(100 * moved / ours_graph_us / 1e3 / copy_gbps, 1),
    }
    if greedy:
        want = inputs[0].float().argmax(dim=-1)
        result["equals_torch_argmax"] = bool(torch.equal(ours(inputs[0])[0], want))
    return result


LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "eos_token_id": 128001,
}  # fmt: skip


def bench_decode_step(dtype, device, copy_gbps, batch_sizes=(1, 16, 64), context=256) -> list[dict]:
    """One decode step (forward + logits) of a random-weight Llama-3.2-1B-shaped model, eager against
    replayed CUDA graphs, with the roofline: weight and KV bytes per step over the copy bandwidth."""
    from modelfleet.dataplane.attention import AttentionMetadata, get_backend
    from modelfleet.dataplane.kernels.cuda_graphs import model_decode_runner
    from modelfleet.dataplane.models import ModelConfig
    from modelfleet.dataplane.models.llama import LlamaForCausalLM
    from modelfleet.dataplane.registration import register_builtins

    register_builtins()  # the "triton" backend and the Triton ops, as an engine's start
    config = ModelConfig.from_hf_dict(LLAMA_1B)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config, get_backend("triton"))
    torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(1.0, 0.02) if param.dim() == 1 else param.normal_(0.0, 0.02)
    model.after_load(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    max_batch = max(batch_sizes)
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    kv = torch.randn(
        config.num_layers, 2, max_batch * blocks_per_seq, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
        device=device, dtype=dtype,
    )  # fmt: skip
    kv_caches = list(kv.unbind(0))
    runner = model_decode_runner(
        model, kv_caches, max_batch_size=max_batch, max_blocks_per_seq=blocks_per_seq, batch_sizes=batch_sizes
    )
    runner.capture()
    results = []
    for batch in batch_sizes:
        tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1)
        seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
        positions = torch.full((batch,), context, dtype=torch.long, device=device)
        inputs = {
            "input_ids": torch.randint(0, config.vocab_size, (batch,), device=device),
            "positions": positions,
            "slot_mapping": tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE,
            "seq_lens": seq_lens,
            "block_tables": tables,
        }
        meta = AttentionMetadata(
            slot_mapping=inputs["slot_mapping"],
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=1,
            max_seq_len=blocks_per_seq * BLOCK_SIZE,
        )

        def eager(_, inputs=inputs, meta=meta):
            with torch.inference_mode():
                model.compute_logits(model(inputs["input_ids"], inputs["positions"], kv_caches, meta))

        def graphed(_, inputs=inputs, batch=batch):
            with torch.inference_mode():
                model.compute_logits(runner.run(inputs, batch))

        host_inputs = {name: value.cpu().numpy() for name, value in inputs.items()}

        def graphed_from_host(_, host_inputs=host_inputs, batch=batch):
            with torch.inference_mode():
                model.compute_logits(runner.run(host_inputs, batch))

        eager_us, graph_us = median_us(eager, [None]), median_us(graphed, [None])
        host_graph_us = median_us(graphed_from_host, [None])
        torch.cuda.synchronize()
        # host time to stage the inputs and launch the graph (the GPU runs behind it)
        host_cpu_s = []
        with torch.inference_mode():
            for _ in range(20):  # each from an idle GPU, so no wait on an earlier step is counted
                torch.cuda.synchronize()
                cpu_start = time.perf_counter()
                runner.run(host_inputs, batch)
                host_cpu_s.append(time.perf_counter() - cpu_start)
        torch.cuda.synchronize()
        host_cpu_us = sorted(host_cpu_s)[len(host_cpu_s) // 2] * 1e6
        kv_read = batch * (context + 1) * 2 * config.num_layers * config.num_kv_heads * config.head_dim
        step_bytes = weight_bytes + kv_read * kv.element_size()
        roofline_us = step_bytes / copy_gbps / 1e3
        results.append(
            {
                "model": "llama-3.2-1b-shape",
                "batch": batch,
                "context": context,
                "eager_us": round(eager_us, 1),
                "graph_us": round(graph_us, 1),
                "graph_speedup": round(eager_us / graph_us, 2),
                "graph_from_host_inputs_us": round(host_graph_us, 1),
                "graph_launch_cpu_us": round(host_cpu_us, 1),
                "graph_tokens_per_s": round(batch * 1e6 / graph_us),
                "pct_of_roofline": round(100 * roofline_us / graph_us, 1),
            }
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="one shape, two decode cases")
    parser.add_argument("--no-decode-step", action="store_true", help="skip the whole-model decode step")
    parser.add_argument("--decode-step-only", action="store_true", help="only the whole-model decode step")
    parser.add_argument("--sampler-only", action="store_true", help="only the fused sampler against torch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU with Triton; none found", file=sys.stderr)
        return 1
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    copy_gbps = copy_bandwidth_gbps(device)
    if args.sampler_only:
        line = {"bench": "kernels", "device": torch.cuda.get_device_name(device)}
        line["copy_bandwidth_gbps"] = round(copy_gbps, 1)
        print(json.dumps({**line, "sampler": bench_sampler(device, copy_gbps)}))
        return 0
    if args.decode_step_only:
        print(json.dumps({"bench": "kernels", "decode_step": bench_decode_step(dtype, device, copy_gbps)}))
        return 0
    shapes = SHAPES[-1:] if args.quick else SHAPES
    decode_cases = DECODE_CASES[:2] if args.quick else DECODE_CASES
    results = []
    for shape in shapes:
        for num_seqs, context in decode_cases:
            results.append(bench_attention(shape, num_seqs, context, True, dtype, device, copy_gbps))
            torch.cuda.empty_cache()
        for num_seqs, length in PREFILL_CASES:
            results.append(bench_attention(shape, num_seqs, length, False, dtype, device, copy_gbps))
    decode = [r for r in results if r["kernel"] == "decode"]
    line = {
        "bench": "kernels",
        "device": torch.cuda.get_device_name(device),
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        "copy_bandwidth_gbps": round(copy_gbps, 1),
        "decode_best_pct_of_copy_bandwidth": max(r["pct_of_copy_bandwidth"] for r in decode),
        "attention": results,
        "small_ops": bench_small_ops(dtype, device),
        "sampler": bench_sampler(device, copy_gbps),
    }
    if not args.no_decode_step:
        line["decode_step"] = bench_decode_step(dtype, device, copy_gbps)
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline throughput: our engine against Hugging Face `generate` on the same random-token prompts.

Modelled on vLLM's offline throughput benchmark. EOS is ignored, so every request produces exactly its
output length. The baseline runs `generate` on padded batches, each until its longest output; both
sides are credited with the same tokens (each prompt's own input and output length). Prints one JSON
line with tokens/s of both and the ratio.

    python bench/throughput.py --model DIR --num-prompts 64 --input-len 512 --min-input-len 16 \\
        --output-len 256 --min-output-len 16
    python bench/throughput.py --model DIR --num-prompts 64 --input-len 128 --output-len 128
    python bench/throughput.py --device cuda --preset llama-3.2-1b --num-prompts 1000 \\
        --input-len 128 --output-len 128

On a GPU, --preset builds a random-weight bf16 checkpoint of a real model's shape in a temporary folder
(no tokenizer: the prompts are token ids), and the JSON adds the decode roofline: per pure-decode step,
(weight bytes + KV bytes read) / measured copy bandwidth, summed, over the measured step times summed.
Lengths: fixed by default; uniform in [min, len] with --min-*-len, or in [len*(1-r), len*(1+r)] with
--random-range-ratio r (vLLM's convention).

--tensor-parallel N also runs the engine split over N ranks (GPUs of this node, or CPU processes) after
the one-rank baseline, on the same prompts: `engine_tpN` and `speedup_tpN` (output tokens/s over TP=1).

    python bench/throughput.py --device cuda --preset llama-3.1-8b --num-prompts 1000 \\
        --input-len 128 --output-len 128 --tensor-parallel 2 --skip-hf

--quantize int8 / --quantize fp8 (repeatable) also runs the engine on the converter's per-channel
artifact of the same model (built in a temporary folder), after the bf16 run and on the same prompts:
`engine_int8`, `speedup_int8` (output tokens/s over the source model's run), each with its own roofline;
with --quantize-lm-head they quantize lm_head too.

    python bench/throughput.py --device cuda --preset llama-3.1-8b --num-prompts 1000 \\
        --input-len 128 --output-len 128 --quantize fp8 --quantize int8 --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# Real shapes (config.json of the published checkpoints); weights are random.
PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip


def build_preset(name: str, out_dir: str | Path, device: str) -> str:
    """A random-weight bf16 Llama checkpoint of a preset's shape (safetensors), built on `device`; an
    out_dir that already holds one (config.json) is reused."""
    import transformers

    if (Path(out_dir) / "config.json").is_file():
        write_word_tokenizer(out_dir, 128256)
        return str(out_dir)
    config = transformers.LlamaConfig(
        vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02, **PRESETS[name],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_word_tokenizer(out_dir, config.vocab_size)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return str(out_dir)


def write_word_tokenizer(out_dir: str | Path, vocab_size: int) -> None:
    """A tokenizer whose every id is a word ("t17"), so that any generated token has text: streamed
    outputs of a random-weight model then carry text the way a real model's do (unless one is there)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(out_dir)
    if (out / "tokenizer.json").is_file():
        return
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of a large buffer, bytes read + written per second: the best of 25 copies
    after 10 of warm-up (a median taken while the clocks ramp up or another process runs would
    understate what the GPU can do and flatter the roofline percentages)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(35):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / min(times[10:]) / 1e9


def quantized_artifact(
    model_dir: str | Path, fmt: str, out_dir: str | Path, device: str = "cpu", lm_head: bool = False
) -> str:
    """The converter's int8/fp8 per-channel format of a bf16 checkpoint (its quantized linear weights
    with their scales, lm_head too with `lm_head`, every other tensor as it is), written to out_dir; an
    out_dir that already holds this format is reused. Quantized on `device` (an 8B model's weights take
    minutes on the CPU)."""
    from modelfleet.converters.checkpoint import SIDE_FILES, QuantPlan
    from safetensors.torch import load_file, save_file

    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    plan = QuantPlan(fmt, lm_head=lm_head, tied=bool(config.get("tie_word_embeddings", False)))
    done = out / "config.json"
    if done.is_file() and json.loads(done.read_text()).get("quantization_config") == plan.config():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(src / shard, device=device).items():
            tensors.update(plan.tensors(name, tensor))
        weight_map.update(dict.fromkeys(tensors, shard))
        save_file({k: v.cpu() for k, v in tensors.items()}, str(out / shard), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config["quantization_config"] = plan.config()
    for name in SIDE_FILES:
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    done.write_text(json.dumps(config))  # last: its presence marks a finished artifact
    return str(out)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter once, and the buffers of quantized linears
    (their 1-byte weights and scales), except an untied input embedding (a step reads only its tokens'
    rows)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(
        b.numel() * b.element_size()
        for name, b in model.named_buffers()
        if name.endswith((".weight", ".weight_scale"))
    )
    # Without lm_head the logits read the whole embedding (tied); a tied model whose artifact quantized
    # the head has one, and then reads only its tokens' rows of the embedding, as an untied one.
    if model.lm_head is not None:
        for name, p in model.named_parameters():
            if "embed" in name:
                total -= p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    mc = model.config
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=dtype).element_size()


class DecodeStepTimer:
    """Times every engine step and notes which launched pure decode steps (one token per sequence),
    with their batch size and the KV tokens they read. A step launches its batch and then reads back
    the previous batch's tokens, so in steady decode the wall-clock time between step calls is the
    device's time per step plus whatever host time the device did not hide. `waits` holds, per timed
    step, the time its call spent blocked on the previous step's tokens: the rest of the call was the
    host's own work (scheduling, launching, reading back); with no wait left, the host sets the pace.

    `device_events` (CUDA): also records an event before and after each launch. The GPU stamps the first
    when it has finished the previous step (or at once if it sat idle), so the span between the two is
    the step's own GPU time, plus only the host time that the GPU spent waiting inside that launch."""

    def __init__(self, llm, device_events: bool = False) -> None:
        self.steps: list[tuple[bool, int, int, float]] = []  # (decode, batch, kv tokens, seconds)
        # Aligned with `steps` when device_events: the (start, end) CUDA events around each launch.
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.waits: list[float] = []  # aligned with `steps`: seconds blocked on a step's tokens
        self._last: tuple[bool, int, int] | None = None
        self._wait = 0.0
        self._last_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        engine, runner = llm.engine, llm.engine.runner
        launch, step = runner.launch, engine.step

        def timed_launch(out, end_previous=None):
            items = out.scheduled
            decode = all(s.num_new_tokens == 1 for s in items)
            kv_tokens = sum(s.num_computed_tokens + s.num_new_tokens for s in items)
            self._last = (decode, len(items), kv_tokens)
            if not device_events:
                return timed_result(launch(out, end_previous))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launched = launch(out, end_previous)
            end.record()
            self._last_events = (start, end)
            return timed_result(launched)

        def timed_result(launched):
            result = launched.result

            def wait():  # called by the next engine step
                start = time.perf_counter()
                try:
                    return result()
                finally:
                    self._wait += time.perf_counter() - start

            launched.result = wait
            return launched

        def timed_step():
            self._last, self._last_events, self._wait = None, None, 0.0
            start = time.perf_counter()
            result = step()
            end = time.perf_counter()
            if self._last is not None:
                self.steps.append((*self._last, end - start))
                self.waits.append(self._wait)
                if self._last_events is not None:
                    self.events.append(self._last_events)
            return result

        runner.launch, engine.step = timed_launch, timed_step

    def device_seconds(self) -> list[float]:
        """GPU seconds of each timed step (aligned with `steps`); waits for the device."""
        if self.events:
            self.events[-1][1].synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self.events]

    def clear(self) -> None:
        self.steps.clear()
        self.events.clear()
        self.waits.clear()

    def roofline(self, weight_bytes: int, kv_token_bytes: int, bandwidth_gbps: float) -> dict:
        decode = [s for s in self.steps if s[0]]
        if not decode:
            return {}
        measured = sum(s[3] for s in decode)
        ideal = sum((weight_bytes + kv * kv_token_bytes) / (bandwidth_gbps * 1e9) for _, _, kv, _ in decode)
        tokens = sum(s[1] for s in decode)
        return {
            "decode_steps": len(decode),
            "decode_mean_batch": round(tokens / len(decode), 1),
            "decode_mean_step_ms": round(1e3 * measured / len(decode), 3),
            "decode_tokens_per_s": round(tokens / measured, 1),
            "decode_roofline_tokens_per_s": round(tokens / ideal, 1),
            "decode_pct_of_roofline": round(100 * ideal / measured, 1),
            "decode_time_share_of_engine_steps": round(measured / sum(s[3] for s in self.steps), 3),
            "other_steps": len(self.steps) - len(decode),
            "other_step_ms_mean": round(
                1e3 * sum(s[3] for s in self.steps if not s[0]) / max(len(self.steps) - len(decode), 1), 3
            ),
        }


def sample_lengths(
    rng: np.random.Generator, n: int, length: int, minimum: int | None, ratio: float
) -> list[int]:
    if minimum is not None:
        low, high = minimum, length
    else:
        low, high = max(int(length * (1 - ratio)), 1), int(length * (1 + ratio))
    return rng.integers(low, high + 1, size=n).tolist()


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    input_lens = sample_lengths(
        rng, args.num_prompts, args.input_len, args.min_input_len, args.random_range_ratio
    )
    output_lens = sample_lengths(
        rng, args.num_prompts, args.output_len, args.min_output_len, args.random_range_ratio
    )
    # Low ids are the tokenizer's special tokens; random text tokens come from above them.
    return [
        (rng.integers(16, vocab_size, size=n_in).tolist(), n_out)
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


def engine_settings(args: argparse.Namespace, tensor_parallel: int = 1) -> dict:
    settings = dict(
        tensor_parallel_size=tensor_parallel,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    if args.device == "cpu":
        settings["kv_cache_bytes"] = args.kv_cache_bytes
    if args.max_model_len is not None:
        settings["max_model_len"] = args.max_model_len
    return settings


def run_engine(
    args: argparse.Namespace,
    requests: list[tuple[list[int], int]],
    result: dict,
    tensor_parallel: int = 1,
    model: str | None = None,
) -> float:
    """Seconds to generate `requests` with args.model (or `model`, a quantized artifact of it). The
    one-rank run records the start time and the roofline in `result`; a tensor-parallel one (weights per
    rank differ) only its start time."""
    from modelfleet.dataplane import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model or args.model, **engine_settings(args, tensor_parallel))
    suffix = "" if tensor_parallel == 1 else f"_tp{tensor_parallel}"
    result[f"engine_start_s{suffix}"] = round(time.perf_counter() - start, 1)
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n) for _, n in requests]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
    timer = DecodeStepTimer(llm) if args.device != "cpu" and tensor_parallel == 1 else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [n for _, n in requests]
    if timer is not None:
        model = llm.engine.runner.model
        bandwidth = result["copy_bandwidth_gbps"]
        weights = weight_bytes_per_step(model)
        result["weight_bytes_per_step"] = weights
        result["roofline"] = timer.roofline(
            weights, kv_bytes_per_token(model, llm.engine.runner.dtype), bandwidth
        )
        result["device_name"] = torch.cuda.get_device_name()
        result["cuda_graphs"] = llm.engine.runner.decode_graphs is not None
    llm.engine.close()  # the other ranks' processes
    del llm, outputs, timer
    gc.collect()  # the engine's memory (weights, KV cache, graphs) goes back before the baseline loads
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return elapsed


def run_hf(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> float:
    from modelfleet.dataplane.engine.model_runner import resolve_dtype
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0
    with torch.inference_mode():
        warm = torch.tensor([[1, 2, 3]], device=device)
        model.generate(warm, max_new_tokens=2, do_sample=True, pad_token_id=pad_id)
    start = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch_size):
        batch = requests[i : i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=True,
                top_k=0,
                max_new_tokens=max(n for _, n in batch),
                pad_token_id=pad_id,
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_quantized(
    args: argparse.Namespace, requests: list[tuple[list[int], int]], result: dict, fmt: str
) -> dict:
    """The engine on the `fmt` artifact of args.model (built beside it), in the same run as the source's:
    its rates, and its own weight bytes and roofline on a GPU."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{fmt}-") as tmp:
        model = quantized_artifact(args.model, fmt, tmp, args.device, args.quantize_lm_head)
        record = {k: result[k] for k in ("copy_bandwidth_gbps",) if k in result}
        elapsed = run_engine(args, requests, record, model=model)
    keys = ("engine_start_s", "weight_bytes_per_step", "roofline")
    return rates(elapsed, requests) | {k: record[k] for k in keys if k in record}


def rates(elapsed: float, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    num_out = sum(n for _, n in requests)
    num_total = num_out + sum(len(p) for p, _ in requests)
    return {
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round(num_total / elapsed, 1),
    }


def model_args_problem(args: argparse.Namespace) -> str | None:
    """The one-line problem with --device, --model, --preset and --quantize, or None (shared with
    latency.py)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA GPU visible to torch; run on a GPU machine or use --device cpu"
    if (args.model is None) == (args.preset is None):
        return "--model/--preset: give exactly one (a checkpoint folder or a preset shape)"
    if "fp8" in (getattr(args, "quantize", None) or []):
        from modelfleet.dataplane.quantization import QuantizationError, check_fp8_supported

        try:  # refused before any model is built, rather than after the bf16 run
            check_fp8_supported(args.device)
        except QuantizationError as exc:
            return f"--quantize fp8: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="Hugging Face checkpoint folder")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="random-weight bf16 checkpoint of this shape"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--preset-dir", default=None, help="build the preset here and keep it (reused if present)"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="engine max_model_len (a preset: the longest request)"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--hf-num-prompts", type=int, default=None, help="run the baseline on the first N prompts only"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-input-len", type=int, default=None)
    parser.add_argument("--min-output-len", type=int, default=None)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for both (default: the engine's choice, used by both)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 64 on the CPU, 256 on a GPU")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: 2048 on the CPU, 8192 on a GPU"
    )
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument(
        "--hf-batch-size", type=int, default=None, help="default: 16 on the CPU, 256 on a GPU"
    )
    parser.add_argument("--skip-hf", action="store_true", help="time our engine only")
    parser.add_argument(
        "--quantize",
        action="append",
        choices=["int8", "fp8"],
        help="also run the engine on this quantized artifact of the model (repeatable): engine_<fmt>",
    )
    parser.add_argument(
        "--quantize-lm-head", action="store_true", help="every --quantize artifact quantizes lm_head too"
    )
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="also run the engine over N ranks (after TP=1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tensor_parallel < 1:
        print("--tensor-parallel: must be at least 1", file=sys.stderr)
        return 2
    if args.quantize_lm_head and not args.quantize:
        print("--quantize-lm-head: applies to the --quantize artifacts; name one", file=sys.stderr)
        return 2
    gpu = args.device != "cpu"
    args.max_num_seqs = args.max_num_seqs or (256 if gpu else 64)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (8192 if gpu else 2048)
    args.hf_batch_size = args.hf_batch_size or (256 if gpu else 16)
    if problem := model_args_problem(args):
        print(problem, file=sys.stderr)
        return 2
    if args.model is not None and not os.path.isdir(args.model):
        print(
            f"--model: {args.model} is not a directory; make one with `modelfleet demo create DIR`",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        # The engine takes its thread count from this variable at start; the baseline from torch.
        os.environ["MODELFLEET_CPU_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bench-preset-") as tmp:
        if args.preset is not None:
            args.model = build_preset(args.preset, args.preset_dir or tmp, args.device)
        return run(args)


def run(args: argparse.Namespace) -> int:
    with open(os.path.join(args.model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    requests = make_requests(args, vocab_size)
    if args.preset is not None and args.max_model_len is None:
        args.max_model_len = max(len(p) + n for p, n in requests)
    result: dict = {
        "benchmark": "throughput",
        "model": args.preset or args.model,
        "device": args.device,
        "num_prompts": args.num_prompts,
        "input_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(n for _, n in requests),
        "input_len_range": [min(len(p) for p, _ in requests), max(len(p) for p, _ in requests)],
        "output_len_range": [min(n for _, n in requests), max(n for _, n in requests)],
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "hf_batch_size": args.hf_batch_size,
    }
    if args.quantize:
        result["quantize_lm_head"] = args.quantize_lm_head
    if args.device == "cuda":  # measured before the KV cache takes the free memory
        result["copy_bandwidth_gbps"] = round(copy_bandwidth_gbps(torch.device("cuda")), 1)
    result["engine"] = rates(run_engine(args, requests, result), requests)
    if args.tensor_parallel > 1:
        tp = args.tensor_parallel
        result[f"engine_tp{tp}"] = rates(run_engine(args, requests, result, tp), requests)
        result[f"speedup_tp{tp}"] = round(
            result[f"engine_tp{tp}"]["output_tokens_per_s"] / result["engine"]["output_tokens_per_s"], 2
        )
    for fmt in args.quantize or []:
        result[f"engine_{fmt}"] = run_quantized(args, requests, result, fmt)
        result[f"speedup_{fmt}"] = round(
            result[f"engine_{fmt}"]["output_tokens_per_s"] / result["engine"]["output_tokens_per_s"], 2
        )
    # The baseline runs with the thread count the engine chose (or was given).
    result["threads"] = torch.get_num_threads()
    if not args.skip_hf:
        hf_requests = requests[: args.hf_num_prompts] if args.hf_num_prompts else requests
        result["hf_num_prompts"] = len(hf_requests)
        # Each side is credited with the tokens of the prompts it ran.
        result["hf"] = rates(run_hf(args, hf_requests), hf_requests)
        result["ratio_output_tokens_per_s"] = round(
            result["engine"]["output_tokens_per_s"] / result["hf"]["output_tokens_per_s"], 2
        )
        result["ratio_total_tokens_per_s"] = round(
            result["engine"]["total_tokens_per_s"] / result["hf"]["total_tokens_per_s"], 2
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

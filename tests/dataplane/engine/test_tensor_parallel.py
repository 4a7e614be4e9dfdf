"""Tensor parallelism on the CPU (gloo): the engine split over 2 and 4 processes gives TP=1's greedy tokens
for every architecture, through preemption and prefix caching; a rank that dies fails the engine, which
the model manager replaces, and leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from modelfleet.dataplane import SamplingParams
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.llm_engine import LLMEngine
from modelfleet.dataplane.models import ModelConfig, kv_cache_block_bytes, load_model
from modelfleet.dataplane.parallel.sharding import check_tensor_parallel, split_heads, vocab_range
from modelfleet.dataplane.quantization import quantize
from safetensors.torch import load_file, save_file

from .hf_checkpoints import ARCHITECTURES, COMMON

# 4 heads and 2 KV heads: over 4 ranks each KV head is held by two ranks.
ARCHS = ["llama-biases", "mistral-sliding-window", "qwen2-qkv-bias-tied", "qwen3-qk-norm"]
NUM_BLOCKS = 9  # of 16 tokens: six sequences of up to 60 tokens need 24, so some are preempted
SHARED = [(7 * j + 3) % 500 for j in range(32)]  # two full blocks every prompt starts with
PROMPTS = [SHARED + [(11 * i + j) % 500 for j in range(3 + i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def make_tp_checkpoint(out_dir: Path, architecture: str) -> Path:
    """The engine tests' tiny checkpoints; "llama-biases" adds o_proj and MLP biases (row-parallel
    biases are added once) and a vocabulary of 509 (shards padded over 2 and 4 ranks)."""
    import transformers

    name = "llama2" if architecture == "llama-biases" else architecture
    config_class, extra = ARCHITECTURES[name]
    settings = {**COMMON, **extra}
    if architecture == "llama-biases":
        settings.update(vocab_size=509, attention_bias=True, mlp_bias=True)
    config = getattr(transformers, config_class)(**settings)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in param_name:
                param.normal_(1.0, 0.1)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {arch: make_tp_checkpoint(root / arch, arch) for arch in ARCHS}


def engine_settings(model_dir: Path, tp: int) -> dict:
    block_bytes = kv_cache_block_bytes(ModelConfig.from_dir(model_dir), 16, torch.float32, tp)
    return dict(
        device="cpu",
        dtype="float32",
        max_model_len=128,
        kv_cache_bytes=NUM_BLOCKS * block_bytes,
        tensor_parallel_size=tp,
    )


def run(model_dir: Path, tp: int) -> tuple[dict[str, list[int]], LLMEngine]:
    """Greedy tokens of PROMPTS; the first prompt runs a step ahead, so that the others find its
    blocks in the prefix cache."""
    engine = LLMEngine.from_kwargs(model_dir, **engine_settings(model_dir, tp))
    tokens: dict[str, list[int]] = {}
    try:
        engine.add_request("0", PROMPTS[0], GREEDY, stream=False)
        steps = 0
        while engine.has_unfinished_requests() or engine._launched is not None:
            steps += 1
            if steps == 3:
                for i, prompt in enumerate(PROMPTS[1:], start=1):
                    engine.add_request(str(i), prompt, GREEDY, stream=False)
            for output in engine.step():
                tokens[output.request_id] = output.token_ids
    finally:
        engine.close()
    return tokens, engine


_REFERENCE: dict[str, dict[str, list[int]]] = {}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_gives_the_single_rank_tokens(checkpoints, arch, tp):
    model_dir = checkpoints[arch]
    if arch not in _REFERENCE:
        _REFERENCE[arch] = run(model_dir, 1)[0]
    tokens, engine = run(model_dir, tp)
    assert len(tokens) == len(PROMPTS) and all(len(t) == GREEDY.max_tokens for t in tokens.values())
    assert tokens == _REFERENCE[arch]
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate > 0
    assert engine.runner.num_blocks == NUM_BLOCKS
    assert not any(p.is_alive() for p in engine.runner.workers.processes)


def test_each_rank_holds_its_slice(checkpoints):
    """Rank 1 of 4 reads only its rows and columns: its KV head is the one its query heads read."""
    from modelfleet.dataplane.parallel.group import TensorParallelGroup

    class Rank1Of4(TensorParallelGroup):
        def __init__(self) -> None:  # no collectives: the model is only built and loaded here
            self.rank, self.size, self.device = 1, 4, torch.device("cpu")

    model_dir = checkpoints["llama-biases"]
    full = load_file(model_dir / "model.safetensors")
    model = load_model(model_dir, device="cpu", dtype=torch.float32, tp=Rank1Of4())
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    q, k, v = attn.qkv_proj.weight.split(attn.qkv_sizes)
    head = 16
    torch.testing.assert_close(q, full["model.layers.0.self_attn.q_proj.weight"][head : 2 * head])
    torch.testing.assert_close(k, full["model.layers.0.self_attn.k_proj.weight"][:head])  # KV head 0
    torch.testing.assert_close(v, full["model.layers.0.self_attn.v_proj.weight"][:head])
    o = full["model.layers.0.self_attn.o_proj.weight"][:, head : 2 * head]
    torch.testing.assert_close(attn.o_proj.weight, o)
    assert attn.o_proj.bias is None  # rank 0 adds it
    down = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(down.weight, full["model.layers.0.mlp.down_proj.weight"][:, 32:64])
    embed = model.model.embed_tokens.weight  # 509 = 4 x 128 - 3: rows 128..255
    assert embed.shape == (128, 64)
    torch.testing.assert_close(embed, full["model.embed_tokens.weight"][128:256])
    assert model.lm_head.weight.shape == (128, 64)


def test_int8_checkpoint_shards_consistently(checkpoints, tmp_path):
    """Per-output-channel scales follow a column-parallel weight's rows and stay whole under a
    row-parallel one, so an int8 model splits as a float one does."""
    source = checkpoints["qwen2-qkv-bias-tied"]
    out = tmp_path / "int8"
    out.mkdir()
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale"] = quantize(tensor, "int8")
        else:
            tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelfleet", "format": "int8", "group": "per-channel"}
    (out / "config.json").write_text(json.dumps(config))
    assert run(out, 2)[0] == run(out, 1)[0]


def test_splits():
    split = split_heads(32, 8, 3, 4)
    assert (split.num_heads, split.num_kv_heads, split.first_head, split.first_kv_head) == (8, 2, 24, 6)
    # 2 KV heads over 8 ranks: ranks 0-3 read KV head 0, ranks 4-7 KV head 1.
    assert [split_heads(16, 2, r, 8).first_kv_head for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(split_heads(16, 2, r, 8).num_kv_heads == 1 for r in range(8))
    assert [vocab_range(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "mlp", "tp", "message"),
    [
        (6, 6, 64, 4, "does not divide the model's 6 attention heads"),
        (12, 6, 64, 4, "6 KV heads must divide one another"),
        (8, 8, 30, 4, "does not divide the model's MLP size 30"),
    ],
)
def test_a_model_that_does_not_split_is_refused(heads, kv_heads, mlp, tp, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size: {tp} .*{message}"):
        check_tensor_parallel(tp, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp)
    check_tensor_parallel(2, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=mlp)


def test_engine_config_checks_the_setting(checkpoints):
    model_dir = checkpoints["qwen3-qk-norm"]
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention"):
        EngineConfig(model=str(model_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size: 0 must be a positive integer"):
        EngineConfig(model=str(model_dir), tensor_parallel_size=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="tensor_parallel_size: 2 exceeds the 0 GPUs"):
            EngineConfig(model=str(model_dir), tensor_parallel_size=2, device="cuda")


def worker_pids(root_pid: int) -> list[int]:
    """Every process below `root_pid` (workers, the fork server)."""
    return [p.pid for p in psutil.Process(root_pid).children(recursive=True)]


def wait_gone(pids: list[int], seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


async def test_a_dead_rank_fails_the_engine_process_and_leaves_no_process(checkpoints):
    """The GPU serving path: the engine in its own process; a worker killed mid-stream ends the stream
    with an error naming the rank, the owner's failure hook runs, and every process goes."""
    from modelfleet.dataplane.engine.engine_process import AsyncLLMProcess, EngineProcessError

    model_dir = checkpoints["qwen3-qk-norm"]
    engine = AsyncLLMProcess(model_dir, **engine_settings(model_dir, 2))
    failures: list[str] = []
    engine.on_failure = failures.append
    engine_pid = engine._process.pid
    below = worker_pids(engine_pid)
    try:
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        outputs = engine.generate(PROMPTS[0], params)
        await anext(outputs)
        workers = [p for p in psutil.Process(engine_pid).children(recursive=True) if p.ppid() != engine_pid]
        assert len(workers) == 1  # rank 1, forked by the fork server
        os.kill(workers[0].pid, signal.SIGKILL)
        dead = r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"
        with pytest.raises(EngineProcessError, match=dead):
            async for _ in outputs:
                pass
        assert failures and "rank 1" in failures[0] and engine.failure == failures[0]
        assert wait_gone([engine_pid, *below]) == []
    finally:
        engine.close()


async def test_the_server_replaces_an_engine_whose_rank_died(checkpoints):
    """The CPU serving path (the engine on a thread of the server): the model manager unloads the
    failed engine, loads the version again, and the new one serves; nothing is left after close."""
    from modelfleet.dataplane.server.loading import close_engine, load_engine
    from modelfleet.dataplane.server.model_manager import LoadState, ModelManager, VersionSpec

    model_dir = checkpoints["mistral-sliding-window"]
    settings = tuple((k, json.dumps(v)) for k, v in engine_settings(model_dir, 2).items())
    spec = VersionSpec(model="m", version="v1", artifact=str(model_dir), engine_config=settings, preload=True)
    manager = ModelManager(load_engine, estimate_bytes=lambda s: 0, close=close_engine)
    manager.sync([spec])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    try:
        async with manager.lease("m", "v1") as slot:
            first = slot.engine
            assert [o async for o in first.generate(PROMPTS[1], params)][-1].finished
        old_workers = [p.pid for p in first.engine.runner.workers.processes]
        os.kill(old_workers[0], signal.SIGKILL)
        for _ in range(200):
            await asyncio.sleep(0.1)
            slot = manager.slots[("m", "v1")]
            if slot.state is LoadState.LOADED and slot.engine is not first:
                break
        assert slot.engine is not first and first.failure is not None and "rank 1" in first.failure
        assert wait_gone(old_workers) == []
        async with manager.lease("m", "v1") as slot:
            outputs = [o async for o in slot.engine.generate(PROMPTS[1], params)]
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        new_workers = [p.pid for p in slot.engine.engine.runner.workers.processes]
    finally:
        await manager.close()
    assert wait_gone(new_workers) == []


def test_an_engine_nobody_closed_stops_its_workers_when_collected(checkpoints):
    import gc

    model_dir = checkpoints["qwen2-qkv-bias-tied"]
    engine = LLMEngine.from_kwargs(model_dir, **engine_settings(model_dir, 2))
    pids = [p.pid for p in engine.runner.workers.processes]
    assert all(psutil.pid_exists(pid) for pid in pids)
    del engine
    gc.collect()
    assert wait_gone(pids) == []

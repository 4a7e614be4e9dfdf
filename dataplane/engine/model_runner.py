"""Runs one scheduled step on the model: batch tensors from the scheduler's output, forward, sampling.

The KV cache is allocated once, here, from a byte budget (CPU) or a fraction of the device memory left
after loading the weights (accelerators); nothing is allocated per token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from modelfleet.dataplane.config import EngineConfig
from modelfleet.dataplane.engine.sampler import Sampler
from modelfleet.dataplane.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    """Aligned with SchedulerOutput.scheduled: None where the step sampled nothing for a sequence."""

    token_ids: list[int | None]
    logprobs: list[dict[int, float] | None]
    errors: list[str | None]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from modelfleet.dataplane.device import default_dtype

    # "auto": bf16 where the hardware computes it natively (about 4x float32's matmul speed on an
    # AVX512-BF16 CPU), else float32 on CPUs and fp16 on older GPUs.
    return default_dtype(device) if name == "auto" else _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int | None = None) -> None:
        from modelfleet.dataplane.device import resolve_device
        from modelfleet.dataplane.models import kv_cache_block_bytes, load_model

        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            from modelfleet.dataplane.device import configure_cpu_threads

            logger.info("CPU threads: %d", configure_cpu_threads())
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model = load_model(config.model, device=self.device, dtype=self.dtype)
        self.model_config = self.model.config
        self.max_model_len = max_model_len or self.model_config.max_position_embeddings

        self.block_bytes = kv_cache_block_bytes(self.model_config, self.block_size, self.dtype)
        budget = self._kv_cache_budget(config)
        # Blocks beyond what max_num_seqs sequences of max_model_len tokens can fill would never be used.
        max_useful = config.max_num_seqs * -(-self.max_model_len // self.block_size)
        self.num_blocks = min(budget // self.block_bytes, max_useful)
        if self.num_blocks < 1:
            field = "kv_cache_bytes" if self.device.type == "cpu" else "kv_cache_memory_fraction"
            raise ValueError(
                f"{field}: the KV-cache budget of {budget} bytes holds no block of {self.block_bytes} bytes; "
                "raise it"
            )
        mc = self.model_config
        shape = (mc.num_layers, 2, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        logger.info(
            "KV cache: %d blocks of %d tokens, %.1f MiB (%s, %s); budget %.1f MiB",
            self.num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.dtype,
            self.device,
            budget / 2**20,
        )
        self.sampler = Sampler(self.device, seed=config.seed)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _kv_cache_budget(self, config: EngineConfig) -> int:
        """Bytes for the KV cache: the byte budget on the CPU, a share of what the weights left free
        on accelerators."""
        from modelfleet.dataplane.device import memory_info

        if self.device.type == "cpu":
            return config.kv_cache_bytes
        return int(memory_info(self.device).free_bytes * config.kv_cache_memory_fraction)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        from modelfleet.dataplane.attention import AttentionMetadata

        scheduled = out.scheduled
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = starts + query_lens
        cu_query = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu_query[1:])
        num_tokens = int(cu_query[-1])

        input_ids: list[int] = []
        for s in scheduled:
            input_ids.extend(
                s.seq.token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens]
            )
        # Position of each token: its index in the flat batch, shifted to where its sequence starts.
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens) - cu_query[seq_index] + starts[seq_index]

        max_blocks = max(len(s.seq.block_ids) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            ids = s.seq.block_ids
            block_tables[i, : len(ids)] = ids
        bs = self.block_size
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(device),
            query_start_loc=torch.from_numpy(cu_query.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_tables).to(device),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.from_numpy(positions).to(device),
            self.kv_caches,
            metadata,
        )

        sampling_rows = [i for i, s in enumerate(scheduled) if s.samples]
        token_ids: list[int | None] = [None] * num_seqs
        logprobs: list[dict[int, float] | None] = [None] * num_seqs
        errors: list[str | None] = [None] * num_seqs
        if not sampling_rows:
            return StepResult(token_ids, logprobs, errors)
        last_token_index = torch.from_numpy(cu_query[1:][sampling_rows] - 1).to(device)
        logits = self.model.compute_logits(hidden[last_token_index])
        sampled = self.sampler(logits, [scheduled[i].seq for i in sampling_rows])
        for row, i in enumerate(sampling_rows):
            token_ids[i] = sampled.token_ids[row]
            logprobs[i] = sampled.logprobs[row]
            errors[i] = sampled.errors[row]
        return StepResult(token_ids, logprobs, errors)

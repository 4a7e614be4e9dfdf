"""Turns the last-position logits of a step into next tokens (and log-probabilities), one row per request.

Each row is processed from its own parameters only, and a request with a seed draws its noise from its
own generator, so its tokens do not depend on what else is in the batch. A row whose logits are NaN
fails that request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from modelfleet.dataplane.engine.device_copy import to_device
from modelfleet.dataplane.engine.sequence import Sequence
from modelfleet.dataplane.engine.structured import BegunMasks, GrammarMasks, fill_threads
from modelfleet.dataplane.sampling_params import SamplingParams

if TYPE_CHECKING:
    from modelfleet.dataplane.kernels.host_signal import MaskReady

# On the device, per row: the chosen token's log-probability, the top-N values and their ids.
TopLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: {token_id: logprob} for the top-N plus the chosen token, or None when not asked for.
    logprobs: list[dict[int, float] | None]
    # Per row: None, or why the request failed.
    errors: list[str | None]


class SampledBatch:
    """A step's sampled tokens: on the device at once (`token_ids`, for the next step's inputs), on the
    host once `result()` (or `host_token_ids()`, the ids alone) is called. The copy to the host is
    queued behind the sampling, so the host can launch more work before it waits.

    `pairs`: int64 [N, 2], each row's token and whether its logits held a NaN (as a decode graph's
    sampling head returns them: model_decode_runner)."""

    def __init__(
        self, pairs: torch.Tensor, logprobs: TopLogprobs | None, params: list[SamplingParams]
    ) -> None:
        self.token_ids = pairs[:, 0]
        self._params = params
        device_side = (pairs, *(logprobs or ()))
        self._has_logprobs = logprobs is not None
        self._token_list: list[int] | None = None
        self._bad_list: list[int] = []
        self._buffer: torch.Tensor | None = None  # the pinned buffer _host[0] lies in, until read
        if pairs.device.type == "cuda":
            self._buffer = _pinned_buffer(pairs)
            host_pairs = self._buffer[: pairs.shape[0]].copy_(pairs, non_blocking=True)
            self._host = (host_pairs, *(_to_pinned_host(t) for t in logprobs or ()))
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = device_side, None

    @classmethod
    def of(
        cls,
        token_ids: torch.Tensor,
        bad_rows: torch.Tensor,
        logprobs: TopLogprobs | None,
        params: list[SamplingParams],
    ) -> SampledBatch:
        """From the tokens and NaN flags as two tensors (the samplers outside a graph)."""
        return cls(torch.stack([token_ids, bad_rows.to(token_ids.dtype)], dim=1), logprobs, params)

    def host_token_ids(self) -> list[int]:
        """The sampled ids on the host; waits for this step alone, not for the steps queued after it."""
        if self._token_list is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._token_list, self._bad_list = self._host[0].t().tolist()
            if self._buffer is not None:  # read: its pinned buffer goes to the next batch
                _FREE_PAIRS.append(self._buffer)
                self._buffer = None
        return self._token_list

    def result(self) -> SamplerOutput:
        token_list = self.host_token_ids()
        logprobs = self._host[1:]
        errors: list[str | None] = [
            "the model produced NaN logits" if bad else None for bad in self._bad_list
        ]
        logprob_dicts: list[dict[int, float] | None] = [None] * len(token_list)
        if self._has_logprobs:
            chosen, top_values, top_ids = logprobs
            logprob_dicts = _logprob_dicts(token_list, chosen, top_values, top_ids, self._params)
        return SamplerOutput(token_ids=token_list, logprobs=logprob_dicts, errors=errors)


# Pinned buffers free to take for a batch's (token, NaN flag) pairs (_pinned_buffer): a batch gives its
# own back once read. A pinned allocation a step took 2-6% of a decode step's host time (py-spy, H200).
_FREE_PAIRS: list[torch.Tensor] = []


def _pinned_buffer(pairs: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer that holds `pairs`' rows: one a batch before has read, else a new one."""
    rows = pairs.shape[0]
    while True:
        try:
            buffer = _FREE_PAIRS.pop()
        except IndexError:  # none free (engines on other threads of this process share them)
            break
        if buffer.shape[0] >= rows and buffer.dtype == pairs.dtype:
            return buffer
    with torch.inference_mode(False):  # a batch made under inference mode passes it to one made outside
        return torch.empty((max(rows, 64), 2), dtype=pairs.dtype, pin_memory=True)


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


class PendingSample:
    """A step's sampling begun by `Sampler.begin`: `finish()` queues the rest (once) and gives its batch,
    the sampler's latest from then on."""

    def __init__(
        self, sampler: Sampler, rest: Callable[[], SampledBatch], begun_masks: BegunMasks | None
    ) -> None:
        self.begun_masks = begun_masks
        self._sampler = sampler
        self._rest: Callable[[], SampledBatch] | None = rest
        self._batch: SampledBatch | None = None

    @property
    def done(self) -> bool:
        """Whether the sampling is queued (finish has run)."""
        return self._rest is None

    @torch.inference_mode()
    def finish(self) -> SampledBatch:
        """Waits for the grammar fill (raising its error), then queues the masking and the sampling."""
        if self._rest is not None:
            self._batch = self._rest()
            self._rest = None
            self._sampler._previous = self._batch
        assert self._batch is not None
        return self._batch


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, *, fused: bool | None = None) -> None:
        self.device = device
        # Noise for requests without a seed of their own.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # One Triton kernel for batches that need only temperatures (see _sample_fused); None: where
        # Triton runs.
        if fused is None:
            from modelfleet.dataplane.kernels import triton_usable

            fused = device.type == "cuda" and triton_usable()
        self.fused = fused
        self._seeds = np.random.default_rng(seed)
        self._grammar_masks: GrammarMasks | None = None  # made with the first constrained row
        self._fill_threads = fill_threads()
        # The latest batch: a grammar reads from it the token its row sampled there, if still in flight.
        self._previous: SampledBatch | None = None

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        """Queues the sampling of one token per row (no wait on the device). logits: [N, vocab], any
        float dtype (the torch path computes in float32)."""
        return self.begin(logits, seqs, overlap=False).finish()

    @torch.inference_mode()
    def begin(self, logits: torch.Tensor, seqs: list[Sequence], *, overlap: bool = True) -> PendingSample:
        """`sample` in two halves. With constrained rows and `overlap`, this queues what needs no grammar
        mask and begins the masks (the matchers follow the previous batch's tokens, then their bitmask
        fills on a worker thread); `PendingSample.finish()` queues the rest. Otherwise the whole sampling
        is queued here. Between the two the caller may do its own host work (process the step before,
        plan the next), but none that adds or drops rows or changes their parameters: finish reads
        nothing else of a row (its grammar, its generator: both used only here)."""
        params = [s.params for s in seqs]
        # A constrained row whose sampling needs only a temperature is one for the fused sampler once masked.
        if self.fused and all(s.temperature_only for s in seqs):
            masks = self._begin_grammars(logits.shape, logits.device, seqs, overlap)
            inputs = self._fused_inputs(seqs, logits.device)
            pending = PendingSample(self, lambda: self._sample_fused(logits, params, inputs, masks), masks)
        else:
            pending = self._begin_torch(logits, seqs, params, overlap)
        if pending.begun_masks is None or not overlap:
            pending.finish()
        return pending

    def _begin_torch(
        self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams], overlap: bool
    ) -> PendingSample:
        logits = logits.float()
        # A NaN row fails its request alone; its logits are zeroed so that the others compute as usual.
        # Whether any row is bad is read back together with the tokens: one transfer per step.
        bad_rows = torch.isnan(logits).any(dim=1)
        logits = logits.masked_fill(bad_rows.unsqueeze(1), 0.0)

        # Log-probabilities are reported for the model's own distribution, before any sampling setting.
        num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if num_logprobs is not None else None

        if any(s.has_penalties for s in seqs):
            logits = apply_penalties(logits, seqs)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, params)
        masks = self._begin_grammars(logits.shape, logits.device, seqs, overlap)

        def finish() -> SampledBatch:
            masked = self._mask(logits, masks)
            greedy = [p.greedy for p in params]
            token_ids = masked.argmax(dim=-1) if all(greedy) else self._sample(masked, seqs, greedy)
            logprobs = None
            if num_logprobs is not None:
                logprobs = _top_logprobs(raw_logprobs, token_ids, num_logprobs)
            return SampledBatch.of(token_ids, bad_rows, logprobs, params)

        return PendingSample(self, finish, masks)

    def _begin_grammars(
        self,
        shape: tuple[int, int],
        device: torch.device,
        seqs: list[Sequence],
        overlap: bool,
        ready: MaskReady | None = None,
    ) -> BegunMasks | None:
        if all(s.grammar is None for s in seqs):
            if ready is not None:
                ready.mark([])
            return None
        return self.grammar_masks.begin(shape, device, seqs, self._previous, background=overlap, ready=ready)

    @property
    def grammar_masks(self) -> GrammarMasks:
        """The grammars' per-step work, made with the first constrained row (xgrammar loads then)."""
        if self._grammar_masks is None:
            self._grammar_masks = GrammarMasks(self._fill_threads)
        return self._grammar_masks

    def begin_masks(
        self,
        seqs: list[Sequence],
        vocab_size: int,
        device: torch.device,
        ready: MaskReady,
        *,
        overlap: bool = True,
    ) -> BegunMasks | None:
        """The grammars' half of a step whose sampling runs elsewhere (a decode graph's masked head,
        ModelRunner): the matchers follow the previous batch's tokens, then the bitmask and its row flags
        fill into `ready`'s (the head's host mirror; on a worker thread with `overlap`) and its number is
        released; `grammar_masks.wait` raises the fill's error, if any. None: no row is constrained any
        more (released already)."""
        return self._begin_grammars((len(seqs), vocab_size), device, seqs, overlap, ready)

    def _mask(self, logits: torch.Tensor, masks: BegunMasks | None) -> torch.Tensor:
        if masks is None:
            return logits
        return self.grammar_masks.finish(masks, logits)

    def _fused_inputs(self, seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused sampler's temperatures and seeds (fused_parameters), on the device."""
        temperature, seeds = self.fused_parameters(seqs)
        return to_device(temperature, device), to_device(seeds, device)

    def fused_parameters(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """The fused sampler's temperatures (float32, 0 for greedy) and seeds (int64), on the host. Read
        when the sampling begins: a seed's token index counts the row's tokens in flight, which the next
        step's planning raises."""
        seeds = self._seeds.integers(1, 1 << 62, size=len(seqs))
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                index = seq.num_output_tokens + seq.num_inflight
                seeds[i] = hash((seq.params.seed, index)) & ((1 << 62) - 1)
        temperature = np.fromiter(
            (0.0 if s.params.greedy else s.params.temperature for s in seqs),
            dtype=np.float32,
            count=len(seqs),
        )
        return temperature, seeds

    def graph_sampled(self, pairs: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        """The batch a decode graph's sampling head gave (fused_parameters were its inputs); the latest
        from then on, as if sampled here."""
        batch = SampledBatch(pairs, None, [s.params for s in seqs])
        self._previous = batch
        return batch

    def _sample_fused(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        inputs: tuple[torch.Tensor, torch.Tensor],
        masks: BegunMasks | None,
    ) -> SampledBatch:
        """Greedy and temperature rows in one pass over the logits (Gumbel-max with counter-based noise),
        the grammars' bitmask read in the same pass. A request with a seed draws from (its seed, the
        index of the token): batch-independent."""
        from modelfleet.dataplane.kernels.sampling import sample_tokens

        mask = None
        if masks is not None:
            mask = self.grammar_masks.finish_bitmask(masks, logits.device)
        token_ids, bad_rows = sample_tokens(logits, *inputs, mask=mask)
        return SampledBatch.of(token_ids, bad_rows, None, params)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        params = [s.params for s in seqs]
        device = logits.device
        temperature = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], dtype=logits.dtype
        )
        # Host lists reach the device through pinned memory (device_copy): no wait on the device.
        logits = logits / to_device(temperature, device).unsqueeze(1)

        if any(p.top_k_enabled or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = to_device(torch.tensor([p.min_p for p in params], dtype=probs.dtype), device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)

        # Sampling by argmax(p / E) with E ~ Exponential(1) draws from p (the exponential race).
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and not greedy[i]:
                noise[i].exponential_(generator=_request_generator(seq, device))
        sampled = (probs / noise).argmax(dim=-1)
        if any(greedy):
            greedy_mask = to_device(torch.tensor(greedy), device)
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (Hugging Face's: over prompt and output) and OpenAI's presence and frequency
    penalties (over the output only), for the rows that set them."""
    logits = logits.clone()
    vocab = logits.shape[1]
    device = logits.device
    for i, seq in enumerate(seqs):
        if not seq.has_penalties:
            continue
        p = seq.params
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = to_device(torch.tensor(seq.token_ids, dtype=torch.long), device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            out = to_device(torch.tensor(seq.output_token_ids, dtype=torch.long), device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Adds each row's own biases to its logits (ids were checked against the vocabulary on add)."""
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(token)
            values.append(float(bias))
    device = logits.device
    index = to_device(torch.tensor([rows, cols], dtype=torch.long), device)
    bias = to_device(torch.tensor(values, dtype=logits.dtype), device)
    return logits.index_put((index[0], index[1]), bias, accumulate=True)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    top_k = to_device(
        torch.tensor([min(p.top_k, vocab) if p.top_k_enabled else vocab for p in params]), device
    )
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    top_p = to_device(torch.tensor([p.top_p for p in params], dtype=logits.dtype), device)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest head whose mass reaches top_p: drop a token if the mass before it already does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= top_p.unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _request_generator(seq: Sequence, device: torch.device) -> torch.Generator:
    generator = seq.generator
    if not isinstance(generator, torch.Generator):
        generator = torch.Generator(device=device)
        generator.manual_seed(seq.params.seed)
        seq.generator = generator
    return generator


def _top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> TopLogprobs:
    """On the device: the chosen tokens' log-probabilities and the top num_logprobs (values, ids)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
    else:
        top_values, top_ids = logprobs[:, :0], token_ids[:, None][:, :0]
    return chosen, top_values, top_ids


def _logprob_dicts(
    token_list: list[int],
    chosen: torch.Tensor,
    top_values: torch.Tensor,
    top_ids: torch.Tensor,
    params: list[SamplingParams],
) -> list[dict[int, float] | None]:
    chosen_list, value_lists, id_lists = chosen.tolist(), top_values.tolist(), top_ids.tolist()
    result: list[dict[int, float] | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        entry = dict(zip(id_lists[i][: p.logprobs], value_lists[i][: p.logprobs], strict=True))
        entry[token_list[i]] = chosen_list[i]
        result.append(entry)
    return result

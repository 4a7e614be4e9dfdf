"""The engine loop: add requests, step (schedule -> run the model -> post-process), abort.

A step launches the next batch on the device before it reads back the previous batch's tokens, so the
host's work (post-processing, scheduling, preparing inputs) overlaps the device's instead of leaving it
idle between steps. Outputs therefore come one `step()` call after the tokens were computed, and a
sequence that stops on a sampled token has one more row computed for it that is thrown away.

With speculative decoding (EngineConfig.speculative_proposer) steps do not overlap: each one's tokens
are read back before the next is planned. A proposer reads the tokens on the host (an n-gram lookup),
or its model needs them as inputs (a draft model), and how many drafts a step accepts decides where the
next step's tokens sit; planning on tokens in flight would have to guess both.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelfleet.dataplane import heap
from modelfleet.dataplane.config import PREFILL_WAIT_STEPS, EngineConfig, check_prefill_fits, token_budget
from modelfleet.dataplane.engine.block_manager import BlockManager
from modelfleet.dataplane.engine.detokenizer import Handover, IncrementalDetokenizer, stream_backend
from modelfleet.dataplane.engine.host_kv import HostTier
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.scheduler import Scheduler, SchedulerOutput
from modelfleet.dataplane.engine.sequence import Sequence, SequenceStatus
from modelfleet.dataplane.engine.structured import (
    Grammars,
    check_structured,
    fill_threads,
    grammars_in_process,
)
from modelfleet.dataplane.sampling_params import SamplingParams

if TYPE_CHECKING:
    from modelfleet.dataplane.engine.model_runner import LaunchedStep
    from modelfleet.dataplane.engine.speculative import Speculator, VerifiedStep
    from modelfleet.dataplane.models.config import ModelConfig

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class PromptChecks:
    """The checks every engine runs on a request before it joins any batch, on the caller's side.
    An engine sets `tokenizer` (None: token ids only), `_tokenizer_lock` (encoding from several threads
    at once trips the fast tokenizer's internal borrow checks), `vocab_size` and `max_model_len`."""

    tokenizer: Any
    _tokenizer_lock: threading.Lock
    vocab_size: int
    max_model_len: int

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids instead of text")
            with self._tokenizer_lock:
                return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def validate(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The request's prompt tokens and parameters, or ValueError naming the field."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
        else:
            params.validate()
        if not isinstance(prompt, str | list | tuple):
            raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        token_ids = self.tokenize(prompt) if prompt else []
        if not token_ids:
            raise ValueError("prompt: is empty; send at least one token")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        params.check_vocab(vocab)
        if params.structured is not None:
            check_structured(params.structured, self.tokenizer)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leaves no room to generate; the maximum length is "
                f"{self.max_model_len} tokens (prompt plus output); shorten the prompt"
            )
        return token_ids, params


def _end_unscheduled(seq: Sequence, reason: str, error: str | None = None) -> None:
    """Ends a request that never joined the scheduler (its grammar was still compiling)."""
    seq.status, seq.finish_reason, seq.error = SequenceStatus.FINISHED, reason, error
    seq.finished_time = time.monotonic()


def _needs_host_tokens(scheduled: SchedulerOutput) -> bool:
    # Not a grammar: the sampler's masks follow a token still in flight themselves (engine/structured.py).
    return any(s.seq.has_penalties for s in scheduled.scheduled)


@dataclass
class _RequestState:
    seq: Sequence
    # None once the text is decoded where the outputs are written (release_text).
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    num_reported_tokens: int = 0
    logprobs: list[dict[int, float]] | None = field(default=None)
    # False: no one reads this request's outputs before it finishes (LLM.generate), so steps build none,
    # and its text is decoded once at the end unless stop strings need it every step.
    stream: bool = True
    # Whether each step detokenizes this request's new tokens.
    detokenize_each_step: bool = True
    # Outputs carry only what is new (SamplingParams.output_kind "delta").
    delta: bool = False
    # Output tokens fed to the detokenizer, and text it gave that no output has carried yet.
    num_detokenized: int = 0
    pending_text: str = ""


class LLMEngine(PromptChecks):
    def __init__(self, config: EngineConfig, runner_class: Any = None) -> None:
        """runner_class(config, max_model_len): ModelRunner, or GraphRunner for an exported graph."""
        from modelfleet.dataplane.engine.model_runner import ModelRunner
        from modelfleet.dataplane.models.config import ModelConfig
        from transformers import AutoTokenizer

        self.config = config
        model_config = ModelConfig.from_dir(config.model)
        model_max = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len: {config.max_model_len} exceeds the model's maximum length {model_max}"
            )
        max_model_len = config.max_model_len or model_max
        if not config.enable_chunked_prefill and config.max_num_batched_tokens is not None:
            check_prefill_fits(config.max_num_batched_tokens, max_model_len)  # before the model loads

        self.tokenizer = load_tokenizer(AutoTokenizer, config.model)
        # Encoding from several threads at once trips the fast tokenizer's internal borrow checks.
        self._tokenizer_lock = threading.Lock()
        runner_config = _runner_config(config, model_config)
        self.runner = (runner_class or ModelRunner)(runner_config, max_model_len)
        max_model_len = self.runner.max_model_len  # a runner may take fewer tokens (an engine profile)
        self.model_config = self.runner.model_config
        self.vocab_size = self.model_config.vocab_size
        cache_tokens = self.runner.num_blocks * config.block_size
        if cache_tokens < max_model_len:
            logger.warning(
                "max_model_len lowered from %d to %d: the KV cache holds no more tokens",
                max_model_len,
                cache_tokens,
            )
            max_model_len = cache_tokens
        self.max_model_len = max_model_len
        decode_graphs = getattr(self.runner, "decode_graphs", None) is not None
        whole_prompt = 0 if config.enable_chunked_prefill else max_model_len
        self.max_num_batched_tokens = token_budget(
            config.max_num_batched_tokens, config.max_num_seqs, decode_graphs, whole_prompt
        )
        speculates = config.speculative_proposer != "none"
        # Piecewise graphs, unless turned off; speculative steps run through the speculator's own forward.
        if isinstance(self.runner, ModelRunner) and config.piecewise_graphs and not speculates:
            self.runner.capture_piecewise(self.max_num_batched_tokens)
        eos = set(self.model_config.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        # Made at start on a GPU (_prepare_structured), else with the first structured request.
        self._grammars: Grammars | None = None
        self._prepare_structured()
        # Requests whose grammar a worker is compiling: they join the scheduler once it is ready.
        self._compiling: dict[str, tuple[Sequence, Future[Any]]] = {}

        # Prefix-cache blocks evicted from the KV cache spill to host memory (engine/host_kv.py).
        self.host_tier: HostTier | None = None
        if config.host_kv_cache_bytes and config.enable_prefix_caching:
            self.host_tier = HostTier(self.runner, config.host_kv_cache_bytes)
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            host=None if self.host_tier is None else self.host_tier.pool,
        )
        num_speculative_tokens = config.num_speculative_tokens if speculates else 0
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_speculative_tokens=num_speculative_tokens,
            prefill_wait_steps=self._prefill_wait_steps(config),
        )
        self.speculator: Speculator | None = None
        if speculates:
            from modelfleet.dataplane.engine.speculative import Speculator

            if not isinstance(self.runner, ModelRunner):
                raise ValueError("speculative_proposer: speculative decoding needs the torch model runner")
            self.speculator = Speculator(
                self.runner,
                config.speculative_proposer,
                config.num_speculative_tokens,
                config.speculative_draft_model,
                config.seed,
                cuda_graphs=not config.enforce_eager,
            )
        self._requests: dict[str, _RequestState] = {}
        # The step on the device whose tokens have not been read back yet.
        self._launched: tuple[SchedulerOutput, LaunchedStep] | None = None
        if self.runner.device.type == "cuda":
            self._warm_up()
            # A full garbage collection scans every object alive (the libraries', the model's: tens of
            # ms) and would stall the GPU in the middle of a step; what exists now lives as long as the
            # engine, so it is left out of collections from here on.
            heap.freeze(collect=True)

    def _warm_up(self) -> None:
        """Runs a few requests through every path of a step (a full-budget prefill chunk, its cached-
        context continuation, short prompts joining running decodes, greedy and sampled tokens), so that
        kernels are compiled and libraries have chosen their algorithms before the first real request,
        rather than during it. Then forgets them: no cached prefix, no statistics."""
        vocab = self.model_config.vocab_size
        longest = min(self.max_num_batched_tokens + 37, self.max_model_len - 4)
        lengths = sorted({max(longest, 1), min(5, longest), min(64, longest)}, reverse=True)
        for i, length in enumerate(lengths):
            prompt = [(j * 7919 + i) % vocab for j in range(length)]
            params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=float(i % 2))
            self.add_request(f"warm-up-{i}", prompt, params, stream=False)
        while self.has_unfinished_requests() or self._launched is not None:
            self.step()
        self.block_manager.reset_prefix_cache()
        self.block_manager.num_query_tokens = self.block_manager.num_hit_tokens = 0
        self.block_manager.num_host_hit_tokens = self.block_manager.num_spills = 0
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.reset_counts()

    @classmethod
    def from_kwargs(cls, model: Any, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(model, **kwargs))

    @property
    def failure(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), or None."""
        return getattr(self.runner, "failure", None)

    def set_failure_hook(self, hook: Any) -> None:
        """`hook(reason)` is called, from a monitor thread, when a tensor-parallel rank dies."""
        workers = getattr(self.runner, "workers", None)
        if workers is not None:
            workers.on_failure = hook

    def close(self) -> None:
        """Stops the tensor-parallel worker processes (nothing to stop with one rank)."""
        if self._grammars is not None:
            self._grammars.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        arrival_time: float | None = None,
        validated: tuple[list[int], SamplingParams] | None = None,
        stream: bool = True,
    ) -> None:
        """`stream=False`: `step` returns this request's output only once it has finished."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: {priority!r} must be an integer (lower runs first)")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        token_ids, params = validated or self.validate(prompt, params)
        compiled = self._compile(params)
        # A grammar compiled already (or failed: ValueError, before anything is queued) is used now.
        grammar = self._matcher(compiled) if compiled is not None and compiled.done() else None
        seq = Sequence(
            request_id,
            token_ids,
            params,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time,
        )
        seq.grammar = grammar
        if compiled is None or grammar is not None:
            self.scheduler.add(seq)
        else:
            self._compiling[request_id] = (seq, compiled)
        detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop)
        self._requests[request_id] = _RequestState(
            seq,
            detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            stream=stream,
            detokenize_each_step=stream or bool(params.stop),
            delta=params.output_kind == "delta",
        )

    def _prepare_structured(self) -> None:
        """Where decode steps replay CUDA graphs with the sampling head (a GPU's), structured output is made
        ready at start: else the first constrained request stalls every stream while xgrammar loads and
        builds the tokenizer's grammar vocabulary (~0.5 s) and the masked sampling kernel compiles (~0.85
        s on an H200, on the engine thread). Without xgrammar or a tokenizer nothing is made; a
        constrained request then fails with that error, as before. The grammars live in a process of
        their own unless MODELFLEET_GRAMMARS says otherwise (engine/grammar_process.py)."""
        from modelfleet.dataplane.engine.model_runner import ModelRunner

        in_process = grammars_in_process(default=True)  # read first: a bad value stops any engine at start
        runner = self.runner
        if self.tokenizer is None or not (isinstance(runner, ModelRunner) and runner.samples_in_graphs):
            return  # other runners (GraphRunner's exported graphs) and the CPU's
        grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        try:
            vocab = grammars.prepare()
        except ValueError as exc:
            logger.info("structured output not prepared at start: %s", exc)
            grammars.close()
            return
        if in_process:
            _start_grammar_process(grammars)
        self._grammars = grammars
        import torch

        try:
            runner.prepare_structured(vocab)
        except torch.cuda.OutOfMemoryError:
            # The KV cache is sized already: a GPU this full compiles at the first constrained request.
            logger.warning("structured output's sampling kernels not compiled at start: out of GPU memory")

    def _compile(self, params: SamplingParams) -> Future[Any] | None:
        """A structured request's grammar, compiled on a worker thread (cached by schema), else None."""
        if params.structured is None:
            return None
        if self._grammars is None:
            grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            if grammars_in_process(default=False):  # asked for where the engine would not (a CPU's)
                _start_grammar_process(grammars)
            self._grammars = grammars
        return self._grammars.compile(params.structured)

    @staticmethod
    def _matcher(compiled: Future[Any]) -> Any:
        return Grammars.matcher(compiled.result())

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler; one whose compile failed ends with its
        error (it alone). With nothing else to run, waits a moment for a compile to end."""
        if not self.scheduler.has_unfinished() and self._launched is None:
            wait([f for _, f in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        outputs: list[RequestOutput] = []
        for request_id, (seq, compiled) in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[request_id]
            try:
                seq.grammar = self._matcher(compiled)
            except Exception as exc:  # ValueError from the compile; anything else fails this request only
                _end_unscheduled(seq, "error", str(exc))
                outputs.append(self._take_output(self._requests.pop(request_id)))
                continue
            self.scheduler.add(seq)
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request now and frees its KV blocks; returns its last output (None if unknown)."""
        seq = self.scheduler.finish(request_id, "abort")
        if request_id in self._compiling:
            seq = self._compiling.pop(request_id)[0]
            _end_unscheduled(seq, "abort")
        state = self._requests.pop(request_id, None)
        if seq is None or state is None:
            return None
        return self._take_output(state)

    def _prefill_wait_steps(self, config: EngineConfig) -> int:
        """The scheduler's hold on waiting requests: the configured one, or by default
        PREFILL_WAIT_STEPS where decode steps replay CUDA graphs (else holding gains nothing)."""
        if config.prefill_wait_steps is not None:
            return config.prefill_wait_steps
        return PREFILL_WAIT_STEPS if getattr(self.runner, "decode_graphs", None) is not None else 0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def step(self) -> list[RequestOutput]:
        """Launches the next step, then processes the tokens of the one launched before it."""
        outputs: list[RequestOutput] = self._admit_compiled() if self._compiling else []
        if self.host_tier is not None:
            self.host_tier.poll(self.block_manager)
        scheduled = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        if self.host_tier is not None:  # spills before the step that may overwrite their blocks
            self.host_tier.issue(self.block_manager)
        launched = None
        if scheduled is not None and self._launched is not None and _needs_host_tokens(scheduled):
            # Penalties read the sequence's tokens on the host: the previous step's first.
            self._finish_launched()
            outputs += self._process(*self._launched)
            self._launched = None
            # Those tokens may have ended sequences (an end-of-sequence token, a stop string): their
            # blocks are freed, so they leave this step.
            scheduled.scheduled = [
                s for s in scheduled.scheduled if s.seq.status is not SequenceStatus.FINISHED
            ]
        if scheduled is not None and not scheduled.is_empty and self.speculator is not None:
            self._finish_launched()
            # Synchronous: see the module's docstring.
            return outputs + self._process(scheduled, self.speculator.run(scheduled.scheduled))
        if scheduled is not None and not scheduled.is_empty:
            # The runner ends the step before once this one's forward is queued, where it can (launch).
            launched = (scheduled, self.runner.launch(scheduled, self._finish_launched))
        else:
            self._finish_launched()
        if self._launched is not None:
            outputs += self._process(*self._launched)
        self._launched = launched
        return outputs

    def _finish_launched(self) -> None:
        """Ends the step launched last if it waits on its grammars' bitmask fill, which has run (on a
        worker thread, or in the grammar process) since that launch, beside the engine thread's
        processing of the step before, the outputs' return, this step's planning and, on a decode
        graph, this step's inputs and forward (ModelRunner.launch); before anything reads its tokens. If
        the fill failed, that step is dropped and its error raised."""
        if self._launched is None:
            return
        try:
            self._launched[1].finish()
        except BaseException:
            self._launched = None
            raise

    def _process(
        self, scheduled: SchedulerOutput, launched: LaunchedStep | VerifiedStep
    ) -> list[RequestOutput]:
        """The step's tokens into its sequences: stop checks, detokenization, outputs."""
        result = launched.result()
        outputs: list[RequestOutput] = []
        errors = result.errors
        failed: list[tuple[str, str]] = []
        token_ids: list[int | list[int] | None] = list(result.token_ids)
        if errors.count(None) != len(errors):
            failed = [
                (item.seq.request_id, e)
                for item, e in zip(scheduled.scheduled, errors, strict=True)
                if e is not None and not item.seq.is_finished
            ]
            token_ids = [None if e is not None else t for t, e in zip(token_ids, errors, strict=True)]
        logprobs_by_id = None
        if result.logprobs.count(None) != len(result.logprobs):
            logprobs_by_id = {
                item.seq.request_id: lp for item, lp in zip(scheduled.scheduled, result.logprobs, strict=True)
            }
        requests = self._requests
        for seq in self.scheduler.update(scheduled, token_ids):
            state = requests[seq.request_id]
            if state.logprobs is not None:
                state.logprobs.append((logprobs_by_id or {}).get(seq.request_id) or {})
            output = self._post_process(state)
            if output is not None:
                outputs.append(output)
        for request_id, error in failed:
            self.scheduler.finish(request_id, "error", error=error)
            state = requests.pop(request_id)
            logger.warning("request %s failed: %s", request_id, error)
            outputs.append(self._take_output(state))
        return outputs

    def _post_process(self, state: _RequestState) -> RequestOutput | None:
        """Detokenizes and checks stop strings; the output to hand back, or None for a request that
        is not streamed and has not finished."""
        seq = state.seq
        finished = seq.status is SequenceStatus.FINISHED
        if not (state.detokenize_each_step or finished):
            return None
        # No detokenizer: a streamed request whose text is decoded where it is written (release_text).
        if state.detokenizer is not None and self._detokenize(state, finished):
            if finished:
                seq.finish_reason = "stop"  # the stop string came with the last allowed token
            else:
                self.scheduler.finish(seq.request_id, "stop")
                finished = True
        if not (state.stream or finished):
            return None
        output = self._take_output(state)
        if finished:
            del self._requests[seq.request_id]
        return output

    def _detokenize(self, state: _RequestState, finished: bool) -> bool:
        """Feeds the tokens not yet detokenized; whether a stop string was found."""
        detokenizer = state.detokenizer
        assert detokenizer is not None  # its callers skip a request whose text is decoded elsewhere
        output_token_ids = state.seq.output_token_ids
        new_token_ids = output_token_ids[state.num_detokenized :]
        state.num_detokenized = len(output_token_ids)
        new_text, stopped = detokenizer.add_tokens(new_token_ids, finished=finished)
        state.pending_text += new_text
        return stopped

    def _take_output(self, state: _RequestState) -> RequestOutput:
        """The output carrying everything since the previous one. A request that was not detokenized
        every step catches up first, as far as a streamed one would have got; one whose text is decoded
        elsewhere carries its tokens alone."""
        if state.detokenizer is not None and state.num_detokenized < state.seq.num_output_tokens:
            self._detokenize(state, finished=False)
        new_text, state.pending_text = state.pending_text, ""
        # A slice: a fresh list that no later step changes.
        return self._make_output(state, state.seq.output_token_ids[state.num_reported_tokens :], new_text)

    def stream_tokenizer(self) -> str | None:
        """The tokenizer (its JSON) that decodes a streamed request's text outside the engine exactly as
        the engine would (detokenizer.StreamDecoder), or None where only the engine can."""
        backend = stream_backend(self.tokenizer)
        if backend is None:
            return None
        try:
            return backend.to_str()
        except Exception:  # a component written in Python (a custom pre-tokenizer) has no JSON
            logger.warning("the tokenizer cannot be serialized: the engine decodes every stream's text")
            return None

    def release_text(self, request_id: str) -> Handover | None:
        """Stops decoding the text of a streamed delta request whose later outputs are decoded where
        they are written (a stream relay, given stream_tokenizer()); its outputs then carry new tokens
        and no text. Returns where that decoder starts, or None where the text must stay here (stop
        strings, a tokenizer without a stream decoder, a request not streamed in deltas)."""
        state = self._requests.get(request_id)
        if state is None or state.detokenizer is None or not (state.stream and state.delta):
            return None
        if state.pending_text:  # text no output has carried yet: this request's text stays here
            return None
        seq = state.seq
        handover = state.detokenizer.handover(seq.token_ids[: seq.num_prompt_tokens + state.num_detokenized])
        if handover is not None:
            state.detokenizer = None
        return handover

    def _make_output(self, state: _RequestState, new_token_ids: list[int], new_text: str) -> RequestOutput:
        """The request's output. A delta output carries only what is new (no prompt, the new text and
        tokens, their logprobs); a cumulative one copies the request's growing lists. Built with the
        fields in order: once per request and step, where keyword passing was a tenth of the engine's
        per-token host time."""
        seq = state.seq
        state.num_reported_tokens += len(new_token_ids)
        logprobs = state.logprobs
        if state.delta:
            if logprobs is not None:
                logprobs = logprobs[len(logprobs) - len(new_token_ids) :]
            prompt, text, token_ids = [], new_text, list(new_token_ids)
        else:
            state.text += new_text
            if logprobs is not None:
                logprobs = list(logprobs)
            prompt, text, token_ids = seq.prompt_token_ids, state.text, list(seq.output_token_ids)
        return RequestOutput(
            seq.request_id,
            prompt,
            text,
            token_ids,
            new_text,
            new_token_ids,
            logprobs,
            seq.finish_reason,
            seq.is_finished,
            seq.error,
            seq.num_cached_tokens,
            seq.arrival_time,
            seq.first_token_time,
            seq.finished_time,
            state.delta,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
            kv_cache_usage=bm.usage,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.num_query_tokens,
            prefix_cache_hits=bm.num_hit_tokens,
            host_kv_hits=bm.num_host_hit_tokens,
            host_kv_spills=bm.num_spills,
            **self._speculative_stats(),
        )

    def _speculative_stats(self) -> dict[str, Any]:
        spec = self.speculator
        if spec is None:
            return {}
        return {
            "spec_num_drafts": spec.num_drafts,
            "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_acceptance_rate": spec.acceptance_rate,
            "spec_mean_accepted_length": spec.mean_accepted_length,
        }


def _start_grammar_process(grammars: Grammars) -> None:
    try:
        grammars.start_process(fill_threads())
    except OSError as exc:  # no shared memory to map (/dev/shm), or no process to start
        logger.warning("structured output: the grammars stay in the engine's process: %s", exc)


def _runner_config(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """The target runner's config. With speculation, no decode graphs (verify steps do not use them);
    with a draft model, whose KV cache has as many blocks as the target's, the KV budget is split
    between the two in proportion to their bytes per block."""
    import dataclasses

    if config.speculative_proposer != "none":
        # Decode graphs capture one token per sequence: a verify step has its own (speculative.py).
        config = dataclasses.replace(config, enforce_eager=True)
    if config.speculative_draft_model is None:
        return config

    import torch
    from modelfleet.dataplane.models import kv_cache_block_bytes
    from modelfleet.dataplane.models.config import ModelConfig

    draft_config = ModelConfig.from_dir(config.speculative_draft_model)
    target_bytes = kv_cache_block_bytes(model_config, config.block_size, torch.float32)
    draft_bytes = kv_cache_block_bytes(draft_config, config.block_size, torch.float32)
    share = target_bytes / (target_bytes + draft_bytes)
    return dataclasses.replace(
        config,
        kv_cache_bytes=max(1, int(config.kv_cache_bytes * share)),
        kv_cache_memory_fraction=config.kv_cache_memory_fraction * share,
    )


def load_tokenizer(auto_tokenizer: Any, model_dir: str) -> Any:
    """The checkpoint's tokenizer, or None for a checkpoint without one (token ids in and out only)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(model_dir) / name).exists() for name in names):
        logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", model_dir)
        return None
    return auto_tokenizer.from_pretrained(model_dir)

"""AsyncLLM: the engine on a background thread, streaming outputs into asyncio queues per request."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from modelfleet.dataplane.engine.llm_engine import LLMEngine, Prompt
from modelfleet.dataplane.engine.messages import Abort, Add
from modelfleet.dataplane.engine.outputs import EngineStats
from modelfleet.dataplane.engine.protocol import EngineLimits
from modelfleet.dataplane.engine.threaded import ThreadedEngine
from modelfleet.dataplane.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM(ThreadedEngine):
    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, **engine_config)
        self.engine.set_failure_hook(self._engine_failed)
        self._start("modelfleet-engine")

    def _engine_failed(self, reason: str) -> None:
        """The engine can step no more (a tensor-parallel rank died): its owner unloads it."""
        if self.failure is not None:
            return
        self.failure = reason
        if self.on_failure is not None:
            self.on_failure(reason)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def limits(self) -> EngineLimits:
        engine = self.engine
        return EngineLimits(engine.config.max_num_seqs, engine.max_model_len, engine.vocab_size)

    def validate(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        return self.engine.validate(prompt, params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _run(self) -> None:
        while not self._closed:
            self._apply_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step fails every request in flight, loudly
                logger.exception("engine step failed")
                self._fail_all(RuntimeError(f"engine step failed: {exc}"))
                if self.engine.failure is not None:
                    self._engine_failed(self.engine.failure)
                continue
            self._deliver_all((output.request_id, output) for output in outputs)
        # Closed: nothing will answer the requests still in flight, so end their streams loudly.
        self._commands.clear()
        self._fail_all(RuntimeError("AsyncLLM was closed"))

    def close(self) -> None:
        super().close()
        self.engine.close()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, Add):
                request_id = command.request_id
                if request_id not in self._streams:
                    continue  # cancelled before it was added
                try:
                    self.engine.add_request(
                        request_id, command.prompt, priority=command.priority, validated=command.validated
                    )
                except ValueError as exc:
                    self._deliver(request_id, exc)
            elif isinstance(command, Abort):
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self._deliver(command.request_id, output)

    def _fail_all(self, exc: Exception) -> None:
        failed = list(self._streams)
        for request_id in failed:
            self.engine.abort(request_id)
        self._deliver_all((request_id, exc) for request_id in failed)

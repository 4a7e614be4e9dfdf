"""AsyncLLM: the engine on a background thread, streaming outputs into asyncio queues per request."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from modelfleet.dataplane.engine.llm_engine import LLMEngine, Prompt
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Done:
    """An already-finished awaitable, so that `abort()` works with and without `await`."""

    def __await__(self):
        return iter(())


async def stream_outputs(queue: asyncio.Queue, abandon: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs as the engine thread queues them, up to the finished one (an exception queued
    instead is raised). A consumer that leaves before the end (closed or cancelled) calls `abandon`."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abandon()


class AsyncLLM:
    def __init__(self, model: str | Path, **engine_config: Any) -> None:
        self.engine = LLMEngine.from_kwargs(model, **engine_config)
        self._commands: deque[tuple] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="modelfleet-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last has finished=True. Closing the iterator aborts."""
        if self._closed:
            raise RuntimeError("AsyncLLM is closed")
        validated = self.engine.validate(prompt, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: {priority!r} must be an integer (lower runs first)")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(("add", request_id, prompt, priority, validated))
        try:
            abandon = functools.partial(self._submit, ("abort", request_id))
            async with contextlib.aclosing(stream_outputs(queue, abandon)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> Done:
        """Ends the request and frees its KV blocks before the next step; its stream ends with "abort"."""
        self._submit(("abort", request_id))
        return Done()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

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
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
        # Closed: nothing will answer the requests still in flight, so end their streams loudly.
        self._commands.clear()
        self._fail_all(RuntimeError("AsyncLLM was closed"))

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "add":
                _, request_id, prompt, priority, validated = command
                if request_id not in self._streams:
                    continue  # cancelled before it was added
                try:
                    self.engine.add_request(request_id, prompt, priority=priority, validated=validated)
                except ValueError as exc:
                    self._deliver(request_id, exc)
            else:
                output = self.engine.abort(command[1])
                if output is not None:
                    self._deliver(command[1], output)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        # RuntimeError: the caller's event loop is gone.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

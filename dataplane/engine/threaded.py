"""The caller's side of an engine that runs on its own thread: commands go to the thread through a
deque, outputs come back through one asyncio queue per request, a whole step's outputs with one
wake-up of the caller's event loop. AsyncLLM (the engine on a thread, for
every artifact format) and AsyncLLMProcess (its reader of an engine process) share it; each supplies its
checks, its limits, its "add" command and its thread loop. Both are an `Engine` (protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, Callable, Generator, Iterable
from typing import Any

from modelfleet.dataplane.engine.llm_engine import Prompt
from modelfleet.dataplane.engine.messages import Abort, Add, Command
from modelfleet.dataplane.engine.outputs import EngineStats, RequestOutput
from modelfleet.dataplane.engine.protocol import EngineLimits, FailureHook
from modelfleet.dataplane.sampling_params import SamplingParams


class Done:
    """An already-finished awaitable, so that `abort()` works with and without `await`."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


Item = RequestOutput | BaseException  # what the thread hands a request's stream


async def stream_outputs(
    queue: asyncio.Queue[Item], abandon: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs as the engine thread queues them, up to the finished one (an exception queued
    instead is raised). Outputs that piled up while the consumer was busy come as one: a server that
    falls behind sends several tokens per chunk and catches up, instead of paying its per-chunk cost
    for each. A consumer that leaves before the end (closed or cancelled) calls `abandon`."""
    finished = False
    held: Item | None = None  # taken from the queue, handed out next
    try:
        while True:
            item = held if held is not None else await queue.get()
            held = None
            if isinstance(item, BaseException):
                finished = True
                raise item
            if item.relayed is not None:  # the last: the relay wrote the rest, or the client left
                finished = item.finished
                yield item
                return
            if not item.finished and not queue.empty():
                pile = [item]
                while not pile[-1].finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException) or later.relayed is not None:
                        held = later
                        break
                    pile.append(later)
                item = merged(pile)
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            abandon()


def merged(pile: list[RequestOutput]) -> RequestOutput:
    """One output saying what a request's consecutive outputs say (`RequestOutput.followed_by` applied
    down the list), built once: a consumer that fell behind by k outputs pays for one, not k copies."""
    if len(pile) == 1:
        return pile[0]
    last = pile[-1]
    new_text = "".join([output.new_text for output in pile])
    new_token_ids = [token for output in pile for token in output.new_token_ids]
    if not last.delta:
        return dataclasses.replace(last, new_text=new_text, new_token_ids=new_token_ids)
    logprobs = None
    if last.logprobs is not None:
        logprobs = [entry for output in pile for entry in output.logprobs or ()]
    return dataclasses.replace(
        last,
        text=new_text,
        token_ids=new_token_ids,
        new_text=new_text,
        new_token_ids=new_token_ids,
        logprobs=logprobs,
    )


class ThreadedEngine(ABC):
    # Why this engine can no longer serve (its process died), or None; its owner then starts a new one.
    failure: str | None = None
    # Called with `failure` once it is set, from the engine's own thread.
    on_failure: FailureHook | None = None

    def _start(self, thread_name: str) -> None:
        self._commands: deque[Command] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Item]]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @abstractmethod
    def validate(self, prompt: Prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """The request's checks, on the caller's side: a request refused here never reaches the thread."""

    @property
    @abstractmethod
    def limits(self) -> EngineLimits:
        """What the engine runs with, once built."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Engine-wide statistics, as of the latest step."""

    # Whether the "add" command carries the checked token ids instead of the prompt (an engine process
    # needs the ids alone: a prompt text stays with the caller).
    adds_token_ids = False

    # Stream relays (engine_process.py has them; an engine on a thread has none).
    stream_relays = 0

    def _pick_relay(self, request_id: str) -> int:
        raise NotImplementedError

    def _hand_off(self, request_id: str, relay: int, sink: Any) -> None:
        raise NotImplementedError

    def _relay_over(self, request_id: str, relay: int, finished: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def _run(self) -> None:
        """The thread's loop; it ends the streams still open once the engine is closed."""

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        sink: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams the request's outputs; the last has finished=True. Closing the iterator aborts.

        With a `sink` (stream_relay.StreamSink) and stream relays, a relay writes the outputs after the
        first to the sink's socket: the stream then ends with one output carrying what it wrote
        (`relayed`; not finished if the client left)."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if self.failure is not None:
            raise RuntimeError(self.failure)
        validated = self.validate(prompt, params)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: {priority!r} must be an integer (lower runs first)")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        relay = self._pick_relay(request_id) if sink is not None and self.stream_relays else 0
        wire_prompt = validated[0] if self.adds_token_ids else prompt
        self._submit(Add(request_id, wire_prompt, priority, validated, relay))
        finished = False
        try:
            abandon = functools.partial(self._submit, Abort(request_id))
            async with contextlib.aclosing(stream_outputs(queue, abandon)) as outputs:
                async for output in outputs:
                    finished = output.finished
                    yield output
                    if relay and not finished:  # the consumer has written the first output's chunks
                        self._hand_off(request_id, relay, sink)
                        relay = -relay  # handed off (or taken back): once
        finally:
            self._streams.pop(request_id, None)
            if relay:
                self._relay_over(request_id, abs(relay), finished)

    def abort(self, request_id: str) -> Done:
        """Ends the request before its next step; its stream ends with finish_reason "abort"."""
        self._submit(Abort(request_id))
        return Done()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _submit(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: Item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: Iterable[tuple[str, Item]]) -> None:
        """Hands a whole step's outputs to their streams with one wake-up of each caller's event loop
        (not one per stream: each costs the loop a self-pipe write and read, and a callback)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = {}
        streams = self._streams
        for request_id, item in items:
            stream = streams.get(request_id)
            if stream is not None:
                loop, queue = stream
                batch = by_loop.get(loop)
                if batch is None:
                    batch = by_loop[loop] = []
                batch.append((queue, item))
        for loop, batch in by_loop.items():
            # RuntimeError: the caller's event loop is gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue[Item], Item]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)

"""Streaming a blocking decode: run it in a worker thread, hand its text to a sync or async consumer
as it comes, show only text that stays in the final answer, and stop decoding as soon as the consumer
goes away.

The work is a function of one argument, `on_text(delta)`, that decodes in the calling thread (the
worker) and reports raw text deltas through it, as `KVMemory.chat` / `generate` do; it returns a
result with a `.text` (the final answer). It holds whatever lock it needs itself, so the lock is held
by the worker and released when the work returns or raises.

Raw deltas may start with whitespace the final answer strips, and may hold the beginning of a stop
string before the whole stop string is decoded (the answer is then cut there). `VisibleText` turns
them into deltas whose concatenation is exactly the final text; the last chunk carries the result.

Cancellation: when the consumer stops reading (a generator closed or garbage collected, an async
task cancelled, an exception in the consumer), the next `on_text` call in the worker raises
`StreamCancelled`, which unwinds the decode (and releases its lock) within one token. `on_text("")`
only checks, for passes whose text is not shown (see `guided.Decoder`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

WORKER_THREAD_NAME = "kvmemory-stream"


class HasText(Protocol):
    text: str


R = TypeVar("R", bound=HasText)
Work = Callable[[Callable[[str], None]], R]


class StreamCancelled(Exception):
    """Raised inside the worker's `on_text` once the stream's consumer went away."""


@dataclass(slots=True, frozen=True)
class StreamChunk(Generic[R]):
    """One step of a stream: the text shown so far, what is new, and (last chunk only) the result."""

    text: str
    delta: str
    result: R | None = None


class VisibleText:
    """What has been shown of a streamed answer: `add(raw_delta)` returns the new visible delta."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.raw = ""
        self.shown = ""

    def _settled(self) -> str:
        text = self.raw.lstrip()
        cut = min([i for s in self.stop if (i := text.find(s)) != -1], default=-1)
        if cut != -1:  # a whole stop string: the answer ends before it
            return text[:cut].rstrip()
        # Hold back a tail that could still grow into a stop string, and trailing whitespace (the
        # final answer is stripped).
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return text[: len(text) - hold].rstrip()

    def add(self, raw_delta: str) -> str:
        self.raw += raw_delta
        text = self._settled()
        if not text.startswith(self.shown):  # cannot happen with append-only text; never un-show
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta

    def finish(self, final: str) -> str:
        """The last delta, so that everything shown adds up to the final text (nothing, when the final
        text does not continue what was shown: a caller that rewrote it, e.g. a parsed tool call)."""
        delta = final[len(self.shown):] if final.startswith(self.shown) else ""
        self.shown = final
        return delta


class _Stream:
    """A decode in its own thread, started at once, and what its consumer has been shown of it. The
    worker's events ("text", delta) / ("done", result) / ("error", exc) go to `put`; the consumer
    turns each into a chunk with `chunk(event)`."""

    def __init__(self, work: Work, put: Callable[[tuple[str, Any]], None], stop: Sequence[str],
                 cancelled: threading.Event | None = None):
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.visible = VisibleText(stop)
        self.done = False
        self._work, self._put = work, put
        threading.Thread(target=self._run, name=WORKER_THREAD_NAME, daemon=True).start()

    def on_text(self, delta: str) -> None:
        if self.cancelled.is_set():
            raise StreamCancelled("the stream's consumer went away")
        if delta:
            self._put(("text", delta))

    def _run(self) -> None:
        try:
            self._put(("done", self._work(self.on_text)))
        except BaseException as exc:  # handed to the consumer, who re-raises it in its own thread
            self._put(("error", exc))

    def chunk(self, event: tuple[str, Any]) -> StreamChunk | None:
        kind, value = event
        if kind == "error":
            raise value
        if kind == "done":
            self.done = True
            return StreamChunk(value.text, self.visible.finish(value.text), value)
        delta = self.visible.add(value)
        return StreamChunk(self.visible.shown, delta) if delta else None


def stream_text(work: Work[R], stop: Sequence[str] = ()) -> Iterator[StreamChunk[R]]:
    """Chunks of visible text while `work` decodes in a worker thread, then the last chunk with its
    result; the worker's error is raised here. Closing the iterator early stops the decode."""
    events: queue.Queue = queue.Queue()
    stream = _Stream(work, events.put, stop)
    try:
        while not stream.done:
            if (chunk := stream.chunk(events.get())) is not None:
                yield chunk
    finally:
        stream.cancelled.set()


async def astream_text(work: Work[R], stop: Sequence[str] = ()) -> AsyncIterator[StreamChunk[R]]:
    """`stream_text` for an event loop: the worker hands events over with `call_soon_threadsafe`;
    cancelling the consuming task (or closing the iterator) stops the decode."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody reads any more
            cancelled.set()

    stream = _Stream(work, put, stop, cancelled)
    try:
        while not stream.done:
            if (chunk := stream.chunk(await events.get())) is not None:
                yield chunk
    finally:
        stream.cancelled.set()

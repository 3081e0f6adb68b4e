"""Streaming a blocking decode: run it in a worker thread, hand its text deltas to a (sync or async)
consumer, and show only text that will stay in the final answer.

`KVMemory.chat` decodes in the calling thread and reports text through `on_text(delta)`. The deltas
are raw: they may start with whitespace the final answer strips, and they may hold the beginning of a
stop string before the whole stop string has been decoded (then the answer is cut there). `Visible`
turns them into deltas whose concatenation is exactly the final `Answer.text`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from kvmemory.memory.facade import Answer


class DecodeCancelled(Exception):
    """Raised inside the worker's `on_text` when the consumer stopped reading the stream."""


class Visible:
    """Tracks what has been shown of a streamed answer; `update(raw)` returns the new visible delta."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.shown = ""

    def _settled(self, raw: str) -> str:
        for s in self.stop:
            if s in raw:
                raw = raw[: raw.index(s)]
        # Hold back a tail that could still grow into a stop string ...
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(raw)), 0, -1):
                if raw.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        raw = raw[: len(raw) - hold]
        # ... and whitespace at either end, which the final answer strips.
        return raw.strip()

    def update(self, raw: str) -> str:
        text = self._settled(raw)
        if not text.startswith(self.shown):  # cannot happen with append-only text; never un-show
            return ""
        delta, self.shown = text[len(self.shown):], text
        return delta

    def finish(self, final: str) -> str:
        """The last delta, so that everything shown adds up to the final answer text."""
        delta = final[len(self.shown):] if final.startswith(self.shown) else ""
        self.shown = final
        return delta


def _start(call: Callable[[Callable[[str], None]], Answer], put: Callable[[tuple[str, Any]], None],
           cancelled: threading.Event) -> threading.Thread:
    def on_text(delta: str) -> None:
        if cancelled.is_set():
            raise DecodeCancelled("the stream's consumer went away")
        put(("text", delta))

    def work() -> None:
        try:
            put(("done", call(on_text)))
        except BaseException as e:  # handed to the consumer, who re-raises it in its own thread
            put(("error", e))

    t = threading.Thread(target=work, name="kvgraft-decode", daemon=True)
    t.start()
    return t


def stream_sync(call: Callable[[Callable[[str], None]], Answer]) -> Iterator[tuple[str, Any]]:
    """Yield ("text", raw_delta) while decoding, then ("done", Answer); re-raise the worker's error."""
    q: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    _start(call, q.put, cancelled)
    try:
        while True:
            kind, value = q.get()
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                return
    finally:
        cancelled.set()


async def stream_async(call: Callable[[Callable[[str], None]], Answer]) -> AsyncIterator[tuple[str, Any]]:
    """`stream_sync` for an event loop: the worker hands items over with `call_soon_threadsafe`."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def put(item: tuple[str, Any]) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            cancelled.set()

    _start(call, put, cancelled)
    try:
        while True:
            kind, value = await q.get()
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                return
    finally:
        cancelled.set()


def visible_stream(call: Callable[[Callable[[str], None]], Answer], stop: Sequence[str] = ()
                   ) -> Iterator[tuple[str, Any, str]]:
    """("text", shown so far, delta) while decoding, then ("done", Answer, last delta)."""
    vis, raw = Visible(stop), ""
    for kind, value in stream_sync(call):
        if kind == "text":
            raw += value
            delta = vis.update(raw)
            if delta:
                yield "text", vis.shown, delta
        else:
            yield "done", value, vis.finish(value.text)


async def avisible_stream(call: Callable[[Callable[[str], None]], Answer], stop: Sequence[str] = ()
                          ) -> AsyncIterator[tuple[str, Any, str]]:
    """`visible_stream` for an event loop."""
    vis, raw = Visible(stop), ""
    async for kind, value in stream_async(call):
        if kind == "text":
            raw += value
            delta = vis.update(raw)
            if delta:
                yield "text", vis.shown, delta
        else:
            yield "done", value, vis.finish(value.text)

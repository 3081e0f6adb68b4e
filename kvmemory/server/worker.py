"""The compute worker: one thread runs every job that touches the model or the store, one at a time,
in arrival order, fed by a bounded queue.

Why one worker: the engine is not re-entrant (the canonical runner's cache room, the store's catalogue
connection and torch's pinned intra-op threads belong to one computation at a time; see
`adapters.shared`), and concurrent forwards on the same cores would only slow each other down. So the
server serialises: HTTP handlers are async and never compute; they put a job on the queue and await
its result (or its stream of text) while the event loop keeps serving other requests, `/healthz` and
`/metrics` included.

Batching (`slots` > 1, engine/scheduler.py): `slots` worker threads take jobs, but a job runs only
while its thread holds the queue's gate, so jobs still run one at a time, in arrival order, as above;
a job gives the gate up only while its forward is in the scheduler's batch, which lets the next job
run up to its own forward and join the same steps. With `slots` = 1 nothing changes.

Back-pressure: at most `depth` jobs wait behind the running ones (one, or `slots`); past that `submit` raises `QueueFull`
at once (the route answers 429 with a JSON error), so a burst never piles up unbounded work or
memory. A job whose caller went away before it started (a cancelled await, a closed stream) is
skipped; a stream whose consumer goes away while it decodes is stopped at the next token
(`adapters.streaming.StreamCancelled`).

Shutdown (`close`): new jobs are refused (`QueueClosed`), the jobs already queued and the running one
finish, then the thread ends: an entry whose `remember` was accepted is committed before the
process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvmemory.adapters.streaming import StreamCancelled, VisibleText

WORKER_THREAD_NAME = "kvmemory-compute"


class QueueFull(Exception):
    """More jobs are waiting than the queue's depth allows (HTTP 429)."""


class QueueClosed(Exception):
    """The server is shutting down and takes no new work (HTTP 503)."""


@dataclass(slots=True)
class _Job:
    fn: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)


class ComputeQueue:
    """One worker thread and its bounded queue (see the module docstring)."""

    def __init__(self, depth: int, *, on_wait: Callable[[float], None] | None = None, slots: int = 1):
        if depth < 0:
            raise ValueError("queue depth must be >= 0")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.depth = depth
        self.slots = slots
        # held by the thread whose job runs now; a job waiting in the batch gives it up (`released`)
        self._gate = threading.Lock()
        self._holder: threading.Thread | None = None
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._closed = False
        self._on_wait = on_wait
        self._threads = [threading.Thread(target=self._run, name=WORKER_THREAD_NAME if i == 0 else
                                          f"{WORKER_THREAD_NAME}-{i}", daemon=False) for i in range(slots)]
        self._thread = self._threads[0]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ state
    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The gate given up while the calling job waits (its forward in the batch), taken back after;
        nothing where the calling thread does not hold it."""
        me = threading.current_thread()
        if self._holder is not me:
            yield
            return
        self._holder = None
        self._gate.release()
        try:
            yield
        finally:
            self._gate.acquire()
            self._holder = me

    # ------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._q.put(None)  # the other workers end too
                return
            with self._lock:
                self._waiting -= 1
                self._running += 1
            self._gate.acquire()
            self._holder = threading.current_thread()
            try:
                if job.cancelled.is_set():
                    job.done(None, asyncio.CancelledError())
                    continue
                if self._on_wait is not None:
                    self._on_wait(time.perf_counter() - job.enqueued)
                try:
                    result, error = job.fn(), None
                except BaseException as exc:  # handed to the caller, who raises it in its own task
                    result, error = None, exc
                job.done(result, error)
            finally:
                self._holder = None
                self._gate.release()
                with self._lock:
                    self._running -= 1

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise QueueClosed("the server is shutting down; retry on another instance or after restart")
            if self._waiting + self._running > self.depth + self.slots - 1:  # the running ones + `depth` waiting
                raise QueueFull(f"the request queue is full ({self._waiting} waiting, depth {self.depth}); "
                                "retry after the running requests finish")
            self._waiting += 1
            self._q.put(job)

    # ------------------------------------------------------------------ for async handlers
    async def run(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the worker and return its result (its exception is raised here). Raises
        `QueueFull` / `QueueClosed` at once when it cannot be queued."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            def set_() -> None:
                if fut.done():
                    return
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(result)

            try:
                loop.call_soon_threadsafe(set_)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        job = _Job(fn, settle)
        self._submit(job)
        try:
            return await fut
        except asyncio.CancelledError:
            job.cancelled.set()  # not started yet: skipped; running: it finishes, its result dropped
            raise

    def stream(self, work: Callable[[Callable[[str], None]], Any], visible=None) -> "TextStream":
        """Queue `work(on_text)` (a decode that reports raw text deltas through `on_text`, see
        `adapters.streaming`) and return its stream of visible text (`visible`: what turns raw
        deltas into shown ones, a `VisibleText` by default). Raises `QueueFull` / `QueueClosed`
        here, before any byte of a response is sent."""
        return TextStream(self, work, visible if visible is not None else VisibleText())

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float | None = None) -> bool:
        """Refuse new jobs, let the queued and running ones finish, end the thread. Returns whether
        it ended within `timeout`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._q.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


class TextStream:
    """A streamed job's events as an async iterator: `("text", visible_delta)` while it decodes, then
    `("done", result)`; the job's error is raised. Leaving the iteration early (a client that
    disconnected) stops the decode."""

    def __init__(self, q: ComputeQueue, work: Callable[[Callable[[str], None]], Any], visible):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.visible = visible
        self.job = _Job(lambda: work(self._on_text), self._done)
        q._submit(self.job)

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody reads any more
            self.job.cancelled.set()

    def _on_text(self, delta: str) -> None:  # in the worker
        if self.job.cancelled.is_set():
            raise StreamCancelled("the client went away")
        if delta:
            self._put(("text", delta))

    def _done(self, result: Any, error: BaseException | None) -> None:  # in the worker
        self._put(("error", error) if error is not None else ("done", result))

    def cancel(self) -> None:
        self.job.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[tuple[str, Any]]:
        try:
            while True:
                kind, value = await self.events.get()
                if kind == "error":
                    raise value
                if kind == "done":
                    yield "done", value
                    return
                delta = self.visible.add(value)
                if delta:
                    yield "text", delta
        finally:
            self.job.cancelled.set()

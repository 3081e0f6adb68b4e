"""Deferred writes: remembering an entry now and computing its KV later (`KVMemory.remember_later`).

Computing an entry's KV and proving its graft takes seconds (tens on a busy CPU), which a framework's
write path (LangGraph's `store.put`) cannot wait for. A deferred write is a `PendingWrite`: a job run
at most once, in submission order, by whichever comes first:

- the memory's writer thread (only when the job was given a `lock`: the thread holds it while it
  computes, so it never runs alongside the callers that hold the same lock);
- a call that needs the entry now (`recall` routing to it runs it in the caller's thread: the KV is
  there for the very call that asked);
- `flush()`, or the interpreter's normal exit (atexit), which run what is left in order.

A job is claimed under its lock, so two runners never compute it twice and a runner that finds it
claimed finds it finished. A failure is kept and raised by the next `flush()` (and logged at once).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("kvmemory.memory.background")

PENDING, RUNNING, DONE, CANCELLED = "pending", "running", "done", "cancelled"


class PendingWrite:
    """A deferred write: `fn` run once, under `lock` when one is given. For a remembered entry, `id`
    and `namespace` name it and `verified` is its verifier's verdict (known before the KV is)."""

    def __init__(self, fn: Callable[[], Any], *, lock=None, id: str | None = None, namespace: str | None = None,
                 verified: bool | None = None, what: str = "a deferred write"):
        self.fn = fn
        self.lock = lock
        self.id = id
        self.namespace = namespace
        self.verified = verified
        self.what = what
        self.routed = True  # a remembered entry's route: False until it is embedded (KVMemory.route_pending)
        self.texts: list[str] = []
        self.state = PENDING
        self.error: BaseException | None = None
        self.value: Any = None
        self._state_lock = threading.Lock()
        self._finished = threading.Event()
        self._callbacks: list[Callable[[PendingWrite], None]] = []

    def __repr__(self) -> str:
        return f"PendingWrite({self.what}, {self.state})"

    def done(self) -> bool:
        return self.state in (DONE, CANCELLED)

    def add_done_callback(self, fn: Callable[[PendingWrite], None]) -> None:
        """Call `fn(job)` once the job has run (at once if it has), in the thread that ran it."""
        with self._state_lock:
            if self.state != DONE:
                self._callbacks.append(fn)
                return
        fn(self)

    def _call_back(self) -> None:
        with self._state_lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:  # noqa: BLE001 - a callback must not take the writer down
                _log.warning("a callback of %s failed: %s", self.what, exc)

    def cancel(self) -> bool:
        """Drop the job if nobody has started it; True when it will never run."""
        with self._state_lock:
            if self.state == PENDING:
                self.state = CANCELLED
                self._finished.set()
            return self.state == CANCELLED

    def run(self) -> bool:
        """Run the job here unless it already ran (or runs elsewhere: then wait for it). Returns
        True when this call ran it. Never raises the job's failure (see `result`)."""
        with self.lock if self.lock is not None else contextlib.nullcontext():
            with self._state_lock:
                claimed = self.state == PENDING
                if claimed:
                    self.state = RUNNING
            if claimed:
                try:
                    self.value = self.fn()
                except BaseException as exc:  # noqa: BLE001 - kept for flush(), which raises it
                    self.error = exc
                    _log.warning("%s failed: %s", self.what, exc)
                finally:
                    with self._state_lock:
                        self.state = DONE
                    self._call_back()
                    self._finished.set()
                return True
        # Claimed by another runner: under a shared lock it has finished already; without one, wait.
        self._finished.wait()
        return False

    def result(self) -> Any:
        """Run (or wait for) the job; its value, or raise its failure."""
        self.run()
        if self.error is not None:
            raise self.error
        return self.value


class Writer:
    """The deferred writes of one memory, in order, and the thread that runs the locked ones."""

    def __init__(self, name: str = "kvmemory-writer"):
        self.name = name
        self._jobs: list[PendingWrite] = []  # submitted and not yet seen finished by flush
        self._jobs_lock = threading.Lock()
        self._queue: queue.SimpleQueue[PendingWrite] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._unraised: list[BaseException] = []
        _writers.add(self)

    def submit(self, job: PendingWrite) -> PendingWrite:
        with self._jobs_lock:
            self._jobs.append(job)
            if job.lock is not None:
                if self._thread is None or not self._thread.is_alive():
                    # A daemon: a process that exits normally runs the rest from atexit (flush_all).
                    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    self._thread.start()
                self._queue.put(job)
        return job

    def _loop(self) -> None:
        while True:
            self._queue.get().run()

    def pending(self) -> list[PendingWrite]:
        with self._jobs_lock:
            return [j for j in self._jobs if not j.done()]

    def flush(self) -> None:
        """Run or wait for every job submitted so far, in order; then raise the first failure not
        raised before (the others are logged)."""
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.run()
        with self._jobs_lock:
            finished = [j for j in jobs if j.done()]
            self._jobs = [j for j in self._jobs if j not in finished]
            self._unraised.extend(j.error for j in finished if j.error is not None)
            errors, self._unraised = self._unraised, []
        if errors:
            raise errors[0]


_writers: "weakref.WeakSet[Writer]" = weakref.WeakSet()


@atexit.register
def flush_all() -> None:
    """At a normal exit, finish every memory's deferred writes (failures are logged, not raised)."""
    for w in list(_writers):
        try:
            w.flush()
        except BaseException as exc:  # noqa: BLE001 - exiting: report, never mask the exit
            _log.error("a deferred kvmemory write failed at exit: %s", exc)

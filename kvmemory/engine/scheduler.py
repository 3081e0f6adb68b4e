"""Continuous batching for `kvmemory serve` and for concurrent Python callers (`kvmemory.share_steps`):
one thread steps a `Batch` (engine/batch.py) that every request's forward joins at the next step and
leaves when it is done.

For Python callers (`when_busy=True`) a forward joins the batch only while another forward is running or
waiting; a lone caller's forward runs as before, at no cost, and whoever comes while it runs joins the
batch, which steps once the lone forward is done.

The server's jobs stay what they were (a callable running the facade: recall, prompt, `Engine.forward`,
post-processing) and still run one at a time under the compute queue's gate (worker.py): nothing but
the forward itself ever runs concurrently, so the store, the router and the facade see the same one
caller at a time as before. What changes: when a job reaches `Engine.forward`, the engine hands the
sequence to this scheduler (`Engine.batcher`), and the job gives the gate up while its sequence is in
the batch, so the next job runs its recall and prompt and joins the same steps. When its sequence is
done the job takes the gate again and finishes.

Steps: first come, first served, decode rows first, then prompt chunks within the per-step token
budget (batch.py); a sequence starts only while the K/V positions of the running ones (prompt plus
tokens to decode, each) stay within `kv_tokens`, else it waits for one to leave. Each sequence's
`on_token` (the job's stream) is called from this thread; a stream whose client went away raises at its
next token, and its sequence leaves the batch at once, its cache freed. Every answer is the bits of the
same request computed alone (batched_step.py); where the profile cannot share rows exactly, the
sequences still interleave, each computed alone within a step.

A forward made while its thread holds the engine's pinned settings (a forward inside `verify`, say)
runs alone at once, as before; so does one made from this thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmemory.engine import determinism
from kvmemory.engine.batch import DEFAULT_TOKEN_BUDGET, Batch, BatchSequence
from kvmemory.kernels import omp_pool

SCHEDULER_THREAD_NAME = "kvmemory-batch"
DEFAULT_KV_TOKENS = 65536  # K/V positions the running sequences may hold together


@dataclass(eq=False)
class _Pending:
    kwargs: dict  # Batch.add's arguments
    done: threading.Event = field(default_factory=threading.Event)
    seq: BatchSequence | None = None
    error: BaseException | None = None


class BatchScheduler:
    """The thread that steps the batch (see the module docstring). `while_waiting` is a context
    manager factory the job's thread enters while its sequence is in the batch (the queue's gate)."""

    def __init__(self, engine, *, token_budget: int = DEFAULT_TOKEN_BUDGET, kv_tokens: int = DEFAULT_KV_TOKENS,
                 while_waiting: Callable[[], contextlib.AbstractContextManager] | None = None, when_busy: bool = False):
        self.engine = engine
        self.when_busy = when_busy  # join only while another forward runs or waits (module docstring)
        self.alone = 0  # forwards running outside the batch now (Engine.forward counts them)
        self.batch = Batch(engine, token_budget, kv_tokens=kv_tokens)
        self.while_waiting = while_waiting or contextlib.nullcontext
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._running: list[_Pending] = []
        self._closed = False
        self.steps = 0
        self.last_rows = 0
        self._thread = threading.Thread(target=self._run, name=SCHEDULER_THREAD_NAME, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ state (metrics)
    @property
    def sequences(self) -> int:
        """Sequences in the batch now (running or waiting for K/V room)."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ the engine's side
    def takes(self) -> bool:
        """Whether a forward called now, from this thread, joins the batch."""
        if self._closed or threading.current_thread() is self._thread or determinism._LOCK._is_owned():
            return False
        return not self.when_busy or bool(self.alone or self._pending or self._running)

    @contextlib.contextmanager
    def outside(self):
        """Count a forward running outside the batch while it runs (`takes`, when_busy). With when_busy
        its caller gives up what it gives up in the batch (`while_waiting`: the memory's lock) meanwhile,
        so that others route and join the batch, which steps when this forward is done."""
        with self._cond:
            self.alone += 1
        with self.while_waiting() if self.when_busy else contextlib.nullcontext():
            try:
                yield
            finally:
                with self._cond:
                    self.alone -= 1

    def forward(self, token_ids, **kwargs):
        """`Engine.forward` through the batch: (ForwardResult, GraftReport), or the sequence's error."""
        return self.forward_many([dict(kwargs, token_ids=token_ids)])[0]

    def forward_many(self, requests: list[dict]) -> list:
        """Several forwards (each a dict of `Batch.add`'s arguments) joining the batch at the same step;
        [(ForwardResult, GraftReport)] in order, or the first error among them."""
        items = [_Pending(dict(r)) for r in requests]
        with self._cond:
            self._pending.extend(items)
            self._cond.notify()
        with self.while_waiting():
            for item in items:
                item.done.wait()
        out = []
        for item in items:
            if item.error is not None:
                raise item.error
            seq = item.seq
            if seq.error is not None:
                raise seq.error
            seq.report.blocks_stored = seq.blocks_stored
            out.append((seq.result, seq.report))
        return out

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        omp_pool.keep_here()  # this thread computes step after step: the process's one OpenMP pool
        while True:
            with self._cond:
                while not self._pending and not self._running and not self._closed:
                    self._cond.wait()
                if self._closed and not self._pending and not self._running:
                    return
                new, self._pending = self._pending, []
            for item in new:
                try:
                    item.seq = self.batch.add(**item.kwargs)
                    self._running.append(item)
                except BaseException as exc:  # noqa: BLE001 - the caller's error, raised in its thread
                    item.error = exc
                    item.done.set()
            try:
                self.batch.step()
                self.steps += 1
                self.last_rows = self.batch.last_rows
            except BaseException as exc:  # noqa: BLE001 - a step that failed fails its sequences, not the server
                for item in self._running:
                    if not item.seq.done:
                        item.seq.error = exc
                        self.batch.cancel(item.seq)
            still = []
            for item in self._running:
                if item.seq.done:
                    item.done.set()
                else:
                    still.append(item)
            self._running = still

    def close(self, timeout: float | None = None) -> None:
        """Finish the sequences in the batch, then end the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)


@contextlib.contextmanager
def released(gate: Callable[[], contextlib.AbstractContextManager], lock) -> "contextlib.Generator":
    """What a job gives up while its forward is in the batch: the memory's lock (`adapters.shared`: a
    chat holds it for its whole call) when this thread holds it, however deeply, and the queue's gate.
    Taken back gate first: whoever holds the gate runs, and no job that waits holds the lock."""
    state = lock._release_save() if lock is not None and lock._is_owned() else None
    try:
        with gate():
            yield
    finally:
        if state is not None:
            lock._acquire_restore(state)


__all__ = ["BatchScheduler", "DEFAULT_KV_TOKENS", "released"]

"""What every route shares: the memory (with its lock), the compute queue, the keys, the metrics and
the settings; one `ServerState` per application, at `app.state.kv`.

Everything that reads or writes the model or the store runs on the compute queue's worker
(worker.py), including the store-wide gauges `/metrics` shows, which the worker refreshes after a
job at most every `GAUGE_REFRESH_S` seconds (a scrape never waits for the model).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvmemory.adapters.shared import SharedMemory, memory_lock
from kvmemory.memory.facade import KVMemory
from kvmemory.server.auth import KeyRing, build_keyring
from kvmemory.server.config import ServerConfig
from kvmemory.server.metrics import Metrics
from kvmemory.server.worker import ComputeQueue

GAUGE_REFRESH_S = 10.0


def kvmemory_version() -> str:
    """kvmemory's installed version (the app's and the MCP server's serverInfo version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvmemory")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass(slots=True)
class StoreGauges:
    """The store's counts as last read for /metrics. Read when /metrics is scraped and they are older than
    GAUGE_REFRESH_S, in a thread of their own (the store's readers are per thread), never on a request's
    path: a Redis store's counts are a pass over every row (O(store)), which once stalled a recall every
    10 s by a second or more (`kvmemory bench serve --two-servers`)."""

    entries: int = 0
    blocks: int = 0
    quarantined_blocks: int = 0
    bytes: int = 0
    read_at: float = 0.0

    def refresh(self, memory: KVMemory, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.read_at < GAUGE_REFRESH_S:
            return
        s = memory.store.stats()
        self.entries, self.blocks, self.quarantined_blocks, self.bytes = s.entries, s.blocks, s.quarantined_blocks, s.bytes
        self.read_at = now


@dataclass(slots=True)
class ServerState:
    memory: KVMemory
    config: ServerConfig
    keys: KeyRing
    metrics: Metrics
    queue: ComputeQueue
    gauges: StoreGauges = field(default_factory=StoreGauges)
    started: float = field(default_factory=time.time)
    scheduler: object = None  # engine/scheduler.py's BatchScheduler where batch_slots > 1

    @property
    def shared(self) -> SharedMemory:
        return SharedMemory(self.memory, memory_lock(self.memory))

    @property
    def model_ids(self) -> list[str]:
        """Every model id requests may name, the served name first: what `/v1/models` lists and what
        the 404 for another id lists (one list, so they cannot disagree)."""
        ids = [self.config.served_model_name, "kvmemory", *([self.config.model] if self.config.model else [])]
        return list(dict.fromkeys(ids))

    @property
    def model_names(self) -> set[str]:
        return set(self.model_ids)

    @classmethod
    def build(cls, memory: KVMemory, config: ServerConfig) -> "ServerState":
        gauges = StoreGauges()
        holder: dict = {}

        metrics = Metrics(gauges={
            "kvmemory_queue_waiting": ("Requests waiting for the compute worker.", lambda: holder["q"].waiting),
            "kvmemory_queue_running": ("Requests the compute worker runs now (at most the batch slots).",
                                       lambda: holder["q"].running),
            "kvmemory_batch_sequences": ("Requests whose forwards are in the batch now.",
                                         lambda: getattr(holder.get("s"), "sequences", 0)),
            "kvmemory_batch_waiting": ("Forwards handed to the batch, not yet in it.",
                                       lambda: getattr(holder.get("s"), "waiting", 0)),
            "kvmemory_batch_rows": ("Sequences the last batched step computed.",
                                    lambda: getattr(holder.get("s"), "last_rows", 0)),
            "kvmemory_batch_slots": ("Requests whose forwards may share steps.", lambda: config.limits.batch_slots),
            "kvmemory_queue_depth_limit": ("Requests that may wait before new ones get 429.", lambda: config.limits.queue_depth),
            "kvmemory_store_entries": ("Entries in the store (read by the worker, at most every 10 s).", lambda: gauges.entries),
            "kvmemory_store_blocks": ("Blocks in the store.", lambda: gauges.blocks),
            "kvmemory_store_quarantined_blocks": ("Blocks quarantined in the store (damaged on disk).",
                                                  lambda: gauges.quarantined_blocks),
            "kvmemory_store_bytes": ("Bytes of block files in the store.", lambda: gauges.bytes),
        })
        keys = build_keyring(config.api_keys, config.keys_file)  # before the worker starts: a bad file raises
        # The router's embedder loads now, before the server (HTTP or MCP) answers: else the first question
        # that reaches a non-empty namespace pays its import and load (~1.2 s on 2 cores; a recall of an
        # empty namespace never loads it, so no warm-up request would).
        memory.router.embedder.embed(["ready"])
        slots = config.limits.batch_slots
        queue = holder["q"] = ComputeQueue(config.limits.queue_depth, on_wait=metrics.waited, slots=slots)
        st = cls(memory, config, keys, metrics, queue, gauges)
        if slots > 1:
            from kvmemory.engine.scheduler import BatchScheduler, released

            lock = memory_lock(memory)
            st.scheduler = BatchScheduler(memory.engine, kv_tokens=config.limits.batch_kv_tokens,
                                          while_waiting=lambda: released(queue.released, lock))
            memory.engine.batcher = holder["s"] = st.scheduler
        return st

    def close_scheduler(self, timeout: float | None = None) -> None:
        """End the batch's thread (after the queue's jobs ended) and give the engine back its forwards."""
        if self.scheduler is not None:
            if getattr(self.memory.engine, "batcher", None) is self.scheduler:
                self.memory.engine.batcher = None
            self.scheduler.close(timeout)

    def _refresh_gauges(self) -> None:
        try:
            self.gauges.refresh(self.memory)
        except Exception:  # a gauge is never worth failing a request for
            pass

    async def compute(self, fn):
        """Run `fn()` on the worker."""
        return await self.queue.run(fn)

    def stream(self, work, visible=None):
        """Queue `work(on_text)` on the worker and return its `TextStream` (worker.py)."""
        return self.queue.stream(work, visible)

    async def refresh_gauges(self) -> None:
        """The store gauges read again where stale, off the worker (StoreGauges)."""
        await asyncio.to_thread(self._refresh_gauges)

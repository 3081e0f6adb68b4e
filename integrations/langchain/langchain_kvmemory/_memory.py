"""The process-wide `KVMemory` the adapters borrow, with its lock, as one value.

Which instance and which lock come from `kvmemory.adapters.shared` (one per (model, store) in a process,
shared with the LlamaIndex adapters); this module pairs them for the adapters here, which hold the
lock while they compute (LangChain's `batch` and async paths call in from thread pools).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from kvmemory.adapters import shared
from kvmemory.memory.facade import KVMemory


@dataclass(slots=True, frozen=True)
class SharedMemory:
    """A KVMemory and the lock every caller holds while it computes."""

    memory: KVMemory
    lock: threading.RLock


def env_store() -> str | None:
    """$KVMEMORY_STORE when set (the adapters record it at construction, so it shows in their fields)."""
    value = os.environ.get("KVMEMORY_STORE")
    return value or None


def shared_memory(model: str | None = None, store: str | os.PathLike[str] | None = None) -> SharedMemory:
    """The process-wide KVMemory for (model, store), created on first use."""
    return wrap_memory(shared.shared_memory(model, store))


def wrap_memory(memory: KVMemory) -> SharedMemory:
    """A KVMemory (the caller's or the shared one) with its process-wide lock."""
    return SharedMemory(memory, shared.memory_lock(memory))

"""One `KVMemory` per (model, store) in a process, shared by every adapter, with the lock that
serialises its use.

Loading the embedded model takes seconds and a gigabyte, so the retriever, the chat model, the tools
and the LangGraph store all borrow the same instance. The engine runs one forward at a time (the
runner's cache, the store's catalogue connection and torch's threads are not meant to be shared by
concurrent calls), and LangChain's `batch` and async paths call in from thread pools, hence the lock.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from kvmemory.memory import KVMemory
from kvmemory.models import DEFAULT_MODEL
from kvmemory.paths import default_store_path

_registry_lock = threading.Lock()
_shared: dict[tuple[str, str], "SharedMemory"] = {}
_locks: "weakref.WeakKeyDictionary[KVMemory, threading.RLock]" = weakref.WeakKeyDictionary()


@dataclass(slots=True, frozen=True)
class SharedMemory:
    """A KVMemory and the lock every caller holds while it computes."""

    memory: KVMemory
    lock: threading.RLock


def resolve_store(store: str | os.PathLike[str] | None) -> str:
    """The absolute store folder: the given one, else $KVMEMORY_STORE, else the per-user default."""
    path = Path(store).expanduser() if store else default_store_path()
    return str(path.resolve())


def env_store() -> str | None:
    """$KVMEMORY_STORE when set (the adapters record it at construction, so it shows in their fields)."""
    value = os.environ.get("KVMEMORY_STORE")
    return value or None


def shared_memory(model: str | None = None, store: str | os.PathLike[str] | None = None) -> SharedMemory:
    """The process-wide KVMemory for (model, store), created on first use."""
    model = model or DEFAULT_MODEL
    key = (model, resolve_store(store))
    with _registry_lock:
        found = _shared.get(key)
        if found is None:
            mem = KVMemory(model=model, store=key[1])
            found = SharedMemory(mem, _lock_for(mem))
            _shared[key] = found
        return found


def wrap_memory(memory: KVMemory) -> SharedMemory:
    """A caller-provided KVMemory with its (process-wide) lock."""
    with _registry_lock:
        return SharedMemory(memory, _lock_for(memory))


def _lock_for(memory: KVMemory) -> threading.RLock:
    lock = _locks.get(memory)
    if lock is None:
        lock = threading.RLock()
        _locks[memory] = lock
    return lock

"""One `KVMemory` per (model, store) in a process, shared by every framework adapter, and the lock
that serialises its use.

Loading the embedded model takes seconds and a gigabyte, so LangChain's retriever, chat model, tools
and store and LlamaIndex's LLM, retriever and memory block all borrow the same instance when they are
built from a model name and a store path (pass `memory=` to any of them to use your own). The engine
runs one forward at a time: the runner's cache, the store's catalogue connection and torch's
intra-op threads are not meant to be shared by concurrent calls, and the frameworks' batch and async
paths call in from thread pools. Concurrent forwards would also oversubscribe the cores the profile
pinned, making every call slower (not different: each forward is self-contained).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from kvmemory.memory.facade import KVMemory
from kvmemory.models.loading import DEFAULT_MODEL
from kvmemory.paths import default_store_path
from kvmemory.store.open import is_redis_url

@dataclass(slots=True, frozen=True)
class SharedMemory:
    """A KVMemory and the lock every caller holds while it computes."""

    memory: KVMemory
    lock: threading.RLock


_registry_lock = threading.Lock()
_memories: dict[tuple[str, str], KVMemory] = {}
_locks: "weakref.WeakKeyDictionary[object, threading.RLock]" = weakref.WeakKeyDictionary()


def env_store() -> str | None:
    """$KVMEMORY_STORE when set (adapters record it at construction, so it shows in their fields)."""
    return os.environ.get("KVMEMORY_STORE") or None


def resolve_store(store: str | os.PathLike[str] | None) -> str:
    """What names the store, one spelling per store: a Redis URL as given, else the absolute folder
    (the given one, else $KVMEMORY_STORE, else the per-user default)."""
    spec = store if store else os.environ.get("KVMEMORY_STORE") or default_store_path()
    if is_redis_url(spec):
        return str(spec).strip()
    return str(Path(spec).expanduser().resolve())


def shared_memory(model: str | None = None, store: str | os.PathLike[str] | None = None) -> KVMemory:
    """The process-wide `KVMemory` for (model, store), created on first use."""
    key = (model or DEFAULT_MODEL, resolve_store(store))
    with _registry_lock:
        mem = _memories.get(key)
        if mem is None:
            mem = _memories[key] = KVMemory(model=key[0], store=key[1])
        return mem


def memory_lock(memory: KVMemory) -> threading.RLock:
    """The lock every caller holds while `memory` computes; one per engine, so two `KVMemory`
    objects over the same engine share it."""
    with _registry_lock:
        lock = _locks.get(memory.engine)
        if lock is None:
            lock = _locks[memory.engine] = threading.RLock()
        return lock


def borrow_memory(memory: KVMemory | None = None, model: str | None = None,
                  store: str | os.PathLike[str] | None = None) -> SharedMemory:
    """`memory` (the caller's own) or else the process-wide one for (model, store), with its lock."""
    if memory is None:
        memory = shared_memory(model, store)
    elif not isinstance(memory, KVMemory):
        raise TypeError(f"memory must be a kvmemory.KVMemory, got {type(memory).__name__}")
    return SharedMemory(memory, memory_lock(memory))

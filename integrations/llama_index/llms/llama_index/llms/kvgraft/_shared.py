"""One `KVMemory` per (model, store) in this process, and one decode at a time per engine.

Loading the model takes seconds and its weights take memory, so LLMs built without an explicit
`memory` share one. (Each LlamaIndex distribution is installable on its own, so each keeps this small
cache; pass the same `memory=` to all of them to share one model across distributions.)

Decodes are serialized per engine: concurrent `achat` calls would otherwise run several forwards at
once, each with the intra-op threads the execution profile pinned, oversubscribing the CPU so that
every call gets slower (the logits would be the same: each forward is self-contained).
"""

from __future__ import annotations

import os
import threading
import weakref

from kvmemory.memory import KVMemory
from kvmemory.models import DEFAULT_MODEL

_LOCK = threading.Lock()
_MEMORIES: dict[tuple[str, str], KVMemory] = {}
_ENGINE_LOCKS: "weakref.WeakKeyDictionary[object, threading.Lock]" = weakref.WeakKeyDictionary()


def shared_memory(model: str = DEFAULT_MODEL, store: str | os.PathLike[str] | None = None) -> KVMemory:
    """The process's `KVMemory` for this model and store (the default store when `store` is None)."""
    from kvmemory.paths import default_store_path

    path = os.path.realpath(os.fspath(store if store is not None else default_store_path()))
    with _LOCK:
        mem = _MEMORIES.get((model, path))
        if mem is None:
            mem = _MEMORIES[(model, path)] = KVMemory(model=model, store=path)
        return mem


def engine_lock(memory: KVMemory) -> threading.Lock:
    """The lock that serializes decoding on `memory`'s engine (shared by every KVMemory over it)."""
    with _LOCK:
        lock = _ENGINE_LOCKS.get(memory.engine)
        if lock is None:
            lock = _ENGINE_LOCKS[memory.engine] = threading.Lock()
        return lock

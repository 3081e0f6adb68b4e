"""One `KVMemory` per (model, store) in this process, for adapters built without an explicit `memory`.

Loading the model takes seconds and its weights take memory, so every memory block opened by store path
shares one. (Each LlamaIndex distribution is installable on its own, so each keeps this small cache;
pass the same `memory=` to all of them to share one model across distributions.)
"""

from __future__ import annotations

import os
import threading

from kvmemory.memory import KVMemory
from kvmemory.models import DEFAULT_MODEL

_LOCK = threading.Lock()
_MEMORIES: dict[tuple[str, str], KVMemory] = {}


def shared_memory(model: str = DEFAULT_MODEL, store: str | os.PathLike[str] | None = None) -> KVMemory:
    """The process's `KVMemory` for this model and store (the default store when `store` is None)."""
    from kvmemory.paths import default_store_path

    path = os.path.realpath(os.fspath(store if store is not None else default_store_path()))
    with _LOCK:
        mem = _MEMORIES.get((model, path))
        if mem is None:
            mem = _MEMORIES[(model, path)] = KVMemory(model=model, store=path)
        return mem

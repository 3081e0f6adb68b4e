"""One `KVMemory` per (model, store, device, dtype) in a process, shared by every framework adapter,
and the lock that serialises its use.

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
from kvmemory.errors import InvalidInput
from kvmemory.models.devices import resolve_device, resolve_dtype
from kvmemory.models.loading import DEFAULT_MODEL
from kvmemory.paths import default_store_path
from kvmemory.store.open import is_redis_url

@dataclass(slots=True, frozen=True)
class SharedMemory:
    """A KVMemory and the lock every caller holds while it computes."""

    memory: KVMemory
    lock: threading.RLock


_registry_lock = threading.Lock()
_memories: dict[tuple[str, str, str, str], KVMemory] = {}  # (model, store, device, dtype) -> memory
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


def shared_memory(model: str | None = None, store: str | os.PathLike[str] | None = None, *,
                  device: str | None = None, dtype: str | None = None) -> KVMemory:
    """The process-wide `KVMemory` for (model, store, device, dtype), created on first use. `device`
    ("auto" when None) is resolved first (models/devices.py), so "auto" and the device it names share
    one memory, and a device that is not here raises DeviceUnavailable before anything loads."""
    name = model or DEFAULT_MODEL
    where = resolve_device(device, model=name)
    key = (name, resolve_store(store), where, str(dtype or "auto"))
    with _registry_lock:
        mem = _memories.get(key)
        if mem is None:
            mem = _memories[key] = KVMemory(model=key[0], store=key[1], device=where, dtype=key[3])
        return mem


def share_steps(memory: KVMemory, on: bool = True, *, kv_tokens: int | None = None) -> None:
    """Let concurrent callers of `memory` share forward steps (continuous batching: engine/batch.py,
    engine/scheduler.py): LangChain's `batch` / `abatch`, LlamaIndex's async calls, your own threads
    calling `run_chat` or the adapters. Every answer keeps the bits it has computed alone. A caller's
    forward joins the batch only while another forward runs or waits; while it is in the batch, the
    caller gives up the memory's lock (`memory_lock`), so the next caller routes and lays out its prompt
    and joins the same steps. A lone caller runs as before. `on=False` ends it (the batch finishes first).
    `kv_tokens`: K/V positions the batched calls may hold together (more wait)."""
    import contextlib

    from kvmemory.engine.scheduler import DEFAULT_KV_TOKENS, BatchScheduler, released

    engine, lock = memory.engine, memory_lock(memory)
    with _registry_lock:
        current = getattr(engine, "batcher", None)
        if on and current is None:
            engine.batcher = BatchScheduler(engine, kv_tokens=kv_tokens or DEFAULT_KV_TOKENS, when_busy=True,
                                            while_waiting=lambda: released(contextlib.nullcontext, lock))
        elif not on and current is not None:
            engine.batcher = None
        else:
            current = None
    if not on and current is not None:
        current.close()


def memory_lock(memory: KVMemory) -> threading.RLock:
    """The lock every caller holds while `memory` computes; one per engine, so two `KVMemory`
    objects over the same engine share it."""
    with _registry_lock:
        lock = _locks.get(memory.engine)
        if lock is None:
            lock = _locks[memory.engine] = threading.RLock()
        return lock


def borrow_memory(memory: KVMemory | None = None, model: str | None = None,
                  store: str | os.PathLike[str] | None = None, *, device: str | None = None,
                  dtype: str | None = None) -> SharedMemory:
    """`memory` (the caller's own) or else the process-wide one for (model, store, device, dtype), with
    its lock."""
    if memory is None:
        memory = shared_memory(model, store, device=device, dtype=dtype)
    elif not isinstance(memory, KVMemory):
        raise TypeError(f"memory must be a kvmemory.KVMemory, got {type(memory).__name__}")
    else:
        _check_same_device(memory, device, dtype)
    return SharedMemory(memory, memory_lock(memory))


def _check_same_device(memory: KVMemory, device: str | None, dtype: str | None) -> None:
    """A memory given together with an explicit device or dtype must run there: it is already open, and
    an option it does not follow would be silently ignored."""
    engine = memory.engine
    if not hasattr(engine, "profile"):  # a memory without a model (listing only) runs nowhere
        return
    if device not in (None, "auto"):
        want = resolve_device(device, model=engine.loaded.source)
        if want != str(engine.device) and not (want == "cpu" and engine.device.type == "cpu"):
            raise InvalidInput(f"device={device!r} was asked for, but the memory given runs on {engine.device}: "
                               "pass the memory alone, or open one on that device (KVMemory(device=...))")
    if dtype not in (None, "auto"):
        want = resolve_dtype(dtype, str(engine.device))
        if str(want).removeprefix("torch.") != engine.profile.dtype:
            raise InvalidInput(f"dtype={dtype!r} was asked for, but the memory given computes in "
                               f"{engine.profile.dtype}: pass the memory alone, or open one in that dtype")

"""kvmemory.adapters.shared: one KVMemory per (model, store) in a process, one lock per engine."""

from __future__ import annotations

import pytest

from kvmemory.adapters import shared
from kvmemory.memory.facade import KVMemory
from kvmemory.models.loading import DEFAULT_MODEL


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "s"
    yield path
    # Let the model this module loaded go (the registry would keep it for the whole session).
    for key in [k for k in shared._memories if k[1] == shared.resolve_store(path)]:
        del shared._memories[key]


def test_one_memory_per_model_and_store(store, monkeypatch):
    a = shared.shared_memory(None, store)
    # The same store spelled another way, and the default model named: the same instance.
    monkeypatch.chdir(store.parent)
    assert shared.shared_memory(DEFAULT_MODEL, "s") is a
    assert shared.resolve_store(store.parent / "other") != shared.resolve_store(store)


def test_one_lock_per_engine(store):
    mem = shared.shared_memory(None, store)
    other_view = KVMemory(engine=mem.engine, namespace="elsewhere")
    assert shared.memory_lock(other_view) is shared.memory_lock(mem)
    with shared.memory_lock(mem):  # reentrant: an adapter may call another while holding it
        with shared.memory_lock(other_view):
            pass


def test_adapters_of_both_frameworks_share_it(store):
    from langchain_kvmemory import KVMemoryRetriever as LCRetriever
    from llama_index.retrievers.kvmemory import KVMemoryRetriever as LIRetriever

    lc = LCRetriever(store=str(store)).shared()
    li = LIRetriever(store=store)
    assert li.memory is lc.memory is shared.shared_memory(None, store)
    assert lc.lock is shared.memory_lock(li.memory)


def test_borrow_memory_pairs_a_memory_with_its_lock(store):
    mem = shared.shared_memory(None, store)
    own = KVMemory(engine=mem.engine, namespace="mine")
    borrowed = shared.borrow_memory(own)
    assert borrowed.memory is own and borrowed.lock is shared.memory_lock(mem)
    assert shared.borrow_memory(None, None, store).memory is mem
    with pytest.raises(TypeError):
        shared.borrow_memory(object())


def test_env_store_reads_kvmemory_store(monkeypatch):
    monkeypatch.delenv("KVMEMORY_STORE", raising=False)
    assert shared.env_store() is None
    monkeypatch.setenv("KVMEMORY_STORE", "/tmp/somewhere")
    assert shared.env_store() == "/tmp/somewhere"


def test_a_redis_store_is_named_by_its_url(monkeypatch):
    """A Redis URL is not a folder: resolving it as a path would open a local store named `redis:`."""
    url = "redis://127.0.0.1:6379/3"
    assert shared.resolve_store(url) == url
    monkeypatch.setenv("KVMEMORY_STORE", url)
    assert shared.resolve_store(None) == url

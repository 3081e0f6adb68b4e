"""LangChain's published key-value store suites on KVMemoryByteStore (one namespace of KVMemoryStore).
Each test gets an empty namespace of one shared store."""

from __future__ import annotations

import itertools

import pytest
from langchain_tests.integration_tests import BaseStoreAsyncTests, BaseStoreSyncTests

from langchain_kvmemory import KVMemoryByteStore, KVMemoryStore
from lc_testutil import fresh_store

_counter = itertools.count()
_backing: list[KVMemoryStore] = []


def _empty() -> KVMemoryByteStore:
    if not _backing:
        _backing.append(KVMemoryStore(store=fresh_store()))
    # index=False: the suites check the key-value contract (keys, values, deletes, prefixes) on the
    # store's own code path; remembering every value as a routed entry with its KV (index=True, the
    # default) is covered by test_lc_store.py and would make these ~50 writes cost a minute.
    return KVMemoryByteStore(_backing[0], namespace=("kv", f"t{next(_counter)}"), index=False)


class TestKVMemoryByteStoreSync(BaseStoreSyncTests):
    @pytest.fixture
    def kv_store(self) -> KVMemoryByteStore:
        return _empty()

    @pytest.fixture
    def three_values(self) -> tuple[dict, dict, dict]:
        return {"note": "the tea is in the blue tin"}, {"note": "the keys are under the mat"}, {"n": 3, "ok": True}


class TestKVMemoryByteStoreAsync(BaseStoreAsyncTests):
    @pytest.fixture
    def kv_store(self) -> KVMemoryByteStore:
        return _empty()

    @pytest.fixture
    def three_values(self) -> tuple[dict, dict, dict]:
        return {"note": "the tea is in the blue tin"}, {"note": "the keys are under the mat"}, {"n": 3, "ok": True}

"""The server's entry lookups for a tenant (issue 40, item 4), without a model: another tenant's entry id
is answered exactly as an id that exists nowhere, and nothing names another namespace or its counts;
an admin (or a server without keys) keeps the helpful message that says where an id is.
tests/test_server_tenancy.py probes every route of a real server the same way."""

from __future__ import annotations

import secrets

import pytest
from redis_server import synth_entry

from kvmemory.errors import UnknownEntry
from kvmemory.memory.facade import KVMemory
from kvmemory.server import memory_ops as ops
from kvmemory.store.local import LocalStore


class _StoreOnly:
    def __init__(self, store):
        self.store = store


@pytest.fixture
def mem(tmp_path):
    store = LocalStore(tmp_path / "store")
    for seed, ns in ((1, "user:alice"), (2, "user:alice"), (3, "user:bob")):
        store.commit_entry(*synth_entry(seed, namespace=ns))
    return KVMemory(_StoreOnly(store))


def _ids(mem: KVMemory) -> tuple[str, str, str]:
    alice = mem.store.entry_ids("user:alice")[0]
    bob = mem.store.entry_ids("user:bob")[0]
    nobody = "e" + secrets.token_hex(8)[:15]
    return alice, bob, nobody


OPS = {
    "get": lambda mem, eid, private: ops.get(mem, "user:bob", eid, private=private),
    "forget": lambda mem, eid, private: ops.forget(mem, "user:bob", entry_ids=[eid], private=private),
    "forget-with-own": lambda mem, eid, private: ops.forget(
        mem, "user:bob", entry_ids=[mem.store.entry_ids("user:bob")[0], eid], private=private),
    "verify": lambda mem, eid, private: ops.verify(mem, "user:bob", entry_ids=[eid], private=private),
    "export": lambda mem, eid, private: ops.export(mem, "user:bob", entry_ids=[eid], private=private),
}


def _miss(call, mem, eid, private) -> str:
    with pytest.raises(UnknownEntry) as err:
        call(mem, eid, private)
    return str(err.value)


@pytest.mark.parametrize("op", sorted(OPS))
def test_a_tenant_cannot_tell_another_tenants_entry_from_none_an_admin_is_told_where_it_is(mem, op):
    alice, bob, nobody = _ids(mem)
    theirs = _miss(OPS[op], mem, alice, True)
    missing = _miss(OPS[op], mem, nobody, True)
    assert theirs.replace(alice, "<ID>") == missing.replace(nobody, "<ID>")
    for text in (theirs, missing):
        assert "alice" not in text and "(2)" not in text and "(1)" not in text, text
    assert mem.store.entry_ids("user:bob") == [bob]  # forget-with-own removed nothing: every id is checked first
    assert len(mem.store.entry_ids("user:alice")) == 2
    # an admin key (or a server without keys) keeps the library's helpful answer: where the id is
    assert "is in namespace 'user:alice', not 'user:bob'" in _miss(OPS[op], mem, alice, False)
    assert "namespaces with entries: 'user:alice' (2), 'user:bob' (1)" in _miss(OPS[op], mem, nobody, False)

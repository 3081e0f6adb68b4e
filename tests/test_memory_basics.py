"""Memory basics on real stores: `KVMemory.list` (paged, by namespace and metadata), `get`, `update`
with history (metadata-only and KV-changing), metadata filters on `recall`, typed errors.

Listing and metadata updates need bytes, not logits: they run on synthetic entries (tests/redis_server.py)
over a tiny engine, on the local store and on a real redis-server. Updates that change the KV and
`recall(where=...)` run on the embedded SmolLM2."""

from __future__ import annotations

import dataclasses
import logging
import uuid

import pytest
from redis_server import RedisServer, synth_entry
from tiny_models import tiny_engine

from kvmemory import generate_problems
from kvmemory.engine.engine import Engine
from kvmemory.errors import InvalidInput, UnknownEntry, VerificationFailed
from kvmemory.memory.facade import KVMemory
from kvmemory.memory.filters import matches
from kvmemory.memory.listing import EntryPage
from kvmemory.store.local import LocalStore
from kvmemory.store.redis_store import RedisStore

KEY = "5f" * 32
PROBLEMS = generate_problems(2, seed=5)  # solutions of a few blocks (the grid is 64 tokens)


def _fill(mem: KVMemory) -> list:
    """Seven synthetic entries: five in "default" (users alice/bob, n = seed), two in "other"."""
    made = []
    for seed in range(1, 8):
        ns = "default" if seed <= 5 else "other"
        entry, blocks = synth_entry(seed, namespace=ns)
        entry = dataclasses.replace(entry, meta={"aliases": [], "user": "alice" if seed % 2 else "bob", "n": seed})
        mem.store.commit_entry(entry, blocks)
        made.append(entry)
    return made


@pytest.fixture(scope="module")
def redis_srv():
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=["local", "redis"])
def mem(request, tmp_path):
    if request.param == "local":
        return KVMemory(tiny_engine("llama", tmp_path / "store"))
    srv = request.getfixturevalue("redis_srv")
    store = RedisStore(srv.url, store=f"t{uuid.uuid4().hex[:8]}", path=tmp_path / "tier", signer=KEY)
    eng = tiny_engine("llama", tmp_path / "unused")
    eng.store = store
    return KVMemory(eng)


def test_list_pages_with_a_cursor_and_counts(mem):
    made = _fill(mem)
    p1 = mem.list(limit=2)
    assert isinstance(p1, EntryPage) and p1.namespace == "default" and p1.total == 5
    assert [e.id for e in p1.entries] == [made[0].id, made[1].id]
    assert p1.namespaces == {"default": 5, "other": 2}
    p2 = mem.list(limit=2, cursor=p1.next_cursor)
    p3 = mem.list(limit=2, cursor=p2.next_cursor)
    assert [e.id for e in p2] + [e.id for e in p3] == [m.id for m in made[2:5]]
    assert p3.next_cursor is None and p3.total == 5
    # A cursor names the last entry shown: forgetting one of the next page's entries skips nothing else.
    mem.store.delete_entries([made[2].id])
    assert [e.id for e in mem.list(limit=2, cursor=p1.next_cursor)] == [made[3].id, made[4].id]
    everything = mem.list(all_namespaces=True, limit=100)
    assert everything.namespace is None and everything.total == 6
    js = p1.to_json()
    assert js["total"] == 5 and js["next_cursor"] == p1.next_cursor and js["namespaces"] == {"default": 5, "other": 2}
    assert js["entries"][0] == {**js["entries"][0], "id": made[0].id, "version": 1, "meta": {"user": "alice", "n": 1},
                                "problem": "problem 1", "answer": "1", "namespace": "default"}


def test_list_filters_by_metadata(mem):
    made = _fill(mem)
    assert [e.id for e in mem.list(where={"user": "bob"})] == [made[1].id, made[3].id]
    assert [e.id for e in mem.list(where={"user": "alice", "n": {"$gte": 3}})] == [made[2].id, made[4].id]
    assert mem.list(where={"user": "alice"}, limit=1).total == 3
    assert [e.id for e in mem.list("other", where={"n": {"$in": [6, 99]}})] == [made[5].id]
    assert mem.list(where={"nobody": {"$exists": True}}).total == 0


def test_unknown_namespace_lists_nothing_and_names_the_others(mem):
    _fill(mem)
    page = mem.list("typo")
    assert page.entries == [] and page.total == 0 and page.namespaces == {"default": 5, "other": 2}


def test_bad_list_input_is_a_typed_error(mem):
    _fill(mem)
    for kw in ({"limit": 0}, {"limit": 1001}, {"limit": "5"}, {"cursor": "page2"}, {"where": ["user"]},
               {"where": {"n": {"$gte": [1]}}}, {"where": {"n": {"$regex": "a"}}}, {"where": {"$or": []}},
               {"namespace": ""}, {"namespace": "x", "all_namespaces": True}):
        with pytest.raises(InvalidInput):
            mem.list(**kw)


def test_get_any_namespace_and_clear_unknowns(mem):
    made = _fill(mem)
    assert mem.get(made[5].id) == made[5]  # ids are global: no namespace needed
    assert mem.get(made[5].id, "other") == made[5]
    with pytest.raises(UnknownEntry, match="is in namespace 'other', not 'default'"):
        mem.get(made[5].id, "default")
    with pytest.raises(UnknownEntry, match="no entry 'e000'"):
        mem.get("e000")
    with pytest.raises(InvalidInput):
        mem.get(None)
    assert mem.entry(made[0].id) == made[0]  # the old name keeps its meaning (this memory's namespace)
    with pytest.raises(UnknownEntry):
        mem.entry(made[5].id)


def test_metadata_update_keeps_history_and_the_kv(mem):
    made = _fill(mem)
    e = made[0]
    new = mem.update(e.id, meta={"user": "carol", "n": None, "tag": "x"})
    assert new.id == e.id and new.chain == e.chain and new.token_ids == e.token_ids and new.attestation == e.attestation
    assert {k: v for k, v in new.meta.items() if k != "history"} == {"aliases": [], "user": "carol", "tag": "x"}
    assert mem.get(e.id) == new
    hist = mem.history(e.id)
    assert [v.version for v in hist] == [1, 2]
    assert hist[0].meta == {"user": "alice", "n": 1} and hist[0].replaced is not None and hist[1].replaced is None
    assert hist[0].chain == list(e.chain) and hist[1].meta == {"user": "carol", "tag": "x"}
    assert mem.update(e.id, meta={"tag": "x"}) == new  # no change: no new version
    assert [e.id for e in mem.list(where={"user": "carol"})] == [e.id]
    assert mem.list(where={"user": "carol"}).to_json()["entries"][0]["version"] == 2
    with pytest.raises(InvalidInput):
        mem.update(e.id, meta={"history": []})
    with pytest.raises(InvalidInput):
        mem.update(e.id, meta=["x"])
    with pytest.raises(UnknownEntry):
        mem.update("e000", meta={"a": 1})


def test_filters_semantics():
    assert matches({"a": 1}, {"a": 1}) and not matches({"a": True}, {"a": 1})
    assert matches({"a": {"b": 2, "c": 3}}, {"a": {"b": 2}})
    assert matches({"a": 2}, {"a": {"$gt": 1, "$lte": 2}}) and not matches({"a": "2"}, {"a": {"$gt": 1}})
    assert matches({}, {"a": {"$ne": 1}}) and not matches({}, {"a": 1}) and matches({"a": None}, {"a": None})
    assert matches({"t": ["x", "y"]}, {"t": ["x", "y"]}) and not matches({"t": ["x"]}, {"t": ["x", "y"]})


# ------------------------------------------------------------------ the real model
def test_update_that_changes_the_solution_makes_a_new_proven_kv(real_memory):
    mem = real_memory
    p = PROBLEMS[0]
    e = mem.remember(p.text, p.solution, answer=str(p.answer), meta={"topic": "tins"})
    new = mem.update(e.id, solution="Let us work it out.\n" + p.solution)
    assert new.id == e.id and new.solution.startswith("Let us") and new.verified
    assert new.chain != e.chain and new.token_ids != e.token_ids
    assert new.attestation["attestation_id"] != e.attestation["attestation_id"]
    assert new.meta["topic"] == "tins"
    # The new version's graft is bit-identical to a recompute, as every entry's.
    assert mem.verify([e.id]).bit_identical == 1
    hist = mem.history(e.id)
    assert [(v.version, v.solution) for v in hist] == [(1, e.solution), (2, new.solution)]
    assert hist[0].chain == list(e.chain) and hist[0].attestation_id == e.attestation["attestation_id"]
    # A refused solution changes nothing.
    with pytest.raises(VerificationFailed):
        mem.update(e.id, answer=str(p.answer + 1))
    assert mem.get(e.id) == new
    # Re-adding the first version's exact texts would silently undo the update: refused, typed.
    with pytest.raises(InvalidInput, match="update"):
        mem.remember(p.text, p.solution, answer=str(p.answer))


def test_recall_filters_by_metadata_and_still_returns_k(real_memory, caplog):
    mem = real_memory
    texts = ["Tom has 3 boxes of 12 apples. How many apples?", "Tom has 4 boxes of 12 apples. How many apples?",
             "Tom has 5 boxes of 12 apples. How many apples?"]
    ids = [mem.remember(t, "Multiply boxes by 12.", verifier="none", allow_unverified=True,
                        meta={"user": "alice" if i == 2 else "bob"}).id for i, t in enumerate(texts)]
    q = "How many apples does Tom have with boxes of 12?"
    plain = mem.recall(q, k=1, threshold=-1.0)
    assert len(plain) == 1
    only = mem.recall(q, k=1, threshold=-1.0, where={"user": "alice"})
    assert [h.entry.id for h in only] == [ids[2]]
    assert [h.entry.id for h in mem.recall(q, k=5, threshold=-1.0, where={"user": "bob"})] == sorted(
        ids[:2], key=lambda i: -next(h.score for h in mem.recall(q, k=5, threshold=-1.0) if h.entry.id == i))
    assert mem.recall(q, k=3, threshold=-1.0, where={"user": "nobody"}) == []
    with caplog.at_level(logging.WARNING, logger="kvmemory.memory"):
        assert mem.recall(q, namespace="defualt", threshold=-1.0) == []
    assert "'default' (3)" in caplog.text and "defualt" in caplog.text
    with pytest.raises(InvalidInput):
        mem.recall(q, where={"user": {"$like": "a"}})


def test_update_on_redis_with_the_real_model(smollm, redis_srv, tmp_path):
    store = RedisStore(redis_srv.url, store=f"t{uuid.uuid4().hex[:8]}", path=tmp_path / "tier", signer=KEY)
    mem = KVMemory(Engine(smollm, store))
    p = PROBLEMS[1]
    e = mem.remember(p.text, p.solution, answer=str(p.answer))
    new = mem.update(e.id, problem=p.rewordings[0], meta={"src": "test"})
    assert new.chain != e.chain and mem.get(e.id) == new
    assert [v.problem for v in mem.history(e.id)] == [p.text, p.rewordings[0]]
    # Another reader of the same Redis store sees the new version and its history (signed as a whole).
    other = RedisStore(redis_srv.url, store=store.name, path=tmp_path / "tier2", signer=KEY)
    assert other.get_entry(e.id) == new
    assert mem.verify([e.id]).bit_identical == 1
    assert [h.entry.id for h in mem.recall(p.rewordings[0], threshold=0.9)] == [e.id]


def test_remember_later_without_a_lock_computes_on_first_use(real_memory):
    mem = real_memory
    p, q = PROBLEMS
    job = mem.remember_later(p.text, p.solution, answer=str(p.answer))
    dropped = mem.remember_later(q.text, q.solution, answer=str(q.answer))
    assert mem.pending() == [job.id, dropped.id] and job.verified is True
    with pytest.raises(UnknownEntry, match="still being computed"):
        mem.get(job.id)
    assert mem.forget(dropped.id) == 0  # pending: dropped before any KV is computed
    # No lock, so no writer thread: the recall that routes to it computes it, in this call.
    hits = mem.recall(p.rewordings[0], k=1, threshold=0.5)
    assert [h.entry.id for h in hits] == [job.id] and mem.pending() == []
    assert job.result() == mem.get(job.id) and len(mem.get(job.id).chain) >= 2
    mem.flush()
    assert mem.store.entry_ids() == [job.id] and [r.entry_id for r in mem.router.rows("default")] == [job.id]
    with pytest.raises(VerificationFailed):  # the verifier runs at once
        mem.remember_later(q.text, q.solution, answer=str(q.answer + 1))

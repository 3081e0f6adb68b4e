"""Batch `remember` (`KVMemory.remember_many`, memory/many.py): the same entries, KV bytes and routes as
remembering the items one at a time; a refused item refused alone; one catalogue transaction per batch;
a commit that fails leaves nothing half stored. On a tiny Llama (bytes, not answers, are compared)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_engine

from kvmemory import generate_problems
from kvmemory.errors import InvalidInput, StoreFull, UnknownEntry, VerificationFailed
from kvmemory.memory import many
from kvmemory.memory.facade import KVMemory

PROBLEMS = generate_problems(4, seed=11)


def _items() -> list[dict]:
    out = [{"problem": p.text, "solution": p.solution, "answer": str(p.answer), "verifier": "arithmetic",
            "meta": {"n": i}} for i, p in enumerate(PROBLEMS)]
    out.append({"problem": "Alice likes green tea in the morning."})  # a note
    out.append({"problem": PROBLEMS[0].text, "solution": PROBLEMS[0].solution, "answer": "7",
                "verifier": "exact-answer", "namespace": "other", "aliases": ["an alias"]})  # refused
    return out


def _block_bytes(mem: KVMemory, chain) -> list[bytes]:
    return [mem.store.block_path(h).read_bytes() for h in chain]


def _payloads(mem: KVMemory, chain) -> list[torch.Tensor]:
    out = []
    for h in chain:
        _, payload = mem.store.read_block(mem.store.get_block(h))
        out.append(torch.as_tensor(payload).clone() if not isinstance(payload, torch.Tensor) else payload.clone())
    return out


@pytest.fixture
def pair(tmp_path):
    one = KVMemory(tiny_engine("llama", tmp_path / "one"))
    two = KVMemory(tiny_engine("llama", tmp_path / "two"))
    return one, two


def test_batch_equals_one_at_a_time(pair):
    one, two = pair
    items = _items()
    singles = []
    for it in items:
        try:
            singles.append(one.remember(it["problem"], it.get("solution"), it.get("answer"),
                                        verifier=it.get("verifier"), namespace=it.get("namespace"),
                                        meta=it.get("meta"), aliases=it.get("aliases", ())))
        except VerificationFailed as exc:
            singles.append(exc)
    fates = two.remember_many(items)
    assert [f.status for f in fates] == ["remembered"] * 5 + ["refused"]
    assert isinstance(fates[-1].error, VerificationFailed) and isinstance(singles[-1], VerificationFailed)
    for s, f in zip(singles[:-1], fates[:-1]):
        b = f.entry
        assert (b.id, b.namespace, b.problem, b.solution, b.answer, b.verified, b.token_ids, b.chain, b.profile_id) \
            == (s.id, s.namespace, s.problem, s.solution, s.answer, s.verified, s.token_ids, s.chain, s.profile_id)
        assert b.meta == s.meta and b.verifier == s.verifier
        assert {k: v for k, v in b.attestation.items() if not k.endswith("_at")} == \
            {k: v for k, v in s.attestation.items() if not k.endswith("_at")}
        assert two.get(b.id) == b  # stored as reported
        assert _block_bytes(one, s.chain) == _block_bytes(two, b.chain)  # the same KV bytes, header included
        for x, y in zip(_payloads(one, s.chain), _payloads(two, b.chain)):
            assert torch.equal(x, y)
    # the same routing: every problem (and another wording) routes to the same entry with the same score
    for p in PROBLEMS + [dataclasses.replace(PROBLEMS[0], text="Alice likes tea")]:
        a = [(h.entry_id, round(h.score, 6)) for h in one.router.search(p.text, k=3, threshold=-1.0)]
        b = [(h.entry_id, round(h.score, 6)) for h in two.router.search(p.text, k=3, threshold=-1.0)]
        assert a == b and a
    assert sorted(one.store.entry_ids()) == sorted(two.store.entry_ids())


def test_one_transaction_and_one_route_write_per_batch(pair, monkeypatch):
    _, mem = pair
    items = _items()[:4]
    calls = {"commit_entries": 0, "commit_entry": 0, "update_many": 0, "embed": 0}
    store, router = mem.store, mem.router
    for name, obj in (("commit_entries", store), ("commit_entry", store), ("update_many", router)):
        orig = getattr(obj, name)

        def wrap(*a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)
        monkeypatch.setattr(obj, name, wrap)
    orig_embed = router.embedder.embed

    def embed(*a, **kw):
        calls["embed"] += 1
        return orig_embed(*a, **kw)
    monkeypatch.setattr(router.embedder, "embed", embed)
    head = store.feed_head().seq
    fates = mem.remember_many(items)
    assert all(f.ok for f in fates)
    assert calls == {"commit_entries": 1, "commit_entry": 0, "update_many": 1, "embed": 1}
    changes = store.changes_since(head)
    assert sorted(c.entry_id for c in changes) == sorted(f.entry.id for f in fates)


def test_refusals_are_per_item_and_typed(pair):
    _, mem = pair
    p = PROBLEMS[0]
    items = [
        {"problem": p.text, "solution": p.solution, "answer": str(p.answer), "verifier": "arithmetic"},
        "not an object",
        {"problem": "", "solution": "x"},
        {"problem": p.text, "solution": p.solution, "colour": "red"},
        {"problem": PROBLEMS[1].text, "solution": PROBLEMS[1].solution, "answer": "999999"},  # exact-answer refuses
        {"problem": PROBLEMS[1].text, "solution": PROBLEMS[1].solution, "answer": "999999", "allow_unverified": True},
    ]
    assert isinstance(mem.remember_many([{"problem": p.text, "solution": p.solution, "aliases": 5}])[0].error,
                      InvalidInput)
    fates = mem.remember_many(items)
    assert [f.status for f in fates] == ["remembered", "refused", "refused", "refused", "refused", "remembered"]
    assert [type(f.error).__name__ for f in fates] == [
        "NoneType", "InvalidInput", "InvalidInput", "InvalidInput", "VerificationFailed", "NoneType"]
    assert fates[5].entry.verified is False
    assert sorted(mem.store.entry_ids()) == sorted([fates[0].entry.id, fates[5].entry.id])
    assert fates[3].to_json()["error"] == "InvalidInput" and "colour" in fates[3].to_json()["message"]
    with pytest.raises(InvalidInput):
        mem.remember_many("not a list")


def test_the_same_item_twice_is_one_entry_with_the_last_metadata(pair):
    _, mem = pair
    p = PROBLEMS[0]
    it = {"problem": p.text, "solution": p.solution, "answer": str(p.answer)}
    fates = mem.remember_many([{**it, "meta": {"v": 1}}, {**it, "meta": {"v": 2}}])
    assert fates[0].entry.id == fates[1].entry.id and fates[0].ok and fates[1].ok
    assert mem.get(fates[0].entry.id).meta["v"] == 2
    assert mem.store.entry_ids() == [fates[0].entry.id]


def test_a_batch_commit_that_fails_leaves_nothing_half_stored(pair, monkeypatch):
    _, mem = pair
    items = _items()[:3]
    store = mem.store
    orig_insert = store.insert_entry_rows
    seen = []

    def insert(db, entry):  # the catalogue transaction dies after its first entry
        seen.append(entry.id)
        if len(seen) == 2:
            raise OSError("the disk went away")
        return orig_insert(db, entry)
    monkeypatch.setattr(store, "insert_entry_rows", insert)
    with pytest.raises(OSError):
        mem.remember_many(items)
    # the transaction rolled back: no entry at all, none routed, no record left claiming one
    assert store.entry_ids() == []
    for eid in seen:
        with pytest.raises(UnknownEntry):
            store.get_entry(eid)
        assert not store.has_record(eid)
    assert mem.router.search(PROBLEMS[0].text, k=3, threshold=-1.0) == []


def test_a_store_refusal_of_the_whole_batch_is_retried_item_by_item(pair, monkeypatch):
    _, mem = pair
    items = _items()[:3]
    store = mem.store

    def full(_items):
        raise StoreFull("no room for the batch")
    monkeypatch.setattr(store, "commit_entries", full)
    orig = store.commit_entry
    n = []

    def commit_entry(entry, blocks):
        n.append(entry.id)
        if len(n) == 2:
            raise StoreFull("no room for this one")
        return orig(entry, blocks)
    monkeypatch.setattr(store, "commit_entry", commit_entry)
    fates = mem.remember_many(items)
    assert [f.status for f in fates] == ["remembered", "refused", "remembered"]
    assert isinstance(fates[1].error, StoreFull)
    assert sorted(store.entry_ids()) == sorted([fates[0].entry.id, fates[2].entry.id])
    assert n[1] not in mem.router and fates[0].entry.id in mem.router  # the refused one is not routed
    assert fates[1].entry is None


def test_slices_commit_separately(pair, monkeypatch):
    _, mem = pair
    calls = []
    orig = mem.store.commit_entries
    monkeypatch.setattr(mem.store, "commit_entries", lambda xs: (calls.append(len(xs)), orig(xs))[1])
    fates = many.remember_many(mem, _items()[:4], max_batch_bytes=1)  # every entry its own slice
    assert all(f.ok for f in fates) and calls == []  # a slice of one commits with commit_entry
    assert len(mem.store.entry_ids()) == 4


def test_a_signed_store_signs_every_entry_of_a_batch(tmp_path):
    from kvmemory.store.signing import SignedLocalStore

    key = "ab" * 32
    eng = tiny_engine("llama", tmp_path / "unused")
    eng.store = SignedLocalStore(tmp_path / "signed", signer=key)
    mem = KVMemory(eng)
    fates = mem.remember_many(_items()[:3] + [{"problem": "Bob likes black coffee."}])
    assert all(f.ok for f in fates)
    reader = SignedLocalStore(tmp_path / "signed", signer=key)  # a reader checks every signature
    assert sorted(e.id for e in reader.list_entries()) == sorted(f.entry.id for f in fates)
    assert reader.rejected == []
    for f in fates:
        assert reader.get_entry(f.entry.id).chain == f.entry.chain

"""The verified-once tier (engine/tier.py) as a data structure: keys, budget and LRU eviction, the
graft's own blocks protected, leases, invalidation by the store's drop notices, memory and arenas.
Grafting through it is tested in test_pipeline.py."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from kvmemory.engine import tier as tier_mod
from kvmemory.engine.tier import Arena, VerifiedTier, default_budget, parse_bytes
from kvmemory.errors import InvalidInput
from kvmemory.store import drops
from kvmemory.store.blocks import BlockMeta, chain_hash
from kvmemory.store.local import BlockRow

PROFILE = "ab" * 32
NBYTES = 1000  # not a multiple of the alignment: slots are strided


def block(i: int, payload: bytes | None = None, parent: str | None = None) -> tuple[BlockMeta, BlockRow, bytes]:
    payload = payload if payload is not None else os.urandom(NBYTES)
    ids = (i, i + 1)
    h = chain_hash(PROFILE, parent, ids)
    sha = hashlib.sha256(payload).hexdigest()
    meta = BlockMeta(h, parent, PROFILE, i, 2 * i, ids, "bfloat16", ((1, 2, 250),), ((1, 2, 250),), len(payload), sha)
    row = BlockRow(h, parent, PROFILE, i, 2, sha, len(payload), len(payload) + 64, False, False, False)
    return meta, row, payload


def put(t: VerifiedTier, meta: BlockMeta, payload: bytes) -> bool:
    """Read `payload` into a slot (as a verified read would) and offer it to the tier."""
    slot = t.acquire(len(payload))
    slot.tensor().copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    ok = t.admit(meta, slot)
    t.release(slot)
    return ok


def test_held_bytes_come_back_under_the_same_row_only():
    t = VerifiedTier(10 * NBYTES)
    meta, row, payload = block(0)
    t.begin()
    assert t.lookup(row) is None
    assert put(t, meta, payload)
    held = t.lookup(row)
    assert held is not None and bytes(held.slot.tensor().numpy()) == payload and held.meta == meta
    t.release(held.slot)
    # The same hash under another payload digest (the block rewritten): never served, and forgotten.
    other = row.__class__(*[("f" * 64 if f == "payload_sha256" else getattr(row, f)) for f in row.__slots__])
    assert t.lookup(other) is None
    assert row.hash not in t and t.stats.stale == 1
    assert t.lookup(row) is None  # gone for the old row too (it was dropped, not hidden)


def test_budget_evicts_least_recently_grafted_first():
    t = VerifiedTier(3 * NBYTES)
    blocks = [block(i) for i in range(5)]
    for meta, _, payload in blocks[:3]:
        t.begin()
        assert put(t, meta, payload)
    t.begin()
    t.release(t.lookup(blocks[0][1]).slot)  # block 0 grafted again: now the most recent
    t.begin()
    assert put(t, blocks[3][0], blocks[3][2])  # evicts block 1, the least recently grafted
    assert [b[0].hash in t for b in blocks] == [True, False, True, True, False]
    assert t.held_bytes() == 3 * NBYTES and t.stats.evicted == 1


def test_a_graft_never_evicts_its_own_blocks():
    """A chain larger than the budget keeps its first blocks: admissions of one graft do not evict
    blocks that graft used (else the next graft of the same chain would find a rotating set)."""
    t = VerifiedTier(3 * NBYTES)
    blocks = [block(i) for i in range(6)]
    t.begin()
    admitted = [put(t, m, p) for m, _, p in blocks]
    assert admitted == [True, True, True, False, False, False] and t.stats.refused == 3
    t.begin()  # the same chain again: its first three are hits, the rest refused again
    hits = [t.lookup(r) for _, r, _ in blocks]
    assert [h is not None for h in hits] == [True] * 3 + [False] * 3
    for h in hits[:3]:
        t.release(h.slot)
    assert [put(t, m, p) for m, _, p in blocks[3:]] == [False] * 3
    t.begin()  # another graft may evict them
    assert put(t, *block(9)[::2])


def test_budget_zero_keeps_nothing_and_budget_changes_evict():
    t = VerifiedTier(0)
    meta, row, payload = block(0)
    t.begin()
    assert not put(t, meta, payload) and len(t) == 0
    t.set_budget(2 * NBYTES)
    blocks = [block(i) for i in range(2)]
    t.begin()
    for m, _, p in blocks:
        assert put(t, m, p)
    t.set_budget(NBYTES)
    assert len(t) == 1 and blocks[1][0].hash in t  # the least recently admitted went
    with pytest.raises(InvalidInput):
        t.set_budget(-1)
    with pytest.raises(InvalidInput):
        VerifiedTier(-5)


def test_store_drop_notices_drop_held_blocks():
    t = VerifiedTier(10 * NBYTES)
    blocks = [block(i) for i in range(3)]
    t.begin()
    for m, _, p in blocks:
        put(t, m, p)
    drops.dropped([blocks[1][0].hash, "0" * 64], "quarantined")
    assert [b[0].hash in t for b in blocks] == [True, False, True]
    assert t.stats.dropped == 1 and t.held_bytes() == 2 * NBYTES


def test_a_leased_slot_is_not_reused_when_dropped():
    """A block dropped while a graft still copies from its slot keeps its bytes until the lease ends."""
    t = VerifiedTier(10 * NBYTES)
    meta, row, payload = block(0)
    t.begin()
    put(t, meta, payload)
    held = t.lookup(row)
    t.drop([meta.hash])
    fresh = [t.acquire(NBYTES) for _ in range(40)]  # every free slot, and more
    assert all(s is not held.slot for s in fresh)
    assert bytes(held.slot.tensor().numpy()) == payload
    t.release(held.slot)
    for s in fresh:
        t.release(s)
    assert held.slot in t._arenas[NBYTES].free  # back to the arena only now


def test_a_tier_that_is_collected_stops_listening():
    import gc

    t = VerifiedTier(NBYTES)
    before = len(drops._listeners)
    del t
    gc.collect()
    drops.dropped(["1" * 64], "deleted")  # prunes the dead references, calls nothing dead
    assert len(drops._listeners) <= before - 1
    assert all(ref() is not None for ref in drops._listeners)


def test_a_failing_listener_does_not_fail_the_store(caplog):
    class Bad:
        def on(self, hashes, why):
            raise RuntimeError("boom")

    bad = Bad()
    drops.listen(bad.on)
    drops.dropped(["2" * 64], "quarantined")  # logged, not raised
    assert "block-drop listener failed" in caplog.text


def test_arena_slots_are_aligned_grow_and_trim(monkeypatch):
    monkeypatch.setattr(tier_mod, "CHUNK_BYTES", 64 * 1024)
    a = Arena(1000, "cpu")
    slots = [a.acquire() for _ in range(50)]
    assert all(s.address() % 64 == 0 and s.offset % tier_mod.ALIGN == 0 for s in slots)  # torch: 64-byte chunks
    assert len({s.address() for s in slots}) == 50
    assert [c.numel() // a.stride for c in a.chunks] == [16, 16, 32]  # doubling, up to CHUNK_BYTES
    for s in slots[:16]:
        a.release(s)
    a.trim()  # the first chunk is all free: freed; the others are in use
    assert [c.numel() // a.stride for c in a.chunks] == [16, 32]
    for s in slots[16:]:
        a.release(s)
    a.trim()
    assert a.chunks == [] and a.memory_bytes() == 0


def test_clear_frees_memory_not_in_use():
    t = VerifiedTier(100 * NBYTES)
    t.begin()
    blocks = [block(i) for i in range(20)]
    for m, _, p in blocks:
        put(t, m, p)
    assert t.memory_bytes() >= t.held_bytes() == 20 * NBYTES
    held = t.lookup(blocks[0][1])
    t.clear()
    assert len(t) == 0 and t.held_bytes() == 0
    assert t.memory_bytes() > 0  # the leased slot's chunk stays
    t.release(held.slot)
    t.trim()
    assert t.memory_bytes() == 0


def test_parse_bytes_and_default_budget(monkeypatch):
    assert parse_bytes("0") == 0 and parse_bytes("4096") == 4096
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("8G") == 8 << 30 and parse_bytes("1.5GiB") == 3 << 29
    for bad in ("lots", "-1", "G"):
        with pytest.raises(InvalidInput):
            parse_bytes(bad)
    monkeypatch.setenv("KVMEMORY_TIER_BYTES", "3M")
    assert default_budget(torch.device("cpu")) == 3 << 20
    monkeypatch.delenv("KVMEMORY_TIER_BYTES")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_budget(torch.device("cpu")) == 0  # opt-in on the CPU
    assert default_budget(torch.device("cuda")) == min(8 << 30, ram // 8)


def test_for_device_picks_pinned_memory_for_a_gpu():
    assert VerifiedTier.for_device(torch.device("cpu"), 0).where == "cpu"
    gpu = VerifiedTier.for_device(torch.device("cuda"), NBYTES)
    assert gpu.where == ("pinned" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        slot = gpu.acquire(NBYTES)
        assert slot.chunk.is_pinned()

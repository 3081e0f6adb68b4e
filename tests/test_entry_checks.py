"""Issue 40's items on entries: an entry is checked against itself before it is used (`ask` refuses a
damaged one), `verify` never calls a graft of nothing bit-identical and a repaired entry is recomputed
and re-proven, updated entries travel with their history, and `forget` finds entries as `get` does.

The proofs run on the embedded SmolLM2; forget and the bundle round trip on a tiny random-init llama
whose tokenizer speaks in bytes (tests/tiny_models.py)."""

from __future__ import annotations

import sqlite3

import pytest
from redis_server import synth_entry
from tiny_models import tiny_engine

from kvmemory.engine.engine import Engine
from kvmemory.errors import IntegrityError, UnknownEntry
from kvmemory.memory.facade import KVMemory
from kvmemory.store.fsck import run_fsck
from kvmemory.store.local import LocalStore

LONG = ("A farmer plants 12 rows of 15 cabbages and rabbits eat 23 of them. How many cabbages are left?",
        "12 * 15 = 180. 180 - 23 = 157. The answer is 157.", "157")


@pytest.fixture
def mem(smollm, tmp_path):
    return KVMemory(Engine(smollm, LocalStore(tmp_path / "store")))


def test_verify_proves_a_short_entry_and_calls_a_graft_of_nothing_unproven(mem):
    short = mem.remember("What is 2 + 3?", "2 + 3 = 5. The answer is 5.", "5")
    assert len(short.token_ids) < mem.engine.chunk and len(short.chain) == 1  # one tail block: all of it
    s = mem.verify([short.id], single_pass=False)
    assert (s.checked, s.bit_identical, s.unproven) == (1, 1, 0), s.to_json()
    assert s.results[0]["graft_point"] == len(short.token_ids)
    mem.store.block_path(short.chain[0]).unlink()  # its only block gone: a graft of nothing proves nothing
    s = mem.verify([short.id], single_pass=False)
    assert (s.checked, s.bit_identical, s.unproven) == (1, 0, 1), s.to_json()
    assert not s.results[0]["proven"] and "nothing was grafted" in s.results[0]["unproven_reason"]


def test_a_repaired_entry_is_recomputed_and_proven_again(mem):
    e = mem.remember(*LONG)
    path = mem.store.block_path(e.chain[0])
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    # a store-only repair quarantines the block and marks the entry: verify says unproven, not bit-identical
    assert run_fsck(mem.store, repair=True).n("entries_unproven") == 1
    s = mem.verify([e.id], single_pass=False)
    assert (s.bit_identical, s.unproven) == (0, 1) and "first block" in s.results[0]["unproven_reason"], s.to_json()
    # the memory's repair recomputes the blocks from the entry's own texts and proves them again
    rep = mem.fsck(repair=True)
    assert rep.n("entries_recomputed") == 1 and rep.exit_code == 1, rep.summary()
    s = mem.verify([e.id], single_pass=False)
    assert (s.bit_identical, s.unproven) == (1, 0) and s.results[0]["graft_point"] == len(e.token_ids), s.to_json()
    assert mem.fsck().exit_code == 0


def test_ask_refuses_an_entry_whose_texts_were_changed(mem):
    e = mem.remember(*LONG)
    db = sqlite3.connect(mem.store.path / "catalogue.sqlite")
    db.execute("UPDATE entries SET solution=replace(solution, '157', '167'), answer='167' WHERE id=?", (e.id,))
    db.commit()
    with pytest.raises(IntegrityError, match="re-tokenize"):
        mem.ask(e.id, "How many cabbages were planted?", max_new_tokens=4)
    ans = mem.answer(LONG[0], choices="numbers", answer_prefix="The answer is")
    assert ans.entries == [] and [r["entry"] for r in ans.refused] == [e.id], ans.to_json()
    s = mem.verify([e.id], single_pass=False)
    assert s.bit_identical == 0 and s.unproven == 1


def test_forget_finds_entries_as_get_does(tmp_path):
    mem = KVMemory(tiny_engine("llama", tmp_path / "store"))  # namespace "default"
    entry, blocks = synth_entry(1, namespace="other")
    mem.store.commit_entry(entry, blocks)
    assert mem.get(entry.id).namespace == "other"
    with pytest.raises(UnknownEntry):
        mem.forget(entry.id, namespace="default")  # a namespace given still restricts
    assert mem.forget(entry.id) >= 1
    with pytest.raises(UnknownEntry):
        mem.get(entry.id)


def test_an_updated_entry_exports_and_imports_with_its_history(tmp_path):
    src = KVMemory(tiny_engine("llama", tmp_path / "src"))
    e = src.remember("Sam has 4 bags of 6 apples. How many apples?", "4 * 6 = 24. The answer is 24.", "24")
    new = src.update(e.id, solution="Four bags of six: 4 * 6 = 24. The answer is 24.")
    assert new.id == e.id and len(src.history(e.id)) == 2
    src.export_bundle(tmp_path / "b.kvmb")
    dst = KVMemory(tiny_engine("llama", tmp_path / "dst"))
    report = dst.import_bundle(tmp_path / "b.kvmb", verify_all=True)
    assert report.ok and report.imported == [e.id], report.to_json()
    got = dst.get(e.id)
    assert got == new and [v.solution for v in dst.history(e.id)] == [e.solution, new.solution]
    assert dst.verify([e.id], single_pass=False).bit_identical == 1

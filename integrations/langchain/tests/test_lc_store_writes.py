"""KVMemoryStore writes: `put` returns before the KV is computed (index now, KV by the writer thread or
on first use), `flush` waits and raises background failures, the next related call grafts the new
entry's blocks, a normal exit loses nothing, a killed process leaves no half entry and the next store
computes what it missed; TTL; typed errors on bad input. Real model, real LangGraph classes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvmemory import InvalidInput, VerificationFailed, memory_lock, shared_memory
from kvmemory.store.local import LocalStore
from langchain_kvmemory import KVMemoryStore, stores
from langchain_kvmemory.errors import InvalidNamespace
from lc_testutil import PROBLEMS, fresh_store

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def path() -> str:
    return fresh_store()


def test_put_indexes_now_and_the_next_related_call_grafts_its_kv(path):
    s = KVMemoryStore(store=path, verifier="arithmetic")
    p = PROBLEMS[0]
    s.put(("sol",), "p0", {"problem": p.text, "solution": p.solution, "answer": p.answer})
    eid = s.entry_id(("sol",), "p0")
    # Seen at once by get and search (routed now), before anything waited for the KV.
    assert s.get(("sol",), "p0").value["answer"] == p.answer
    assert [h.key for h in s.search(("sol",), query=p.rewordings[0])] == ["p0"]
    mem = shared_memory(None, path)
    # The next related call, holding the memory's lock as every adapter does, grafts the entry's
    # blocks: computed by the writer thread, or here on first use if the thread had not started it.
    with memory_lock(mem):
        ans = mem.answer(p.rewordings[0], namespace="sol", max_new_tokens=2)
    entry = mem.get(eid)
    assert ans.entries == [eid] and entry.verified is True
    assert len(entry.chain) >= 2
    assert ans.report.tokens_grafted == len(entry.token_ids)  # the whole entry, its tail block too
    s.flush()
    assert mem.pending() == []


def test_flush_raises_the_first_background_failure(path):
    s = KVMemoryStore(store=path, index_fields=["text"])
    # Longer than the model's context: refused when its KV is computed, i.e. in the background.
    s.put(("bad",), "huge", {"text": "word " * 12000})
    assert s.get(("bad",), "huge") is not None
    with pytest.raises(InvalidInput):
        s.flush()
    s.flush()  # raised once
    mem = shared_memory(None, path)
    assert mem.store.entry_ids("bad") == [] and mem.router.rows("bad") == []  # no route to nothing


def test_refused_solution_raises_at_put(path):
    s = KVMemoryStore(store=path, verifier="arithmetic", require_verified=True)
    p = PROBLEMS[1]
    with pytest.raises(VerificationFailed):
        s.put(("sol",), "wrong", {"problem": p.text, "solution": p.solution.replace(str(p.answer), "7"),
                                  "answer": 7})
    assert s.get(("sol",), "wrong") is None


def test_overwrite_before_the_kv_is_computed_keeps_only_the_last(path):
    s = KVMemoryStore(store=path, index_fields=["text"])
    s.put(("ow",), "k", {"text": "the spare key is under the blue flower pot"})
    s.put(("ow",), "k", {"text": "the spare key is now in the letter box"})
    last = s.entry_id(("ow",), "k")
    s.flush()
    mem = shared_memory(None, path)
    assert mem.store.entry_ids("ow") == [last]
    assert [r.entry_id for r in mem.router.rows("ow")] == [last]
    # Put back the first value: the same entry id comes back, and a release queued for it must not
    # forget it (the writer asks the table when it runs).
    s.put(("ow",), "k", {"text": "the spare key is under the blue flower pot"})
    first = s.entry_id(("ow",), "k")
    s.put(("ow",), "k2", {"text": "the spare key is under the blue flower pot"})
    s.delete(("ow",), "k")
    s.flush()
    assert mem.store.entry_ids("ow") == [first]


def test_ttl_expires_items(path, monkeypatch):
    s = KVMemoryStore(store=path)
    s.put(("ttl",), "short", {"n": 1}, index=False, ttl=1)  # minutes
    s.put(("ttl",), "long", {"n": 2}, index=False, ttl=60)
    assert s.get(("ttl",), "short").value == {"n": 1}
    t0 = time.time()
    monkeypatch.setattr(stores, "_now", lambda: t0 + 120)  # two minutes later
    assert s.get(("ttl",), "short") is None
    assert [h.key for h in s.search(("ttl",))] == ["long"]
    s.put(("ttl",), "other", {"n": 3}, index=False)  # a write sweeps expired rows
    with s._connect(shared_memory(None, path)) as db:
        assert db.execute("SELECT key FROM items WHERE ns='ttl' ORDER BY key").fetchall() == [("long",), ("other",)]
    with pytest.raises(InvalidInput):
        s.put(("ttl",), "x", {"n": 1}, ttl=-1)
    with pytest.raises(InvalidInput, match="JSON"):
        s.put(("ttl",), "k", {"x": object()}, index=False)
    assert KVMemoryStore(store=path, ttl={"default_ttl": 5}).ttl_config == {"default_ttl": 5}


def test_bad_input_is_typed():
    s = KVMemoryStore(store=fresh_store())
    with pytest.raises(InvalidNamespace, match="tuple of strings"):
        s.get(None, "k")
    with pytest.raises(InvalidNamespace):
        s.put("notes", "k", {"a": 1})
    with pytest.raises(InvalidNamespace):
        s.search(None)
    with pytest.raises(InvalidInput, match="key"):
        s.get(("a",), None)
    with pytest.raises(InvalidInput, match="must be a dict"):
        s.put(("a",), "k", "just text")
    with pytest.raises(InvalidInput, match="must be a dict"):
        s.put(("a",), "k", [1, 2])
    with pytest.raises(InvalidInput, match="filter"):
        s.search(("a",), filter={"n": {"$regex": "x"}})


_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    from langchain_kvmemory import KVMemoryStore, stores
    s = KVMemoryStore(store={path!r}, index_fields=["text"])
    s.put(("exit",), {key!r}, {{"text": {text!r}}})
    print("put", flush=True)
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
""")


def _child(path: str, key: str, text: str, kill: bool) -> subprocess.CompletedProcess:
    code = _CHILD.format(here=HERE, path=path, key=key, text=text, kill=kill)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)


def test_normal_exit_finishes_pending_writes_and_a_kill_leaves_nothing_half_written():
    path = fresh_store()
    done = _child(path, "a", "the boiler manual is in the top drawer", kill=False)
    assert done.returncode == 0 and "put" in done.stdout, done.stderr[-2000:]
    # The child returned from put at once; atexit computed and committed the entry before it exited.
    assert len(LocalStore(path).entry_ids("exit")) == 1
    killed = _child(path, "b", "the fuse box is behind the coats", kill=True)
    assert killed.returncode == -9 and "put" in killed.stdout
    # Killed before its KV was computed: the item is kept, its entry is not half there.
    assert len(LocalStore(path).entry_ids("exit")) == 1
    s = KVMemoryStore(store=path, index_fields=["text"])
    assert s.get(("exit",), "b").value == {"text": "the fuse box is behind the coats"}
    s.flush()  # the store computed what the killed process missed
    ids = LocalStore(path).entry_ids("exit")
    assert len(ids) == 2 and s.entry_id(("exit",), "b") in ids
    # Its 51 tokens are less than one 64-token block: stored as one tail block, grafted whole, proven.
    mem = shared_memory(None, path)
    v = mem.verify([s.entry_id(("exit",), "b")])
    assert v.checked == v.bit_identical == 1 and v.unproven == 0
    assert v.results[0]["graft_point"] == len(mem.get(s.entry_id(("exit",), "b")).token_ids) < 64

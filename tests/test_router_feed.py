"""Several memories on one store, each with its own router (two servers on one Redis store, two
processes on one local store): what one remembers or forgets is routed or dropped by the other at its
next recall, through the store's change feed (memory/router_feed.py), never by listing the store per
question."""

from __future__ import annotations

import time
import uuid

import pytest

from kvmemory.bench.problems import generate_problems
from kvmemory.engine.engine import Engine
from kvmemory.memory.facade import KVMemory
from kvmemory.routing.router import Router
from kvmemory.store.local import LocalStore
from kvmemory.store.redis_store import RedisStore

from redis_server import RedisServer

KEY = "5f" * 32


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


class Listings:
    """Counts the store calls that list a namespace (what a recall must not do per question)."""

    def __init__(self, store, monkeypatch):
        self.n = 0
        for name in ("entry_ids", "list_entries", "namespace_counts"):
            orig = getattr(store, name)

            def spy(*a, _orig=orig, **kw):
                self.n += 1
                return _orig(*a, **kw)

            monkeypatch.setattr(store, name, spy)


def _pair(kind, smollm, tmp_path, srv):
    if kind == "redis":  # two servers: one Redis store, each its own local tier and router
        name = f"feed{uuid.uuid4().hex[:8]}"
        a = RedisStore(srv.url, store=name, path=tmp_path / "tier-a", signer=KEY)
        b = RedisStore(srv.url, store=name, path=tmp_path / "tier-b", signer=KEY)
        return KVMemory(Engine(smollm, a)), KVMemory(Engine(smollm, b))
    a = LocalStore(tmp_path / "store")  # two processes: one folder, each its own router
    b = LocalStore(tmp_path / "store")
    return (KVMemory(Engine(smollm, a), router=Router(tmp_path / "router-a")),
            KVMemory(Engine(smollm, b), router=Router(tmp_path / "router-b")))


@pytest.mark.parametrize("kind", ["redis", "local"])
def test_remembered_on_one_is_routed_by_the_other_and_forgotten_too(kind, smollm, tmp_path, srv, monkeypatch):
    one, other = _pair(kind, smollm, tmp_path, srv)
    p, q = generate_problems(2, seed=41, rewordings=1)
    first = one.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
    hits = other.recall(p.rewordings[0], k=1)  # first search: the namespace is resynced in full
    assert hits and hits[0].entry.id == first.id

    listings = Listings(other.store, monkeypatch)
    second = one.remember(q.text, q.solution, answer=str(q.answer), verifier="arithmetic")
    t0 = time.monotonic()
    hits = other.recall(q.rewordings[0], k=1)  # the next recall routes it: the feed said so
    routed_after = time.monotonic() - t0
    assert hits and hits[0].entry.id == second.id
    assert routed_after < 30  # sanity only: the bench measures (one embedding of one entry here)

    one.forget(second.id)
    assert all(h.entry.id != second.id for h in other.recall(q.rewordings[0], k=5, threshold=0.0))
    assert second.id not in other.router
    for _ in range(3):  # nothing changed: a recall reads the feed head, nothing else
        other.recall("What is the capital of France?", k=1)
    assert listings.n == 0


def test_a_gap_or_a_new_feed_resyncs_in_full(smollm, tmp_path, srv, monkeypatch):
    one, other = _pair("local", smollm, tmp_path, srv)
    p, = generate_problems(1, seed=43, rewordings=1)
    e = one.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
    assert other.recall(p.rewordings[0], k=1)
    listings = Listings(other.store, monkeypatch)
    # The record of a change is trimmed before `other` read it: it cannot know what changed, so it lists.
    other.router.delete(e.id)  # (a route lost meanwhile, which only the full resync puts back)
    with one.store._tx() as db:
        db.execute("UPDATE entries SET meta_json=? WHERE id=?", ('{"aliases": []}', e.id))
        db.execute("DELETE FROM changes")
    hits = other.recall(p.rewordings[0], k=1)
    assert hits and hits[0].entry.id == e.id and listings.n == 1
    # A new feed (a rebuilt catalogue): the same.
    other.router.delete(e.id)
    with one.store._tx() as db:
        db.execute("UPDATE meta SET value='another' WHERE key='feed_id'")
    hits = other.recall(p.rewordings[0], k=1)
    assert hits and hits[0].entry.id == e.id and listings.n == 2


def test_a_redis_outage_searches_the_router_as_it_is(smollm, tmp_path, srv, monkeypatch):
    one, other = _pair("redis", smollm, tmp_path, srv)
    p, = generate_problems(1, seed=45, rewordings=1)
    e = one.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
    assert other.recall(p.rewordings[0], k=1)
    from kvmemory.store.redis_store import StoreUnavailable

    def away(*a, **kw):
        raise StoreUnavailable("Redis is away")

    monkeypatch.setattr(other.store, "feed_head", away)
    hits = other.recall(p.rewordings[0], k=1)  # served from the router and the tier, routes kept
    assert hits and hits[0].entry.id == e.id and e.id in other.router


def test_changes_applied_in_memory_are_written_by_the_next_commit_or_counted_lost(tmp_path):
    """Router.apply_unsaved: following a change costs no write of the whole index; the next commit
    writes it; a reload of the folder (another process committed) drops it and says so."""
    a = Router(tmp_path / "router")
    a.add("e1", "default", ["Tom has 3 boxes of 12 apples; how many apples?"])
    assert a.apply_unsaved([("e2", "default", ["A train leaves at 3 pm and travels 2 hours."])], ["e1"]) == 2
    assert "e2" in a and "e1" not in a and "e2" not in Router(tmp_path / "router")  # not written yet
    a.add("e3", "default", ["Ann reads 20 pages a day for 5 days."])  # the next commit writes them
    fresh = Router(tmp_path / "router")
    assert "e2" in fresh and "e1" not in fresh and "e3" in fresh
    a.apply_unsaved([("e4", "default", ["A shop sells 7 pens at 2 dollars each."])], [])
    fresh.delete("e3")  # another process commits to the folder: a's unsaved change is dropped, and counted
    assert "e4" not in a and a.unsaved_lost == 1


_CHILD = """
import json, sys
from kvmemory.bench.problems import generate_problems
from kvmemory.engine.engine import Engine
from kvmemory.memory.facade import KVMemory
from kvmemory.models.loading import load_model
from kvmemory.store.redis_store import RedisStore

url, name, tier, forget = sys.argv[1:5]
mem = KVMemory(Engine(load_model(), RedisStore(url, store=name, path=tier, signer="5f" * 32)))
p = generate_problems(1, seed=51, rewordings=1)[0]
e = mem.remember(p.text, p.solution, answer=str(p.answer), verifier="arithmetic")
mem.forget(forget)
print(json.dumps({"remembered": e.id}))
"""


def test_another_server_process_remembers_and_forgets(smollm, tmp_path, srv):
    """Two processes on one Redis server (each its own tier and router): what the other process remembers
    is routed here at the next recall, and what it forgets is dropped."""
    import json
    import os
    import subprocess
    import sys

    name = f"feed{uuid.uuid4().hex[:8]}"
    here = KVMemory(Engine(smollm, RedisStore(srv.url, store=name, path=tmp_path / "tier-here", signer=KEY)))
    q, = generate_problems(1, seed=53, rewordings=1)
    mine = here.remember(q.text, q.solution, answer=str(q.answer), verifier="arithmetic")
    assert here.recall(q.rewordings[0], k=1)[0].entry.id == mine.id
    out = subprocess.run([sys.executable, "-c", _CHILD, srv.url, name, str(tmp_path / "tier-there"), mine.id],
                         capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])["remembered"]
    p, = generate_problems(1, seed=51, rewordings=1)
    hits = here.recall(p.rewordings[0], k=1)
    assert hits and hits[0].entry.id == theirs
    assert all(h.entry.id != mine.id for h in here.recall(q.rewordings[0], k=5, threshold=0.0))
    assert mine.id not in here.router

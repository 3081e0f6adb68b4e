"""The stores' change feed (store/feed.py): every commit and delete recorded in order, in the same
transaction, on the local store (plain and signed) and on a real Redis server; gaps and new feeds seen."""

from __future__ import annotations

import dataclasses
import sqlite3
import uuid

import pytest

from kvmemory.store.feed import FeedHead
from kvmemory.store.local import LocalStore
from kvmemory.store.redis_store import RedisStore
from kvmemory.store.signing import SignedLocalStore

from redis_server import RedisServer, synth_entry

KEY = "5f" * 32


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


@pytest.fixture(params=["local", "signed", "redis"])
def store(request, tmp_path, srv):
    if request.param == "local":
        st = LocalStore(tmp_path / "s")
    elif request.param == "signed":
        st = SignedLocalStore(tmp_path / "s", signer=KEY)
    else:
        st = RedisStore(srv.url, store=f"f{uuid.uuid4().hex[:8]}", path=tmp_path / "tier", signer=KEY)
    yield st
    st.close()


def test_commits_and_deletes_are_recorded_in_order(store):
    head = store.feed_head()
    assert isinstance(head, FeedHead) and head.feed_id and head.seq == 0
    assert store.changes_since(0) == []
    a, ab = synth_entry(1)
    b, bb = synth_entry(2, namespace="other")
    store.commit_entry(a, ab)
    store.commit_entry(b, bb)
    store.commit_entry(dataclasses.replace(a, meta={"aliases": ["another wording"]}), [])
    store.update_attestation(a.id, dict(a.attestation), True)  # not a routing change: not recorded
    store.delete_entries([b.id])
    store.delete_entries([b.id])  # already gone: nothing to record
    ch = store.changes_since(0)
    assert [(c.seq, c.op, c.entry_id, c.namespace) for c in ch] == [
        (1, "put", a.id, "default"), (2, "put", b.id, "other"), (3, "put", a.id, "default"),
        (4, "del", b.id, "other")]
    assert store.feed_head() == FeedHead(head.feed_id, 4)
    assert [c.seq for c in store.changes_since(2)] == [3, 4]
    assert [c.seq for c in store.changes_since(1, limit=2)] == [2, 3]
    assert store.changes_since(4) == []


def test_a_failed_commit_records_nothing(tmp_path):
    st = LocalStore(tmp_path / "s")
    a, ab = synth_entry(1)
    st.commit_entry(a, ab)
    with pytest.raises(Exception):
        with st._tx() as db:
            LocalStore.insert_entry_rows(db, dataclasses.replace(a, id="e" + "1" * 15))
            raise RuntimeError("killed before the commit")
    assert [c.seq for c in st.changes_since(0)] == [1]
    b, bb = synth_entry(2)
    st.commit_entry(b, bb)
    assert [c.seq for c in st.changes_since(0)] == [1, 2]  # contiguous: the rolled-back number is reused


def test_a_trimmed_feed_is_a_gap(tmp_path):
    st = LocalStore(tmp_path / "s")
    for i in range(1, 4):
        e, blocks = synth_entry(i)
        st.commit_entry(e, blocks)
    with st._tx() as db:
        db.execute("DELETE FROM changes WHERE seq <= 2")
    assert st.changes_since(0) is None and st.changes_since(1) is None
    assert [c.seq for c in st.changes_since(2)] == [3]


def test_redis_trimmed_feed_and_lost_data_are_seen(srv, tmp_path):
    st = RedisStore(srv.url, store=f"f{uuid.uuid4().hex[:8]}", path=tmp_path / "tier", signer=KEY)
    for i in range(1, 4):
        e, blocks = synth_entry(i)
        st.commit_entry(e, blocks)
    st.client.xtrim(st.k_feed(), minid="3-0", approximate=False)
    assert st.changes_since(0) is None and st.changes_since(1) is None
    assert [c.seq for c in st.changes_since(2)] == [3]
    before = st.feed_head()
    st.client.delete(st.k_meta(), st.k_seq(), st.k_feed())  # the server lost its data
    again = RedisStore(srv.url, store=st.name, path=tmp_path / "tier2", signer=KEY)
    after = again.feed_head()
    assert after.feed_id != before.feed_id and after.seq == 0
    st.close()
    again.close()


def test_an_old_catalogue_without_a_feed_gets_one(tmp_path):
    st = LocalStore(tmp_path / "s")
    e, blocks = synth_entry(1)
    st.commit_entry(e, blocks)
    st.close()
    db = sqlite3.connect(tmp_path / "s" / "catalogue.sqlite")
    db.executescript("DROP TRIGGER changes_put; DROP TRIGGER changes_edit; DROP TRIGGER changes_del; "
                     "DROP TRIGGER changes_trim; DROP TABLE changes; DELETE FROM meta WHERE key='feed_id';")
    db.close()
    ro = LocalStore(tmp_path / "s", readonly=True)
    assert ro.feed_head() is None  # read-only, made before the feed: the reader lists instead
    ro.close()
    st = LocalStore(tmp_path / "s")
    head = st.feed_head()
    assert head.feed_id and head.seq == 0
    st.delete_entries([e.id])
    assert [c.op for c in st.changes_since(0)] == ["del"]

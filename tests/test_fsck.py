"""fsck: every kind of damage found in check-only mode (nothing changed), repaired with repair=True,
and a second pass clean -- on the local store, the signed local store and Redis."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from redis_server import RedisServer, check_entry_readable, synth_block, synth_entry, synth_tokens

from kvmemory.store.fsck import run_fsck
from kvmemory.store.redis_store import RedisStore
from kvmemory.store.signing import SignedLocalStore
from kvmemory.store.local import LocalStore

KEY = "d4" * 32


def _filled(store, n=4):
    made = [synth_entry(i, n_blocks=3, shared=1) for i in range(n)]
    for e, b in made:
        store.commit_entry(e, b)
    return made


def _age(path, seconds=3600):
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_clean_store_is_clean(tmp_path):
    st = LocalStore(tmp_path / "s")
    _filled(st)
    rep = run_fsck(st)
    assert rep.clean and rep.exit_code == 0, rep.summary()
    j = rep.to_json()
    assert j["blocks_checked"] == j["blocks_ok"] == 9 and j["entries_checked"] == j["entries_ok"] == 4
    json.dumps(j)
    assert "clean" in rep.summary()


def test_local_damage_found_then_repaired(tmp_path):
    st = LocalStore(tmp_path / "s")
    made = _filled(st)
    (e0, b0), (e1, b1), (e2, b2) = made[:3]
    # a flipped payload bit, a deleted block file, a flipped header bit
    p = st.block_path(b0[2][0].hash)
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    st.block_path(b1[2][0].hash).unlink()
    p = st.block_path(b2[1][0].hash)
    data = bytearray(p.read_bytes())
    data[40] ^= 2
    p.write_bytes(bytes(data))
    # an old orphan file, a recent one (a writer that has not committed yet), a dead writer's tmp file
    orphan_meta, orphan_payload = synth_block(None, 0, synth_tokens(999))
    st.write_block_file(orphan_meta, orphan_payload)
    _age(st.block_path(orphan_meta.hash))
    recent_meta, recent_payload = synth_block(None, 0, synth_tokens(998))
    st.write_block_file(recent_meta, recent_payload)
    tmp = st.path / "tmp" / f"{'0' * 64}.999999999.abcd1234"
    tmp.write_bytes(b"partial")
    # a chain row of an entry that does not exist
    st._db().execute("INSERT INTO entry_blocks(entry_id, idx, hash) VALUES('ghost', 0, ?)", (b0[0][0].hash,))

    rep = run_fsck(st, repair=False)
    c = rep.to_json()
    assert (c["blocks_damaged"], c["blocks_missing"], c["orphan_payloads"], c["orphans_recent_kept"],
            c["stale_tmp_files"], c["entries_broken_chain"], c["index_drift"]) == (2, 1, 1, 1, 1, 3, 1), rep.summary()
    assert rep.exit_code == 4 and c["repaired"] == 0
    assert st.block_path(orphan_meta.hash).exists() and tmp.exists()  # check-only changed nothing
    assert not st.get_block(b0[2][0].hash).quarantined

    calls = []
    rep = run_fsck(st, repair=True, router_rebuild=lambda: calls.append(1) or 7)
    assert rep.exit_code == 1 and rep.router_rebuilt == 7 and calls == [1], rep.summary()
    assert rep.n("entries_marked") == 3 and rep.n("unrepaired") == 0
    assert not st.block_path(orphan_meta.hash).exists() and not tmp.exists()
    assert (st.path / "quarantine" / "orphans" / st.block_path(orphan_meta.hash).name).exists()  # kept aside
    assert st.block_path(recent_meta.hash).exists()  # younger than the grace period: kept
    for h in (b0[2][0].hash, b1[2][0].hash, b2[1][0].hash):
        assert st.get_block(h).quarantined
    marked = dict(st._db().execute("SELECT entry_id, reason FROM fsck_damaged_entries"))
    assert set(marked) == {e0.id, e1.id, e2.id}
    # Damaged entries stay usable: their grafts just stop earlier.
    assert check_entry_readable(st, e2.id) == 1 and check_entry_readable(st, made[3][0].id) == 3
    rep2 = run_fsck(st, repair=True)
    assert rep2.n("blocks_already_quarantined") == 3 and rep2.n("blocks_damaged") == 0
    # Remembering again replaces the damaged blocks; fsck then unmarks the entries.
    for e, b in made[:3]:
        st.commit_entry(e, b)
    rep3 = run_fsck(st, repair=True)
    assert rep3.clean and rep3.n("entries_unmarked") == 3, rep3.summary()
    assert not list(st._db().execute("SELECT * FROM fsck_damaged_entries"))


def test_damaged_rows_are_put_back_from_their_records_and_forged_entries_set_aside(tmp_path):
    st = SignedLocalStore(tmp_path / "s", signer=KEY)
    made = _filled(st)
    db = st._db()
    db.execute("UPDATE entries SET problem='tampered' WHERE id=?", (made[0][0].id,))
    db.execute("UPDATE entries SET verifier_json='{not json' WHERE id=?", (made[1][0].id,))
    db.execute("UPDATE blocks SET payload_nbytes='lots' WHERE hash=?", (made[2][1][2][0].hash,))
    LocalStore(tmp_path / "s").commit_entry(*synth_entry(50))  # unsigned, written without the key
    rep = run_fsck(st)
    assert (rep.n("entries_altered"), rep.n("entry_rows_damaged"), rep.n("entries_forged"),
            rep.n("block_rows_damaged"), rep.n("blocks_unsigned")) == (1, 1, 1, 1, 2), rep.summary()
    rep = run_fsck(st, repair=True)
    assert rep.exit_code == 1, rep.summary()
    # the damaged rows are kept aside, and their entries served again from their signed records;
    # the entry nobody signed is set aside with its record (never served)
    aside = {r[0] for r in db.execute("SELECT id FROM quarantined_entries")}
    assert aside == {made[0][0].id, made[1][0].id, synth_entry(50)[0].id}
    assert {e.id for e in st.list_entries()} == {e.id for e, _ in made} and st.rejected == []
    assert st.get_entry(made[0][0].id) == made[0][0] and st.get_entry(made[1][0].id) == made[1][0]
    assert not st.records.path(synth_entry(50)[0].id).exists()
    assert run_fsck(st, repair=True).exit_code == 0


def test_broken_sqlite_file_is_reported_not_raised(tmp_path):
    st = LocalStore(tmp_path / "s")
    _filled(st)
    st.close()
    f = tmp_path / "s" / "catalogue.sqlite"
    data = bytearray(f.read_bytes())
    assert len(data) > 3 * 4096
    for page in range(1, len(data) // 4096):  # every b-tree page but the first: headers garbled
        data[page * 4096 : page * 4096 + 16] = os.urandom(16)
    f.write_bytes(bytes(data))
    for wal in ("catalogue.sqlite-wal", "catalogue.sqlite-shm"):
        (tmp_path / "s" / wal).unlink(missing_ok=True)
    st = LocalStore(tmp_path / "s")
    rep = run_fsck(st)
    assert rep.catalogue != "ok" and rep.exit_code == 4, rep.summary()


def test_redis_damage_found_then_repaired(tmp_path):
    with RedisServer() as srv:
        st = RedisStore(srv.url, store=f"f{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY)
        made = _filled(st)
        r = st.client
        (e0, b0), (e1, b1), (e2, b2), (e3, b3) = made
        key = st.k_payload(b0[2][0].hash)
        r.setrange(key, r.strlen(key) - 1, b"\xff")  # payload damaged
        r.delete(st.k_payload(b1[2][0].hash))  # payload missing
        r.set(st.k_payload("ab" * 32), b"orphan")  # orphan payload
        r.hset(st.k_entry(e2.id), "answer", json.dumps("forged"))  # forged entry
        r.zrem(st.k_entries(), e3.id)  # index drift
        r.hset(st.k_block(b3[2][0].hash), "refs", 5)  # wrong reference count
        rep = run_fsck(st, grace_seconds=0)
        c = rep.to_json()
        assert (c["blocks_damaged"], c["blocks_missing"], c["orphan_payloads"], c["entries_forged"],
                c["index_drift"], c["entries_broken_chain"]) == (1, 1, 1, 1, 1, 2), rep.summary()
        assert r.exists(st.k_payload("ab" * 32))  # check-only changed nothing
        rep = run_fsck(st, repair=True, grace_seconds=0, router_rebuild=lambda: 3)
        assert rep.exit_code == 1 and rep.router_rebuilt == 3 and rep.n("refs_fixed") >= 1, rep.summary()
        assert not r.exists(st.k_payload("ab" * 32)) and r.exists(st.k_orphan("ab" * 32))  # set aside, not deleted
        # the forged entry is kept aside, and the entry served again from its signed record
        assert r.exists(st.k_qentry(e2.id)) and st.get_entry(e2.id) == e2
        assert set(st.entry_ids()) == {e0.id, e1.id, e2.id, e3.id}
        assert set(k.decode() for k in r.hkeys(st.k_damaged())) == {e0.id, e1.id}
        rep2 = run_fsck(st, repair=True, grace_seconds=0)
        assert rep2.exit_code == 0, rep2.summary()
        st.close()


def test_fsck_refuses_repair_on_a_tenant_view_and_read_only(tmp_path):
    from kvmemory.errors import InvalidInput, StoreReadOnly

    SignedLocalStore(tmp_path / "s", signer=KEY)
    with pytest.raises(InvalidInput):
        run_fsck(SignedLocalStore(tmp_path / "s", signer=KEY, namespace="alice"), repair=True)
    with pytest.raises(StoreReadOnly):
        run_fsck(LocalStore(tmp_path / "s", readonly=True), repair=True)


def test_router_rebuilder_routes_what_the_store_serves(tmp_path):
    from kvmemory.routing.router import router_rebuilder
    from kvmemory.routing.router import Router

    st = LocalStore(tmp_path / "s")
    made = _filled(st, n=3)
    rep = run_fsck(st, repair=True, router_rebuild=router_rebuilder(st))
    assert rep.router_rebuilt == 3
    hits = Router(st.path / "router").search(made[1][0].problem, k=1, namespace="default", threshold=0.0)
    assert hits and hits[0].entry_id == made[1][0].id

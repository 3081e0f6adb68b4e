"""The Redis store against a real redis-server (and a real 3-node Redis Cluster): the local store's
interface and guarantees, the cluster key layout, grafts bit-identical over Redis, outages, the factory."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
from tiny_models import tiny_model, IdTokenizer
from redis_server import (RedisCluster, RedisServer, check_entry_readable, synth_block,
                          synth_entry, synth_tokens)

from kvmemory.engine.engine import Engine
from kvmemory.errors import IntegrityError, InvalidInput, StoreFull, StoreReadOnly, UnknownEntry
from kvmemory.models.loading import LoadedModel
from kvmemory.store.redis_store import RedisStore, StoreUnavailable, parse_url
from kvmemory.store.signing import SigningKeyError
from kvmemory.store.local import LocalStore

KEY = "5f" * 32


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


@pytest.fixture
def rstore(srv, tmp_path):
    st = RedisStore(srv.url, store=f"t{uuid.uuid4().hex[:8]}", path=tmp_path / "tier", signer=KEY)
    yield st
    st.close()


def _ids(n, seed=1):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(store):
    return Engine(LoadedModel(tiny_model("llama"), IdTokenizer(), "tiny-llama", "tiny-llama"), store, chunk=16)


def test_cluster_key_layout_keeps_an_entry_in_one_slot_and_spreads_payloads(rstore):
    """Every key a commit touches shares the `{store}` tag (one slot: one atomic script in a cluster);
    payload keys are tagged by their own hash, so the bulk spreads over the slots."""
    from redis.crc import key_slot

    entry, blocks = synth_entry(1, n_blocks=4)
    s = rstore
    catalogue = [s.k_entry(entry.id), s.k_entries(), s.k_ns("default"), s.k_blocks(), s.k_meta(), s.k_prof(),
                 s.k_damaged(), s.k_qlog(), s.k_qentry(entry.id)] + [s.k_block(m.hash) for m, _ in blocks]
    assert len({key_slot(k.encode()) for k in catalogue}) == 1
    payload_slots = {key_slot(s.k_payload(synth_block(None, 0, synth_tokens(i))[0].hash).encode()) for i in range(64)}
    assert len(payload_slots) > 50  # 64 blocks land in (nearly) 64 different slots
    for m, _ in blocks:  # a payload and its quarantine copy share a slot, so RENAME works in a cluster
        assert key_slot(s.k_payload(m.hash).encode()) == key_slot(s.k_qpayload(m.hash).encode())


def test_entries_blocks_dedup_delete_and_stats(rstore):
    s = rstore
    made = [synth_entry(i, n_blocks=3, shared=1) for i in range(5)]
    for e, b in made:
        s.commit_entry(e, b)
    st = s.stats()
    assert (st.entries, st.verified_entries, st.blocks) == (5, 5, 1 + 5 * 2)  # the shared block once
    assert st.tokens_referenced == 5 * 3 * 16 and st.tokens_stored == 11 * 16
    assert s.entry_ids() == [e.id for e, _ in made]  # oldest first
    for e, _ in made:
        got = s.get_entry(e.id)
        assert got == e  # every field round-trips exactly (texts, token ids, JSON, floats)
        assert check_entry_readable(s, e.id) == 3
    assert [e.id for e in s.list_entries("default")] == [e.id for e, _ in made]
    assert s.list_entries("other") == []
    with pytest.raises(UnknownEntry):
        s.get_entry(made[0][0].id, namespace="other")
    removed = s.delete_entries([made[0][0].id, made[1][0].id])
    assert removed == 4  # their own blocks; the shared one is still referenced
    assert s.stats().blocks == 7
    shared_hash = made[0][1][0][0].hash
    assert s.client.exists(s.k_payload(shared_hash)) == 1
    assert s.client.exists(s.k_payload(made[0][1][1][0].hash)) == 0  # payloads of removed rows are gone
    with pytest.raises(UnknownEntry):
        s.get_entry(made[0][0].id)
    s.update_attestation(made[2][0].id, {"attestation_id": "new", "bit_identical": True}, verified=True)
    assert s.get_entry(made[2][0].id).attestation == {"attestation_id": "new", "bit_identical": True}


def test_eviction_keeps_pinned_and_verified(rstore):
    s = rstore
    loose = [synth_block(None, 0, synth_tokens(100 + i)) for i in range(6)]
    s.put_blocks(loose[:2], pinned=True)
    s.put_blocks(loose[2:4], verified=True)
    s.put_blocks(loose[4:])
    size = s.stats().bytes // 6
    assert s.evict(max_bytes=0) == 2 * size
    left = s.known_blocks([m.hash for m, _ in loose])
    assert set(left) == {m.hash for m, _ in loose[:4]}


def test_grafts_over_redis_are_bit_identical_and_served_from_the_tier(rstore):
    eng = _engine(rstore)
    ids = _ids(70)
    assert eng.store_prefix(ids) == 4
    got, report = eng.forward(ids, keep_logits=True)
    assert report.tokens_grafted == 64 and report.fallback is None
    ref = eng.recompute(ids)
    assert torch.equal(got.prefill_logits, ref.prefill_logits[64:])
    # The first graft filled the local tier with the verified bytes, identical to the shared copy.
    for h in report.blocks_used:
        tier = rstore.block_path(h).read_bytes()
        assert tier == rstore.client.get(rstore.k_payload(h))
    # A damaged tier copy is dropped and the shared one fetched again: same graft, nothing quarantined.
    p = rstore.block_path(report.blocks_used[1])
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x10
    p.write_bytes(bytes(data))
    got2, report2 = eng.forward(ids, keep_logits=True)
    assert report2.tokens_grafted == 64 and report2.quarantined == []
    assert torch.equal(got2.prefill_logits, got.prefill_logits)


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "delete", "wrongtype"])
def test_damage_in_redis_is_quarantined_and_never_grafted(rstore, damage):
    eng = _engine(rstore)
    ids = _ids(70, seed=3)
    eng.store_prefix(ids)
    from kvmemory.engine.graft import plan_chain

    rows = plan_chain(rstore, eng.profile_id, ids, 16)
    key = rstore.k_payload(rows[1].hash)
    r = rstore.client
    if damage == "bitflip":
        b = r.getrange(key, 200, 200)
        r.setrange(key, 200, bytes([b[0] ^ 0x04]))
    elif damage == "truncate":
        r.set(key, r.get(key)[:1000])
    elif damage == "delete":
        r.delete(key)
    else:
        r.delete(key)
        r.rpush(key, b"x")
    got, report = eng.forward(ids, keep_logits=True)
    assert report.tokens_grafted == 16 and report.quarantined == [rows[1].hash]
    assert torch.equal(got.prefill_logits, eng.recompute(ids).prefill_logits[16:])
    assert rstore.get_block(rows[1].hash).quarantined
    with pytest.raises(IntegrityError):
        rstore.read_block(rows[1])
    # Storing the same prefix again replaces the damaged block for everyone.
    eng.store_prefix(ids)
    _, report3 = eng.forward(ids)
    assert report3.tokens_grafted == 64


def test_read_only_store_reads_and_refuses_writes(srv, tmp_path):
    name = f"ro{uuid.uuid4().hex[:6]}"
    w = RedisStore(srv.url, store=name, path=tmp_path / "w", signer=KEY)
    e, b = synth_entry(1)
    w.commit_entry(e, b)
    ro = RedisStore(srv.url, store=name, path=tmp_path / "r", signer=KEY, readonly=True)
    assert check_entry_readable(ro, e.id) == 3
    for write in (lambda: ro.commit_entry(*synth_entry(2)), lambda: ro.put_blocks(b), lambda: ro.delete_entries([e.id]),
                  lambda: ro.put_profile("ab" * 32, {})):
        with pytest.raises(StoreReadOnly):
            write()


def test_outage_mid_writes_then_tier_serves_then_recovery(tmp_path):
    """Redis killed (SIGKILL) while a writer commits: the writer gets StoreUnavailable, readers are
    served from the local tier, and when the server is back (its append-only file replayed) both resume;
    every visible entry is complete."""
    with RedisServer(persist=True) as srv:
        w = RedisStore(srv.url, store="out", path=tmp_path / "w", signer=KEY, retry_interval=0.2, socket_timeout=5.0)
        rd = RedisStore(srv.url, store="out", path=tmp_path / "r", signer=KEY, retry_interval=0.2, socket_timeout=5.0)
        first, fb = synth_entry(0)
        w.commit_entry(first, fb)
        assert check_entry_readable(rd, first.id) == 3  # fills the reader's tier
        errors: list[Exception] = []
        committed: list[str] = []
        stop = threading.Event()

        def writer():
            i = 1
            while not stop.is_set():
                e, b = synth_entry(i)
                try:
                    w.commit_entry(e, b)
                    committed.append(e.id)
                except StoreUnavailable as exc:
                    errors.append(exc)
                    time.sleep(0.05)
                    continue
                i += 1

        t = threading.Thread(target=writer)
        t.start()
        time.sleep(0.3)
        srv.stop()  # mid-operation
        time.sleep(0.5)
        # The reader keeps serving what its tier holds, verified as always.
        assert check_entry_readable(rd, first.id) == 3
        assert rd.degraded
        with pytest.raises(StoreUnavailable, match="unreachable.*local tier"):
            rd.commit_entry(*synth_entry(999))
        n_before = len(committed)
        srv.start()
        deadline = time.time() + 10
        while len(committed) < n_before + 3 and time.time() < deadline:
            time.sleep(0.05)
        stop.set()
        t.join(10)
        assert errors, "the writer never saw the outage"
        assert all("unreachable" in str(e) for e in errors)
        assert len(committed) >= n_before + 3, "the writer did not recover"
        # After recovery: everything committed is there and whole, nothing partial is visible.
        assert rd.ping(), rd.last_error
        for eid in rd.entry_ids():
            assert check_entry_readable(rd, eid) == 3
        visible = rd.entry_ids()
        assert not rd.degraded, rd.last_error  # listed from Redis, not from the tier
        assert set(committed) | {first.id} == set(visible)
        print(f"outage: {len(errors)} writes refused while down, {len(committed)} committed, "
              f"{len(rd.entry_ids())} entries whole after recovery")


def test_out_of_memory_is_a_clean_error_and_the_store_stays_whole(tmp_path):
    with RedisServer(maxmemory="3mb") as srv:
        s = RedisStore(srv.url, store="oom", path=tmp_path / "t", signer=KEY)
        ok = 0
        with pytest.raises(StoreFull, match="out of memory"):
            for i in range(2000):
                s.commit_entry(*synth_entry(i, n_blocks=4))
                ok += 1
        assert ok > 0
        ids = s.entry_ids()
        assert len(ids) == ok  # the refused entry is not visible at all
        for eid in ids:
            assert check_entry_readable(s, eid) == 4
        print(f"maxmemory: {ok} entries stored before StoreFull; all whole")


def test_real_three_node_cluster(tmp_path):
    with RedisCluster() as cl:
        s = RedisStore(cl.url + "?store=cl&cluster=1", path=tmp_path / "t", signer=KEY)
        assert s.cluster
        made = [synth_entry(i, n_blocks=4) for i in range(8)]
        for e, b in made:
            s.commit_entry(e, b)
        for e, _ in made:
            assert s.get_entry(e.id) == e
            assert check_entry_readable(s, e.id) == 4
        nodes_with_payloads = sum(1 for n in cl.nodes
                                  if __import__("redis").Redis(port=n.port).dbsize() > 0)
        assert nodes_with_payloads == 3  # the payloads are sharded over every node
        assert s.delete_entries([made[0][0].id]) == 3
        from kvmemory.store.fsck import run_fsck

        rep = run_fsck(s, repair=False, grace_seconds=0)
        assert rep.exit_code == 0, rep.summary()
        s.close()


def test_urls_factory_and_keys(srv, tmp_path, monkeypatch):
    from kvmemory.store.signing import SignedLocalStore
    from kvmemory.store.open import open_store

    clean, ours = parse_url("redis://u:secret@127.0.0.1:1/0?store=x&cluster=1&socket_timeout=3")
    assert ours == {"store": "x", "cluster": "1"} and "socket_timeout=3" in clean
    with pytest.raises(InvalidInput):
        parse_url("http://example.com")
    monkeypatch.delenv("KVMEMORY_SIGNING_KEY", raising=False)
    with pytest.raises(SigningKeyError):
        open_store(srv.url + "?store=f", path=tmp_path / "a")
    st = open_store(srv.url + "?store=f", path=tmp_path / "b", require_signatures=False)
    assert isinstance(st, RedisStore) and st.signer is None and st.name == "f"
    monkeypatch.setenv("KVMEMORY_SIGNING_KEY", KEY)
    assert open_store(srv.url + "?store=f", path=tmp_path / "c").signer is not None
    assert type(open_store(tmp_path / "local")) is LocalStore
    assert isinstance(open_store(tmp_path / "signed", signing_key=KEY), SignedLocalStore)
    assert open_store(st) is st
    with pytest.raises(InvalidInput):
        RedisStore(srv.url, store="bad name!", path=tmp_path / "d", signer=KEY)
    # A password never appears in what the store prints.
    s = RedisStore("redis://u:hunter2hunter2@127.0.0.1:1/0", path=tmp_path / "e", signer=KEY, connect_timeout=0.2)
    with pytest.raises(StoreUnavailable) as ei:
        s.commit_entry(*synth_entry(1))
    assert "hunter2" not in str(ei.value) and "127.0.0.1:1" in str(ei.value)

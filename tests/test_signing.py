"""Signed entries and namespaces: keys, manifests, forged and unsigned entries refused (local and Redis),
blocks reachable only through forged rows never grafted, tenants isolated."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid

import pytest
import torch
from tiny_models import IdTokenizer, tiny_model
from redis_server import RedisServer, check_entry_readable, synth_entry

from kvmemory.store.blocks import encode_header
from kvmemory.engine.engine import Engine
from kvmemory.errors import InvalidInput, UnknownEntry
from kvmemory.models.loading import LoadedModel
from kvmemory.store.redis_store import RedisStore
from kvmemory.store.signing import (SignatureError, SignedLocalStore, Signer, SigningKeyError, block_manifest, entry_manifest, parse_key)
from kvmemory.store.local import LocalStore

KEY = "a1" * 32


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


def _ids(n, seed=1):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_keys_are_parsed_and_never_printed(monkeypatch):
    assert parse_key("ab" * 16) == bytes.fromhex("ab" * 16)
    assert parse_key("a passphrase of some length") == b"a passphrase of some length"
    with pytest.raises(SigningKeyError):
        parse_key("short")
    s = Signer(KEY)
    assert KEY not in repr(s) and "a1a1" not in repr(s)
    monkeypatch.delenv("KVMEMORY_SIGNING_KEY", raising=False)
    assert Signer.from_env() is None
    monkeypatch.setenv("KVMEMORY_SIGNING_KEY", KEY)
    monkeypatch.setenv("KVMEMORY_SIGNING_NAMESPACE", "alice")
    assert Signer.from_env().scope == "alice"


def test_every_manifest_field_is_covered():
    signer = Signer(KEY)
    entry, blocks = synth_entry(1)
    shas = [m.payload_sha256 for m, _ in blocks]
    sig = signer.sign_entry(entry, shas)
    signer.verify_entry(entry, shas, sig)
    changes = dict(id="e0", namespace="x", problem="p", solution="s", answer=None, verifier={}, verified=False,
                   token_ids=entry.token_ids[:-1], profile_id="00" * 32, chain=entry.chain[:1] + entry.chain[:2],
                   attestation={"attestation_id": "z"}, meta={"aliases": ["x"]}, created=1.0, updated=2.0)
    for name, value in changes.items():
        forged = dataclasses.replace(entry, **{name: value})
        with pytest.raises(SignatureError):
            signer.verify_entry(forged, shas, sig)
    with pytest.raises(SignatureError):  # another payload behind the same chain hash
        signer.verify_entry(entry, shas[:-1] + ["00" * 32], sig)
    with pytest.raises(SignatureError):
        signer.verify_entry(entry, shas, "")
    with pytest.raises(SignatureError):
        Signer("b2" * 32).verify_entry(entry, shas, sig)
    meta = blocks[0][0]
    bsig = signer.sign_block(meta, "default")
    assert signer.block_valid(meta, "default", bsig)
    assert not signer.block_valid(meta, "other", bsig)
    for field in ("hash", "parent", "profile_id", "index", "n_tokens", "payload_sha256", "payload_nbytes"):
        m = block_manifest(meta, "default")
        m[field] = m[field] + 1 if isinstance(m[field], int) else "f" * 64
        assert not signer.valid(m, bsig)
    assert entry_manifest(entry, shas)["chain"] == [[h, s] for h, s in zip(entry.chain, shas)]


def test_namespace_keys_confine_a_tenant():
    master = Signer(KEY)
    alice = Signer(master.namespace_key("alice"), namespace="alice")
    m = {"namespace": "alice", "kind": "x", "v": 1}
    assert master.valid(m, alice.sign(m)) and alice.valid(m, master.sign(m))
    with pytest.raises(SignatureError):
        alice.sign({"namespace": "bob"})
    assert not alice.valid({"namespace": "bob"}, master.sign({"namespace": "bob"}))


def test_signed_local_store_refuses_forged_and_unsigned_entries(tmp_path):
    st = SignedLocalStore(tmp_path / "s", signer=KEY)
    good, gb = synth_entry(1)
    other, ob = synth_entry(2)
    st.commit_entry(good, gb)
    st.commit_entry(other, ob)
    assert st.get_entry(good.id) == good and check_entry_readable(st, good.id) == 3
    # A writer without the key edits a row: refused, and left out of listings (not a denial of service).
    db = st._db()
    db.execute("UPDATE entries SET answer='42' WHERE id=?", (other.id,))
    with pytest.raises(SignatureError, match="forged or altered"):
        st.get_entry(other.id)
    assert [e.id for e in st.list_entries()] == [good.id] and st.rejected == [other.id]
    # An entry written by a plain (unsigned) store into the same folder is refused as unsigned.
    plain = LocalStore(tmp_path / "s")
    third, tb = synth_entry(3)
    plain.commit_entry(third, tb)
    with pytest.raises(SignatureError, match="unsigned"):
        st.get_entry(third.id)
    assert st.entry_ids() == [good.id]
    # ... and its blocks (rows without a signature) do not exist for the signed reader.
    assert st.get_block(tb[2][0].hash) is None
    assert st.get_block(gb[2][0].hash) is not None
    st.update_attestation(good.id, {"attestation_id": "again"}, verified=True)
    assert st.get_entry(good.id).attestation == {"attestation_id": "again"}


def _forge_block(store, row, redis: bool):
    """What an attacker without the key can do: new payload bytes, a matching header and row hash."""
    from kvmemory.store.blocks import parse_header

    raw = store.client.get(store.k_payload(row.hash)) if redis else store.block_path(row.hash).read_bytes()
    meta, off = parse_header(raw)
    payload = bytearray(raw[off:])
    payload[:64] = bytes(64)  # zeroed K values: a poisoned cache
    sha = hashlib.sha256(payload).hexdigest()
    meta = dataclasses.replace(meta, payload_sha256=sha)
    data = encode_header(meta) + bytes(payload)
    if redis:
        store.client.set(store.k_payload(row.hash), data)
        store.client.hset(store.k_block(row.hash), "payload_sha256", sha)
        store._tier.block_path(row.hash).unlink(missing_ok=True)
    else:
        store.block_path(row.hash).write_bytes(data)
        store._db().execute("UPDATE blocks SET payload_sha256=? WHERE hash=?", (sha, row.hash))


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_forged_blocks_are_never_grafted(kind, srv, tmp_path):
    if kind == "local":
        store = SignedLocalStore(tmp_path / "s", signer=KEY)
    else:
        store = RedisStore(srv.url, store=f"f{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY)
    eng = Engine(LoadedModel(tiny_model("llama"), IdTokenizer(), "tiny", "tiny"), store, chunk=16)
    ids = _ids(70)
    eng.store_prefix(ids)
    _, report = eng.forward(ids)
    assert report.tokens_grafted == 64
    from kvmemory.engine.graft import plan_chain

    rows = plan_chain(store, eng.profile_id, ids, 16)
    _forge_block(store, rows[2], redis=kind == "redis")
    got, report = eng.forward(ids, keep_logits=True)
    assert report.tokens_grafted == 32  # the chain stops before the forged block: it is not there
    assert torch.equal(got.prefill_logits, eng.recompute(ids).prefill_logits[32:])


def test_redis_refuses_unsigned_and_forged_entries(srv, tmp_path):
    name = f"sig{uuid.uuid4().hex[:6]}"
    signed = RedisStore(srv.url, store=name, path=tmp_path / "a", signer=KEY)
    unsigned = RedisStore(srv.url, store=name, path=tmp_path / "b", require_signatures=False)
    forger = RedisStore(srv.url, store=name, path=tmp_path / "c", signer="c3" * 32)
    good, gb = synth_entry(1)
    signed.commit_entry(good, gb)
    for n, writer in ((2, unsigned), (3, forger)):
        writer.commit_entry(*synth_entry(n))
    e2, e3 = synth_entry(2)[0], synth_entry(3)[0]
    with pytest.raises(SignatureError, match="unsigned"):
        signed.get_entry(e2.id)
    with pytest.raises(SignatureError, match="forged"):
        signed.get_entry(e3.id)
    assert [e.id for e in signed.list_entries()] == [good.id] and set(signed.rejected) == {e2.id, e3.id}
    # Editing a field by hand is caught too.
    signed.client.hset(signed.k_entry(good.id), "solution", "a different solution")
    with pytest.raises(SignatureError):
        signed.get_entry(good.id)
    # The forger's own blocks (signed with the wrong key) are invisible to the signed reader.
    own = synth_entry(3)[1][2][0].hash
    assert signed.get_block(own) is None and forger.get_block(own) is not None


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_namespaces_isolate_tenants(kind, srv, tmp_path):
    master = Signer(KEY)
    name = f"ns{uuid.uuid4().hex[:6]}"

    def open_as(ns, key):
        if kind == "local":
            return SignedLocalStore(tmp_path / "s", signer=key, namespace=ns)
        return RedisStore(srv.url, store=name, path=tmp_path / f"t-{ns}", signer=key, namespace=ns)

    alice = open_as("alice", Signer(master.namespace_key("alice"), namespace="alice"))
    bob = open_as("bob", Signer(master.namespace_key("bob"), namespace="bob"))
    ea, ba = synth_entry(1, namespace="alice", shared=1)
    alice.commit_entry(ea, ba)
    with pytest.raises(InvalidInput):  # a tenant cannot write into another namespace
        alice.commit_entry(*synth_entry(2, namespace="bob"))
    with pytest.raises(UnknownEntry):
        bob.get_entry(ea.id)
    with pytest.raises(UnknownEntry):
        bob.get_entry(ea.id, namespace="alice")
    assert bob.list_entries() == [] and bob.list_entries("alice") == [] and bob.entry_ids() == []
    assert bob.known_blocks([m.hash for m, _ in ba]) == {}  # alice's blocks are not there for bob
    with pytest.raises(UnknownEntry):
        bob.delete_entries([ea.id])
    # Bob stores the same shared prefix: he sees his copy; the bytes are still stored once.
    eb, bb = synth_entry(2, namespace="bob", shared=1)
    assert bb[0][0].hash == ba[0][0].hash
    bob.commit_entry(eb, bb)
    assert set(bob.known_blocks([m.hash for m, _ in bb])) == {m.hash for m, _ in bb}
    assert set(bob.known_blocks([m.hash for m, _ in ba])) == {ba[0][0].hash}
    assert alice.stats().blocks == 5  # 1 shared + 2 + 2
    assert check_entry_readable(bob, eb.id) == 3 and check_entry_readable(alice, ea.id) == 3
    # The master key (an operator) sees both.
    if kind == "local":
        op = SignedLocalStore(tmp_path / "s", signer=KEY)
    else:
        op = RedisStore(srv.url, store=name, path=tmp_path / "op", signer=KEY)
    assert {e.id for e in op.list_entries()} == {ea.id, eb.id}

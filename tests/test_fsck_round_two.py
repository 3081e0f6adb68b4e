"""Issue 47, "never silently wrong, round two": fsck and repair on stores named by the environment,
tail blocks in a rebuilt catalogue, bounded file reads (symlinks, devices, huge or deeply nested files),
repairs that would take most of a store out of service, and the rest of the issue's list. Synthetic
stores (tests/redis_server.py's blocks and entries): no model loads here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from redis_server import SYNTH_PROFILE, synth_entry

from kvmemory.store.blocks import BlockMeta, chain_hash
from kvmemory.store.fsck import fsck_at, run_fsck
from kvmemory.store.local import EntryRecord, LocalStore

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys; from kvmemory.cli import main; sys.exit(main())"


def _filled(path: Path, n: int = 3) -> tuple[LocalStore, list]:
    st = LocalStore(path)
    made = [synth_entry(i, n_blocks=3, shared=1) for i in range(n)]
    for e, b in made:
        st.commit_entry(e, b)
    return st, made


def _tail_entry(seed: int = 50):
    """An entry whose chain ends in a tail block: 16 tokens at position 0, then 5 at position 16."""
    blocks, parent, ids = [], None, []
    for i, n in enumerate((16, 5)):
        toks = tuple((seed * 31 + i * 7 + j) % 500 for j in range(n))
        h = chain_hash(SYNTH_PROFILE, parent, toks)
        data = hashlib.shake_256(bytes.fromhex(h)).digest(2 * 2 * n * 16 * 4)
        meta = BlockMeta(hash=h, parent=parent, profile_id=SYNTH_PROFILE, index=i, position=16 * i, token_ids=toks,
                         dtype="float32", k_shapes=((2, n, 16),), v_shapes=((2, n, 16),), payload_nbytes=len(data),
                         payload_sha256=hashlib.sha256(data).hexdigest())
        blocks.append((meta, torch.frombuffer(bytearray(data), dtype=torch.uint8)))
        ids += toks
        parent = h
    e = EntryRecord(id=f"tail{seed}", namespace="default", problem="p", solution="s", answer="1",
                    verifier={"name": "exact-answer", "ok": True}, verified=True, token_ids=tuple(ids),
                    profile_id=SYNTH_PROFILE, chain=tuple(m.hash for m, _ in blocks),
                    attestation={"attestation_id": "0" * 64, "bit_identical": True, "kl_max": 0.0}, meta={},
                    created=1_700_000_100.0, updated=1_700_000_100.0)
    return e, blocks


def _drop_catalogue(path: Path) -> None:
    for n in ("catalogue.sqlite", "catalogue.sqlite-wal", "catalogue.sqlite-shm"):
        (path / n).unlink(missing_ok=True)


# ------------------------------------------------------------------ 0. the store named by the environment
def test_repair_of_a_lost_catalogue_uses_the_store_the_environment_names(tmp_path, monkeypatch):
    path = tmp_path / "env-store"
    st, made = _filled(path)
    st.close()
    _drop_catalogue(path)
    monkeypatch.setenv("KVMEMORY_STORE", str(path))
    rep = fsck_at(None, repair=True)  # what `kvmemory fsck --repair` passes without --store
    assert rep.exit_code == 1 and rep.n("catalogue_rebuilt") == 1, rep.summary()
    assert rep.store == str(path)
    assert fsck_at(None).exit_code == 0
    assert not Path("None").exists()


def test_cli_repair_without_store_option(tmp_path):
    """The CLI path of item 0: a lost catalogue (one orphan block, so no model is needed), the store named
    by KVMEMORY_STORE only: the repair rebuilds it (exit 1, JSON), never a traceback."""
    path = tmp_path / "env-store"
    st, made = _filled(path, n=1)
    st.close()
    for f in (path / "entries").iterdir():
        f.unlink()
    _drop_catalogue(path)
    env = {**os.environ, "KVMEMORY_STORE": str(path), "PYTHONPATH": str(ROOT)}
    env.pop("KVMEMORY_SIGNING_KEY", None)
    out = subprocess.run([sys.executable, "-c", CLI, "fsck", "--repair", "--json"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    j = json.loads(out.stdout)
    assert j["catalogue_rebuilt"] == 1 and j["store"] == str(path)
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------ 3. tail blocks in a rebuilt catalogue
def test_rebuild_keeps_intact_tail_blocks(tmp_path):
    st, made = _filled(tmp_path / "s")
    e, blocks = _tail_entry()
    st.commit_entry(e, blocks)
    assert run_fsck(st).exit_code == 0
    st.close()
    _drop_catalogue(tmp_path / "s")
    rep = fsck_at(str(tmp_path / "s"), repair=True)
    assert rep.n("blocks_damaged") == 0 and rep.n("entries_broken_chain") == 0, rep.summary()
    assert rep.rebuild["counts"]["blocks_adopted"] == 9 and rep.rebuild["counts"]["entries_restored"] == 4
    st = LocalStore(tmp_path / "s")
    assert not st.get_block(blocks[1][0].hash).quarantined
    assert run_fsck(st).exit_code == 0


# ------------------------------------------------------------------ 2. bounded reads
@pytest.mark.parametrize("target", ["/dev/zero", "regular"])
def test_fsck_never_follows_a_symlinked_block_file(tmp_path, target):
    st, made = _filled(tmp_path / "s")
    h = made[0][1][2][0].hash
    f = st.block_path(h)
    if target == "regular":  # a symlink to an intact copy is refused too: a store holds regular files only
        real = tmp_path / "elsewhere.kvb"
        real.write_bytes(f.read_bytes())
        target = str(real)
    f.unlink()
    f.symlink_to(target)
    rep = run_fsck(st)
    assert rep.exit_code == 4 and {p["key"] for p in rep.problems if p["kind"] == "blocks_damaged"} == {h}, \
        rep.summary()
    assert "symbolic link" in json.dumps(rep.problems)
    rep = run_fsck(st, repair=True)
    assert rep.exit_code in (1, 4) and st.get_block(h).quarantined
    st.close()
    # and a rebuild (catalogue lost) refuses it the same way
    _drop_catalogue(tmp_path / "s")
    f2 = LocalStore.block_path(st, made[1][1][2][0].hash)
    f2.unlink()
    f2.symlink_to("/dev/zero")
    rep = fsck_at(str(tmp_path / "s"), repair=True)
    assert any(p["key"] == made[1][1][2][0].hash and p["kind"] == "blocks_damaged" for p in rep.problems)


def test_fsck_refuses_a_fifo_and_an_oversized_block(tmp_path):
    st, made = _filled(tmp_path / "s")
    h0, h1 = made[0][1][2][0].hash, made[1][1][2][0].hash
    f0 = st.block_path(h0)
    f0.unlink()
    os.mkfifo(f0)  # a read would block forever
    f1 = st.block_path(h1)
    with open(f1, "ab") as fh:
        fh.write(b"\0" * 10_000)  # larger than its header and row say: not read
    rep = run_fsck(st)
    bad = {p["key"]: p["detail"] for p in rep.problems if p["kind"] == "blocks_damaged"}
    assert set(bad) == {h0, h1}, rep.summary()
    assert "regular file" in bad[h0] and "bytes" in bad[h1]


def test_record_symlink_and_oversize_refused(tmp_path):
    from kvmemory.store import safe_files

    st, made = _filled(tmp_path / "s")
    rec = st.records.path(made[0][0].id)
    rec.unlink()
    rec.symlink_to("/dev/zero")
    rep = run_fsck(st)
    assert rep.exit_code == 4 and any(p["kind"] == "entry_records_damaged" for p in rep.problems), rep.summary()
    with pytest.raises(safe_files.UnsafeFile):
        safe_files.read_regular(tmp_path / "s" / "x", 10) if (tmp_path / "s" / "x").write_bytes(b"0" * 11) else None


# ------------------------------------------------------------------ 7. deeply nested JSON
def test_deeply_nested_record_is_damage_not_a_crash(tmp_path):
    st, made = _filled(tmp_path / "s")
    eid = made[0][0].id
    st.records.path(eid).write_bytes(b"[" * 200_000)
    rep = run_fsck(st)
    assert rep.exit_code == 4 and any(p["kind"] == "entry_records_damaged" and p["key"] == eid
                                      for p in rep.problems), rep.summary()
    rep = run_fsck(st, repair=True)
    assert rep.exit_code == 1, rep.summary()
    assert run_fsck(st).exit_code == 0
    st.close()
    # the same record met by a rebuild
    st.records.path(eid).write_bytes(b"{\"a\":" * 100_000)
    _drop_catalogue(tmp_path / "s")
    rep = fsck_at(str(tmp_path / "s"), repair=True)
    assert any(p["kind"] == "entry_records_damaged" for p in rep.problems), rep.summary()


def test_loads_bounded():
    from kvmemory.errors import IntegrityError
    from kvmemory.store.safe_files import loads_bounded

    assert loads_bounded(b'{"a": ["[[[[", {"b": 1}]}', "x") == {"a": ["[[[[", {"b": 1}]}
    for bad in (b"[" * 200_000, b"[" * 300 + b"]" * 300, b"\xff"):
        with pytest.raises(IntegrityError):
            loads_bounded(bad, "x")


# ------------------------------------------------------------------ 1. a repair that would take the lot
KEY, OTHER = "d4" * 32, "77" * 32


def test_repair_with_the_wrong_key_is_refused_on_redis(tmp_path):
    import uuid

    from redis_server import RedisServer

    from kvmemory.errors import RepairRefused
    from kvmemory.store.redis_store import RedisStore

    with RedisServer() as srv:
        name = f"w{uuid.uuid4().hex[:6]}"
        st = RedisStore(srv.url, store=name, path=tmp_path / "t", signer=KEY)
        for i in range(3):
            st.commit_entry(*synth_entry(i))
        st.close()
        wrong = RedisStore(srv.url, store=name, path=tmp_path / "t2", signer=OTHER)
        assert run_fsck(wrong).exit_code == 4  # the check names it ...
        with pytest.raises(RepairRefused, match="signing key"):  # ... the repair refuses to act on it
            run_fsck(wrong, repair=True)
        wrong.close()
        right = RedisStore(srv.url, store=name, path=tmp_path / "t", signer=KEY)
        rep = run_fsck(right)
        assert rep.exit_code == 0 and rep.n("entries_ok") == 3, rep.summary()  # nothing was changed
        right.close()


def test_repair_with_the_wrong_key_is_refused_on_a_signed_folder_unless_forced(tmp_path):
    from kvmemory.errors import RepairRefused
    from kvmemory.store.signing import SignedLocalStore

    st = SignedLocalStore(tmp_path / "s", signer=KEY)
    for i in range(3):
        st.commit_entry(*synth_entry(i))
    st.close()
    with pytest.raises(RepairRefused, match="nothing was changed"):
        fsck_at(str(tmp_path / "s"), signing_key=OTHER, repair=True)
    assert fsck_at(str(tmp_path / "s"), signing_key=KEY).exit_code == 0
    # the few damaged items are still repaired without --force
    st = SignedLocalStore(tmp_path / "s", signer=KEY)
    e0 = synth_entry(0)[1]
    st.block_path(e0[2][0].hash).write_bytes(b"x")
    st.close()
    assert fsck_at(str(tmp_path / "s"), signing_key=KEY, repair=True).exit_code in (1, 4)
    # --force acts
    rep = fsck_at(str(tmp_path / "s"), signing_key=OTHER, repair=True, force=True)
    assert rep.n("blocks_unsigned") >= 2


def test_cli_wrong_key_repair_refused_with_json(tmp_path):
    from kvmemory.store.signing import SignedLocalStore

    st = SignedLocalStore(tmp_path / "s", signer=KEY)
    for i in range(3):
        st.commit_entry(*synth_entry(i))
    st.close()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVMEMORY_SIGNING_KEY": OTHER, "KVMEMORY_SIGNED": "1"}
    out = subprocess.run([sys.executable, "-c", CLI, "fsck", "--repair", "--json", "--store", str(tmp_path / "s")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert json.loads(out.stdout)["error"] == "RepairRefused"


# ------------------------------------------------------------------ 8. the repair rebuilds a damaged router
@pytest.mark.parametrize("damage", ["truncated index", "extra row"])
def test_repair_rebuilds_a_damaged_router(tmp_path, damage):
    from kvmemory.routing.check import router_checker
    from kvmemory.routing.router import router_rebuilder

    st, made = _filled(tmp_path / "s")
    assert router_rebuilder(st)() == 3
    folder = tmp_path / "s" / "router"
    if damage == "truncated index":
        f = next(folder.glob("*.faiss"))
        f.write_bytes(f.read_bytes()[:100])
    else:
        f = next(folder.glob("ns-*.json"))
        d = json.loads(f.read_text())
        d["rows"].append([d["next_id"], made[0][0].id, "alias", "an extra row"])
        f.write_text(json.dumps(d))
    assert run_fsck(st, router_check=router_checker(st)).exit_code == 4
    rep = run_fsck(st, repair=True, router_check=router_checker(st), router_rebuild=router_rebuilder(st))
    assert rep.exit_code == 1 and rep.router_rebuilt == 3, rep.summary()
    assert run_fsck(st, router_check=router_checker(st)).exit_code == 0
    assert list((tmp_path / "s" / "quarantine").glob("router-*"))  # the damaged one is kept aside


# ------------------------------------------------------------------ 9. a set-aside entry is named in answers
def test_a_set_aside_entry_is_named_in_refused(tmp_path):
    from kvmemory.memory.facade import KVMemory
    from kvmemory.routing.check import router_checker
    from kvmemory.routing.router import router_rebuilder
    from kvmemory.store.fsck_common import set_aside_local

    st, made = _filled(tmp_path / "s")
    router_rebuilder(st)()
    eid = made[1][0].id
    set_aside_local(st, eid, LocalStore._ENTRY_COLS, "fsck: its texts do not re-tokenize", record_too=True)
    rep = run_fsck(st, repair=True, router_check=router_checker(st), router_rebuild=router_rebuilder(st))
    assert rep.exit_code == 0 and rep.router_rebuilt == 3, rep.summary()  # the set-aside entry stays routed
    assert run_fsck(st, router_check=router_checker(st)).exit_code == 0  # its route kept: not drift

    class _StoreOnly:
        def __init__(self, store):
            self.store = store

    mem = KVMemory(_StoreOnly(st))
    mem.checks.entry = lambda e: None  # the live entries' own checks need the model: not what is tested here
    mem.checks.route = lambda *a: None
    refused: list = []
    got = mem.recall("problem 1", refused=refused)
    assert eid not in [r.entry.id for r in got]
    assert [r["entry"] for r in refused] == [eid] and "set this entry aside" in refused[0]["reason"], refused


# ------------------------------------------------------------------ 4. a wiped Redis is noticed and restored
def test_redis_flushall_is_noticed_and_restored_from_the_tier(tmp_path):
    import uuid

    from redis_server import RedisServer, check_entry_readable

    from kvmemory.errors import CatalogueLost
    from kvmemory.store.redis_store import RedisStore

    with RedisServer() as srv:
        name = f"g{uuid.uuid4().hex[:6]}"
        tier = tmp_path / "tier"
        spec = f"{srv.url}?store={name}&tier={tier}"
        st = RedisStore(srv.url, store=name, path=tier, signer=KEY)
        made = [synth_entry(i) for i in range(3)]
        for e, b in made:
            st.commit_entry(e, b)
        for e, _ in made:  # read through: the tier now holds every row and block
            check_entry_readable(st, e.id)
        st.close()
        RedisStore(srv.url, store=name, path=tmp_path / "other", signer=KEY).client.flushall()
        with pytest.raises(CatalogueLost, match="fsck --repair"):  # never shown as an empty store
            RedisStore(srv.url, store=name, path=tier, signer=KEY)
        rep = fsck_at(spec, signing_key=KEY)
        assert rep.exit_code == 4 and [p["kind"] for p in rep.problems] == ["redis_wiped"], rep.summary()
        rep = fsck_at(spec, signing_key=KEY, repair=True)
        assert rep.exit_code == 1 and rep.n("entries_restored") == 3 and not rep.n("entries_lost"), rep.summary()
        rep = fsck_at(spec, signing_key=KEY)
        assert rep.exit_code == 0 and rep.n("entries_ok") == 3, rep.summary()
        st = RedisStore(srv.url, store=name, path=tmp_path / "fresh-tier", signer=KEY)  # from Redis alone
        assert sorted(st.entry_ids()) == sorted(e.id for e, _ in made)
        for e, _ in made:
            check_entry_readable(st, e.id)
        st.close()


# ------------------------------------------------------------------ 5. the check-only fsck checks what answers check
def _routed(tmp_path):
    from kvmemory.routing.router import router_rebuilder

    st, made = _filled(tmp_path / "s")
    router_rebuilder(st)()
    folder = tmp_path / "s" / "router"
    return st, made, folder


def test_check_only_fsck_finds_swapped_router_vectors(tmp_path):
    import faiss
    import numpy as np

    from kvmemory.routing.check import router_checker

    st, made, folder = _routed(tmp_path)
    f = next(folder.glob("*.faiss"))
    index = faiss.read_index(str(f))
    ids = list(range(index.ntotal))
    vecs = np.stack([index.reconstruct(i) for i in ids])
    vecs[[0, 1]] = vecs[[1, 0]]
    new = faiss.IndexIDMap2(faiss.IndexFlatIP(index.d))
    new.add_with_ids(vecs, np.asarray(ids, dtype=np.int64))
    faiss.write_index(new, str(f))
    assert run_fsck(st, router_check=router_checker(st)).exit_code == 0  # rows alone cannot tell
    rep = run_fsck(st, router_check=router_checker(st, vectors=True))
    assert rep.exit_code == 4 and rep.n("router_drift") == 2 and "cosine" in json.dumps(rep.problems), rep.summary()


def test_check_only_fsck_finds_a_manifest_dim_changed(tmp_path):
    from kvmemory.routing.check import router_checker

    st, made, folder = _routed(tmp_path)
    m = json.loads((folder / "manifest.json").read_text())
    m["embedder"]["dim"] = 512
    (folder / "manifest.json").write_text(json.dumps(m))
    rep = run_fsck(st, router_check=router_checker(st, vectors=True))
    assert rep.exit_code == 4 and "dimensions" in json.dumps(rep.problems), rep.summary()


def test_check_only_fsck_finds_an_edited_profile_file(tmp_path):
    from kvmemory.store.records import canonical

    st, made = _filled(tmp_path / "s")
    prof = {"chunk": 16, "model": "synthetic"}
    pid = hashlib.sha256(canonical(prof)).hexdigest()
    st.put_profile(pid, prof)
    f = tmp_path / "s" / "profiles" / f"{pid}.json"
    assert f.exists() and run_fsck(st).exit_code == 0
    f.write_text(json.dumps({"chunk": 32, "model": "synthetic"}))
    rep = run_fsck(st)
    assert rep.exit_code == 4 and rep.n("profile_files_damaged") == 1, rep.summary()
    rep = run_fsck(st, repair=True)
    assert rep.exit_code == 1 and json.loads(f.read_text()) == prof, rep.summary()
    assert run_fsck(st).exit_code == 0


# ------------------------------------------------------------------ 10. the smaller ones
def test_lost_catalogue_message_says_what_is_there(tmp_path):
    from kvmemory.errors import CatalogueLost

    st, made = _filled(tmp_path / "s")
    st.close()
    for f in (tmp_path / "s" / "entries").iterdir():
        f.unlink()
    _drop_catalogue(tmp_path / "s")
    with pytest.raises(CatalogueLost) as err:
        LocalStore(tmp_path / "s")
    assert "records and blocks are there" not in str(err.value) and "no entry records" in str(err.value)


def test_usage_errors_print_json_under_json(tmp_path):
    out = subprocess.run([sys.executable, "-c", CLI, "fsck", "--json", "--no-such-option"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    j = json.loads(out.stdout)
    assert j["error"] == "UsageError" and "--no-such-option" in j["message"]


def test_redis_check_only_does_not_count_a_forged_entry_ok(tmp_path):
    import uuid

    from redis_server import RedisServer

    from kvmemory.store.redis_store import RedisStore

    with RedisServer() as srv:
        st = RedisStore(srv.url, store=f"c{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY)
        made = [synth_entry(i) for i in range(3)]
        for e, b in made:
            st.commit_entry(e, b)
        st.client.hset(st.k_entry(made[2][0].id), "solution", "a forged solution")
        rep = run_fsck(st)
        j = rep.to_json()
        assert (j["entries_checked"], j["entries_forged"], j["entries_ok"]) == (3, 1, 2), rep.summary()
        st.close()


def test_a_non_utf8_byte_refuses_its_line_only(tmp_path):
    from kvmemory.memory.batch import read_jsonl

    f = tmp_path / "items.jsonl"
    good = json.dumps({"problem": "What is 2 + 2?", "solution": "2 + 2 = 4. The answer is 4.", "answer": "4"})
    f.write_bytes(good.encode() + b"\n" + b'{"problem": "caf\xe9"}\n' + b"[" * 100_000 + b"\n" + good.encode() + b"\n")
    rep = read_jsonl(f)
    assert [x.status for x in rep.lines] == ["pending", "refused", "refused", "pending"]
    assert "UTF-8" in rep.lines[1].message


def test_a_chmod_a_w_store_is_read_only_even_for_root(tmp_path):
    from kvmemory.errors import StoreReadOnly

    st, made = _filled(tmp_path / "s", n=1)
    st.close()
    os.chmod(tmp_path / "s", 0o555)
    try:
        st = LocalStore(tmp_path / "s")
        assert st.readonly
        with pytest.raises(StoreReadOnly):
            st.commit_entry(*synth_entry(7))
        with pytest.raises(StoreReadOnly):
            run_fsck(st, repair=True)
        assert run_fsck(st).exit_code == 0
        st.close()
    finally:
        os.chmod(tmp_path / "s", 0o755)


def test_a_deeply_nested_body_gets_the_usual_error_shape():
    from fastapi import Body, FastAPI
    from fastapi.testclient import TestClient

    from kvmemory.server.app import _install_error_handlers

    app = FastAPI()
    _install_error_handlers(app, None)

    @app.post("/x")
    async def x(body: dict = Body(...)):
        return body

    r = TestClient(app).post("/x", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "detail" not in r.json()
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_garbage_import_does_not_show_the_store_path(tmp_path):
    from types import SimpleNamespace

    from kvmemory.errors import BundleError
    from kvmemory.server import memory_ops as ops

    store_path = tmp_path / "secret-store-location"
    mem = SimpleNamespace(store=SimpleNamespace(path=store_path))
    path = ops.scratch_file(mem, ".kvmb")
    path.write_bytes(b"not a bundle" * 10)
    with pytest.raises(BundleError) as err:
        ops.import_(mem, "default", path)
    assert "secret-store-location" not in str(err.value) and "the uploaded bundle" in str(err.value)
    assert not path.exists()

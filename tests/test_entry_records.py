"""Entry records and catalogue rebuilds (store/records.py, store/rebuild.py, store/fsck.py): every entry
is recorded beside its blocks, so a catalogue that is deleted, emptied, damaged or stripped of rows is
refused (never served as an empty store), found by the check-only `fsck` (which changes nothing) and
rebuilt by `fsck --repair` with every entry; a repair never deletes a block an entry could use; the
same on Redis, where an entry's record lives beside it. Synthetic entries (tests/redis_server.py)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import uuid
from pathlib import Path

import pytest
from redis_server import RedisServer, check_entry_readable, synth_block, synth_entry, synth_tokens

from kvmemory import cli
from kvmemory.errors import KVMemoryError
from kvmemory.store.fsck import run_fsck
from kvmemory.store.local import LocalStore
from kvmemory.store.redis_store import RedisStore
from kvmemory.store.signing import SignedLocalStore

KEY = "a7" * 32


def _filled(store, n=4):
    made = [synth_entry(i, n_blocks=3, shared=1) for i in range(n)]
    for e, b in made:
        store.commit_entry(e, b)
    return made


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` with the SHA-256 of its bytes (SQLite's -wal / -shm files left out: opening
    a catalogue is allowed to touch those)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def _fsck_cli(path, *extra) -> tuple[int, dict]:
    """`kvmemory fsck --json` in this process: (exit code, report)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["fsck", "--store", str(path), "--json", *extra])
    text = out.getvalue()
    return rc, json.loads(text[text.index("{"):]) if "{" in text else {}


def test_every_entry_is_recorded_beside_its_blocks(tmp_path):
    st = LocalStore(tmp_path / "s")
    (e0, b0), (e1, _) = _filled(st, 2)
    rec = json.loads((tmp_path / "s" / "entries" / f"{e0.id}.json").read_bytes())
    assert rec["format"] == "kvmemory-entry-record" and rec["entry"]["token_ids"] == list(e0.token_ids)
    from kvmemory.store.records import content_sha256

    assert st.records.read(e0.id).entry == st.get_entry(e0.id) and rec["content_sha256"] == content_sha256(e0)
    st.update_attestation(e0.id, {"attestation_id": "new"}, verified=True)  # rewritten with the row
    assert st.records.read(e0.id).entry == st.get_entry(e0.id)
    assert st.records.read(e0.id).entry.attestation == {"attestation_id": "new"}
    st.delete_entries([e1.id])  # removed after the commit, tombstone and all
    assert not list((tmp_path / "s" / "entries").glob(f"{e1.id}*"))
    assert run_fsck(st).clean


@pytest.mark.parametrize("how", ["deleted", "emptied"])
def test_a_lost_catalogue_is_refused_found_and_rebuilt_with_every_entry(how, tmp_path):
    path = tmp_path / "s"
    st = LocalStore(path)
    made = _filled(st)
    before = {e.id: e for e in st.list_entries()}
    st.close()
    cat = path / "catalogue.sqlite"
    for f in (cat, path / "catalogue.sqlite-wal", path / "catalogue.sqlite-shm"):
        f.unlink(missing_ok=True)
    if how == "emptied":
        cat.write_bytes(b"")
    # every command refuses it, saying what to run (today: an empty store, served without a warning)
    for argv in (["stats"], ["list"]):
        assert cli.main([*argv, "--store", str(path)]) == 2
    from kvmemory.errors import CatalogueLost

    with pytest.raises(CatalogueLost, match="fsck --repair"):
        LocalStore(path)
    snap = _tree(path)
    rc, rep = _fsck_cli(path)  # check only: reports it, creates and changes nothing
    assert rc == 4 and rep["catalogue"].startswith("lost"), rep
    assert _tree(path) == snap and cat.exists() == (how == "emptied")
    rc, rep = _fsck_cli(path, "--repair")
    assert rc == 1 and rep["rebuild"]["counts"]["entries_restored"] == 4, rep
    st = LocalStore(path)
    assert {e.id: e for e in st.list_entries()} == before  # nothing lost, every field as it was
    for e, _ in made:
        assert check_entry_readable(st, e.id) == 3  # every block catalogued again, bytes exact
    assert run_fsck(st).clean
    assert not list((path / "quarantine" / "orphans").glob("*"))  # every block file was an entry's


def test_a_damaged_page_is_found_and_the_catalogue_rebuilt(tmp_path):
    path = tmp_path / "s"
    st = LocalStore(path)
    made = _filled(st, 6)
    st.close()
    cat = path / "catalogue.sqlite"
    data = bytearray(cat.read_bytes())
    page = next(i for i in range(len(data) // 4096) if b"problem 3" in data[i * 4096:(i + 1) * 4096])
    data[page * 4096 + 100 : page * 4096 + 4000] = os.urandom(3900)  # one page of entry rows, garbled
    cat.write_bytes(bytes(data))
    rc, rep = _fsck_cli(path)
    assert rc == 4 and rep["catalogue"].startswith("damaged"), rep
    rc, rep = _fsck_cli(path, "--repair")
    assert rc == 1, rep
    assert (path / "quarantine").glob("catalogue-*/catalogue.sqlite")  # the damaged one is kept
    st = LocalStore(path)
    assert sorted(st.entry_ids()) == sorted(e.id for e, _ in made)
    for e, _ in made:
        assert st.get_entry(e.id) == e and check_entry_readable(st, e.id) == 3
    assert run_fsck(st).clean


def test_rows_deleted_from_the_catalogue_are_put_back(tmp_path):
    st = LocalStore(tmp_path / "s")
    made = _filled(st)
    db = st._db()
    db.execute("DELETE FROM entries")
    db.execute("DELETE FROM entry_blocks")
    db.execute("DELETE FROM blocks")
    rep = run_fsck(st)
    assert rep.exit_code == 4 and rep.n("entries_missing_from_catalogue") == 4, rep.summary()
    assert rep.n("orphan_payloads") == 0  # the files an entry names are not orphans
    rep = run_fsck(st, repair=True)
    assert rep.exit_code == 1 and rep.n("blocks_adopted") == 9 and rep.n("entries_restored") == 4, rep.summary()
    for e, _ in made:
        assert st.get_entry(e.id) == e and check_entry_readable(st, e.id) == 3
    assert run_fsck(st).clean


def test_an_edited_row_is_put_back_from_its_record(tmp_path):
    st = LocalStore(tmp_path / "s")
    (e0, _), (e1, _), *_ = _filled(st)
    db = st._db()
    db.execute("UPDATE entries SET solution='edited', answer='154' WHERE id=?", (e0.id,))
    db.execute("UPDATE entries SET namespace='elsewhere' WHERE id=?", (e1.id,))
    rep = run_fsck(st)
    assert rep.exit_code == 4 and rep.n("entries_altered") == 2, rep.summary()
    assert any("answer, solution" in p["detail"] for p in rep.problems)  # names what changed
    rep = run_fsck(st, repair=True)
    assert rep.exit_code == 1, rep.summary()
    assert st.get_entry(e0.id) == e0 and st.get_entry(e1.id) == e1
    kept = dict(db.execute("SELECT id, row_json FROM quarantined_entries"))
    assert json.loads(kept[e0.id])["solution"] == "edited"  # the damaged row is kept, not deleted
    assert run_fsck(st).clean


def test_a_repair_keeps_orphans_until_purged(tmp_path):
    st = LocalStore(tmp_path / "s")
    _filled(st, 2)
    meta, payload = synth_block(None, 0, synth_tokens(999))
    st.write_block_file(meta, payload)  # a block no entry names (a writer killed before its commit)
    rep = run_fsck(st, repair=True, grace_seconds=0)
    assert rep.n("orphan_payloads") == 1 and rep.exit_code == 1, rep.summary()
    kept = tmp_path / "s" / "quarantine" / "orphans" / f"{meta.hash}.kvb"
    assert kept.read_bytes() and not st.block_path(meta.hash).exists()
    assert run_fsck(st, repair=True, grace_seconds=0).exit_code == 0
    rep = run_fsck(st, repair=True, grace_seconds=0, purge_orphans=True)
    assert rep.n("orphans_purged") == 1 and not kept.exists()


def test_check_only_fsck_changes_nothing(tmp_path):
    st = LocalStore(tmp_path / "s")
    made = _filled(st)
    st.block_path(made[0][1][2][0].hash).unlink()
    st.records.path(made[1][0].id).write_bytes(b"{damaged")
    st._db().execute("UPDATE entries SET problem='x' WHERE id=?", (made[2][0].id,))
    st.close()
    snap = _tree(tmp_path / "s")
    rc, rep = _fsck_cli(tmp_path / "s")
    assert rc == 4 and rep["repaired"] == 0, rep
    assert _tree(tmp_path / "s") == snap


def test_interrupted_writes_are_told_from_damage(tmp_path):
    st = LocalStore(tmp_path / "s")
    (e0, _), (e1, _), *_ = _filled(st)
    # a forget killed between marking its record and its commit: the entry stays, whole
    st.records.begin_forget(e0.id)
    # an update killed between writing its record and its commit: the committed version stands
    import dataclasses

    from kvmemory.store.records import content_sha256

    st.records.write(dataclasses.replace(e1, attestation={"attestation_id": "never committed"}),
                     previous_sha256=content_sha256(e1))
    rep = run_fsck(st)
    assert (rep.n("entry_records_forgotten"), rep.n("entry_records_stale"), rep.n("entries_altered")) == (1, 1, 0), \
        rep.summary()
    assert run_fsck(st, repair=True).exit_code == 1
    assert st.records.read(e0.id).entry == e0 and st.records.read(e1.id).entry == e1 == st.get_entry(e1.id)
    assert run_fsck(st).clean


def test_a_signed_store_is_rebuilt_signed(tmp_path):
    path = tmp_path / "s"
    st = SignedLocalStore(path, signer=KEY)
    made = _filled(st)
    st.close()
    for f in path.glob("catalogue.sqlite*"):
        f.unlink()
    rc, rep = _fsck_cli(path, "--repair", "--signing-key", KEY)
    assert rc == 1, rep
    st = SignedLocalStore(path, signer=KEY)
    for e, _ in made:  # entries verified by their signatures, blocks visible (signed again)
        assert st.get_entry(e.id) == e and check_entry_readable(st, e.id) == 3
    assert run_fsck(st).clean and st.rejected == []


@pytest.fixture(scope="module")
def srv():
    with RedisServer() as s:
        yield s


def test_redis_entries_are_put_back_from_their_records(srv, tmp_path):
    st = RedisStore(srv.url, store=f"rec{uuid.uuid4().hex[:6]}", path=tmp_path / "t", signer=KEY)
    made = _filled(st)
    (e0, _), (e1, _), (e2, _), (e3, b3) = made
    r = st.client
    r.delete(st.k_entry(e0.id))  # an entry lost
    r.hset(st.k_entry(e1.id), "solution", "edited")  # an entry changed (its signature no longer verifies)
    r.setrange(st.k_record(e2.id), 40, b"#")  # a record damaged
    r.delete(st.k_block(b3[2][0].hash))  # a block row lost: its payload is an entry's, not an orphan
    r.set(st.k_payload("cd" * 32), b"orphan")  # an orphan
    rep = run_fsck(st, grace_seconds=0)
    assert (rep.n("entries_missing_from_catalogue"), rep.n("entries_forged"), rep.n("entry_records_damaged"),
            rep.n("blocks_adopted"), rep.n("orphan_payloads")) == (1, 1, 1, 1, 1), rep.summary()
    rep = run_fsck(st, repair=True, grace_seconds=0)
    assert rep.exit_code == 1, rep.summary()
    for e, _ in made:
        assert st.get_entry(e.id) == e and check_entry_readable(st, e.id) == 3
    assert r.exists(st.k_qentry(e1.id))  # the changed copy is kept aside
    assert r.get(st.k_orphan("cd" * 32)) == b"orphan"  # kept, not deleted
    assert run_fsck(st, grace_seconds=0).exit_code == 0
    run_fsck(st, repair=True, grace_seconds=0, purge_orphans=True)
    assert not r.exists(st.k_orphan("cd" * 32))
    st.close()


def test_stores_without_records_get_them_from_sound_rows(tmp_path):
    """A store written before records existed: fsck reports every entry without a record, and the
    repair writes them from rows that check (so a later lost catalogue loses nothing)."""
    st = LocalStore(tmp_path / "s")
    made = _filled(st)
    for f in (tmp_path / "s" / "entries").glob("*.json"):
        f.unlink()
    rep = run_fsck(st)
    assert rep.n("entry_records_missing") == 4 and rep.exit_code == 4, rep.summary()
    assert run_fsck(st, repair=True).exit_code == 1
    assert all(st.records.read(e.id).entry == e for e, _ in made)


def test_fsck_never_raises_on_a_garbled_record(tmp_path):
    st = LocalStore(tmp_path / "s")
    (e0, _), *_ = _filled(st, 2)
    st.records.path(e0.id).write_bytes(os.urandom(64))
    try:
        rep = run_fsck(st, repair=True)
    except KVMemoryError as exc:  # pragma: no cover - a failure to report
        raise AssertionError(f"fsck raised {exc!r}") from exc
    assert rep.n("entry_records_damaged") == 1 and st.records.read(e0.id).entry == e0
    assert list((tmp_path / "s" / "quarantine" / "records").glob(f"{e0.id}.json.*"))
    with sqlite3.connect(tmp_path / "s" / "catalogue.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 2

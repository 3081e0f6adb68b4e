"""fsck on a local store (LocalStore, SignedLocalStore): the catalogue's integrity (rebuilt from the
records and blocks when damaged, store/rebuild.py), entries against their records (fsck_records.py),
orphan and stale files, block rows and their files, the entries' own checks and chains
(store/fsck.py says what is checked and repaired)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvmemory.errors import IntegrityError, KVMemoryError, StoreError, UnknownEntry
from kvmemory.store.fsck_common import broken_chain
from kvmemory.store.fsck_common import (EntryCheck, FsckReport, check_block_bytes, fsck_tables, master_signer,
                                        progress_bar, set_aside_local)
from kvmemory.store.fsck_records import chunk_for, reconcile_local, self_problem
from kvmemory.store.local import LocalStore, block_row_from
from kvmemory.store.rebuild import check_block_file, move_aside, rebuild_catalogue
from kvmemory.store.safe_files import read_block_file


def note_rebuild(rep: FsckReport, rebuilt: dict, why: str) -> None:
    """Report what rebuilding the catalogue did (store/rebuild.py)."""
    rep.rebuild = rebuilt
    c = rebuilt["counts"]
    rep.problem("catalogue_rebuilt", "catalogue.sqlite",
                f"{why}: rebuilt with {c['entries_restored']} entries ({c['entries_from_records']} from records, "
                f"{c['entries_from_old_catalogue']} from the old catalogue's readable rows) and "
                f"{c['blocks_adopted']} blocks; " + (f"the old one is kept in {rebuilt['old_catalogue']}"
                                                         if rebuilt["old_catalogue"] else "there was no old one"),
                fixed=True)
    for p in rebuilt["problems"]:
        rep.problem(p["kind"], p["key"], p["detail"], fixed=p["repaired"])


_BLOCK_COLS = ("hash, parent, profile_id, idx, n_tokens, payload_sha256, payload_nbytes, file_nbytes, verified, "
               "pinned, quarantined")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsck_local(store: LocalStore, repair: bool, grace: float, purge: bool = False,
                entry_check: EntryCheck | None = None, progress: bool = False) -> FsckReport:
    rep = FsckReport(str(store.path), store.kind, repair)
    try:
        res = [str(r[0]) for r in store._q("PRAGMA integrity_check")]
    except StoreError as exc:
        res = [str(exc)]
    if res != ["ok"]:
        detail = "; ".join(res[:5])
        if not repair:
            rep.catalogue = (f"damaged ({detail}); run `kvmemory fsck --repair` to rebuild it from the entry records "
                             "and blocks")
            rep.problem("catalogue_damaged", "catalogue.sqlite", detail, fixed=False)
            return rep
        store.close()
        note_rebuild(rep, rebuild_catalogue(store.path, signer=getattr(store, "signer", None)),
                      f"the catalogue was damaged ({detail})")
    signer = master_signer(store)
    now = time.time()

    # -- entries against their records first: rows put back from records name the blocks adopted below
    # No grace for records without rows: putting back an entry whose writer is about to commit it
    # writes the same row the writer writes (a check-only pass may report it meanwhile).
    named, reported = reconcile_local(rep, store, repair, entry_check)
    _check_profile_files(rep, store, repair)

    # -- orphan block files and stale tmp files: adopted when an entry names them, else set aside
    catalogued = {h for (h,) in store._q("SELECT hash FROM blocks")}
    for f in sorted((store.path / "blocks").rglob("*")) if (store.path / "blocks").exists() else []:
        if f.is_dir():
            continue
        h = f.stem if f.suffix == ".kvb" else None
        if h is not None and h in catalogued and f == store.block_path(h):
            continue
        if h is not None and h in named and h not in catalogued and f == store.block_path(h):
            _adopt_local(rep, store, f, h, named[h], repair, now)
            continue
        _orphan(rep, store, f, repair, grace, now, "orphan_payloads", "no catalogue row names this file", purge)
    for f in sorted((store.path / "tmp").iterdir()) if (store.path / "tmp").exists() else []:
        parts = f.name.split(".")
        pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
        dead = pid is None or not _pid_alive(pid)
        # a partial write never served anything: removed, not kept
        _orphan(rep, store, f, repair, grace if not dead else 0.0, now, "stale_tmp_files",
                "unfinished write of a writer that is gone" if dead else "unfinished write", purge=True)
    if purge and repair:
        _purge_quarantined_orphans(rep, store.path / "quarantine" / "orphans")

    # -- block rows and their files
    usable: set[str] = set()
    block_rows = store._q(f"SELECT {_BLOCK_COLS} FROM blocks")
    bar = progress_bar(len(block_rows), progress)
    for raw in block_rows:
        bar.update()
        rep.add("blocks_checked")
        key = raw[0] if isinstance(raw[0], str) else repr(raw[0])
        try:
            row = block_row_from(raw)
        except IntegrityError as exc:
            if repair:
                with store._tx() as db:
                    db.execute("DELETE FROM blocks WHERE hash=?", (raw[0],))
                    db.execute("INSERT INTO quarantine(hash, reason, at, path) VALUES(?,?,?,NULL)",
                               (key, f"fsck: unreadable catalogue row ({exc})", now))
            rep.problem("block_rows_damaged", key, str(exc), fixed=repair)
            f = store.block_path(raw[0]) if isinstance(raw[0], str) and len(raw[0]) == 64 else None
            if repair and f is not None and raw[0] in named and f.exists() and \
                    _adopt_local(rep, store, f, raw[0], named[raw[0]], repair, now):  # its file may still serve
                usable.add(raw[0])
            continue
        if row.quarantined:
            rep.add("blocks_already_quarantined")
            continue
        if signer is not None and not store.block_visible(row):
            if repair:
                store.quarantine(row.hash, "fsck: no valid signature")
            rep.problem("blocks_unsigned", row.hash, "no namespace signed this row validly (forged or unsigned)",
                        fixed=repair)
            continue
        path = store.block_path(row.hash)
        try:
            data = read_block_file(path, row.file_nbytes)
        except IntegrityError as exc:  # not a regular file, or not the size the catalogue and header say
            if repair:
                store.quarantine(row.hash, f"fsck: {exc}")
            rep.problem("blocks_damaged", row.hash, str(exc), fixed=repair)
            continue
        except FileNotFoundError:
            if repair:
                store.quarantine(row.hash, "fsck: missing block file")
            rep.problem("blocks_missing", row.hash, f"catalogued but {path.name} is missing", fixed=repair)
            continue
        except OSError as exc:
            rep.problem("blocks_damaged", row.hash, f"unreadable: {exc}", fixed=False)
            continue
        why = check_block_bytes(data, row)
        if why is not None:
            if repair:
                store.quarantine(row.hash, f"fsck: {why}")
            rep.problem("blocks_damaged", row.hash, why, fixed=repair)
            continue
        rep.add("blocks_ok")
        usable.add(row.hash)

    bar.close()
    # -- entries
    _check_entries_local(rep, store, repair, usable, now, entry_check, set() if repair else reported)
    # chain rows of entries that no longer exist
    dangling = store._q("SELECT COUNT(*) FROM entry_blocks WHERE entry_id NOT IN (SELECT id FROM entries)")[0][0]
    if dangling:
        if repair:
            with store._tx() as db:
                db.execute("DELETE FROM entry_blocks WHERE entry_id NOT IN (SELECT id FROM entries)")
        rep.problem("index_drift", "entry_blocks", f"{dangling} chain rows of entries that do not exist", fixed=repair)
    return rep


def _check_entries_local(rep: FsckReport, store: LocalStore, repair: bool, usable: set[str], now: float,
                         entry_check: EntryCheck | None, reported: set[str]) -> None:
    """The entries' own checks; `reported`: entries the record comparison already reported (check-only)."""
    cols = LocalStore._ENTRY_COLS
    marks_ok: list[str] = []
    try:
        marked = {e for (e,) in store._q("SELECT entry_id FROM fsck_damaged_entries")}
    except StoreError:
        marked = set()  # never repaired: no marks table yet
    for (eid,) in store._q("SELECT id FROM entries ORDER BY created, id"):
        rep.add("entries_checked")
        if eid in reported:
            continue
        try:
            entry = store.get_entry(eid)
        except IntegrityError as exc:  # SignatureError included
            kind = "entries_forged" if type(exc).__name__ == "SignatureError" else "entry_rows_damaged"
            if repair:  # its record, had it been sound, was put back above: it goes too
                set_aside_local(store, eid, cols, f"fsck: {exc}", record_too=True)
            rep.problem(kind, str(eid), str(exc), fixed=repair)
            continue
        except UnknownEntry:
            rep.add("entries_checked", -1)  # another tenant's entry (a scoped store): not ours to judge
            continue
        except KVMemoryError as exc:
            rep.problem("entry_rows_damaged", str(eid), str(exc), fixed=False)
            continue
        kind, why = self_problem(entry, chunk_for(store, entry), entry_check)
        if why is not None:
            # No sound copy is left (its record, if any, was compared and put back above): set it aside,
            # record and all, so that it is never served; kept for whoever wants to look.
            if repair:
                set_aside_local(store, eid, cols, f"fsck: {why}", record_too=True)
            rep.problem(kind, eid, why, fixed=repair)
            continue
        why = broken_chain(entry.chain, usable)
        if why is not None:
            rep.broken.append(eid)
            if eid in marked:
                rep.add("entries_broken_chain")  # known and marked by an earlier repair: not a new problem
            else:
                if repair:
                    with store._tx() as db:
                        fsck_tables(db)
                        db.execute("INSERT OR REPLACE INTO fsck_damaged_entries(entry_id, reason, at) "
                                   "VALUES(?,?,?)", (eid, why, now))
                    rep.add("entries_marked")
                rep.problem("entries_broken_chain", eid, why, fixed=repair)
        else:
            rep.add("entries_ok")
            marks_ok.append(eid)
    if repair and marks_ok and marked:
        with store._tx() as db:
            for eid in marks_ok:
                if db.execute("DELETE FROM fsck_damaged_entries WHERE entry_id=?", (eid,)).rowcount:
                    rep.add("entries_unmarked")


def _check_profile_files(rep: FsckReport, store: LocalStore, repair: bool) -> None:
    """profiles/<id>.json against their names (the SHA-256 of the profile's canonical JSON): a file that is
    not its name's profile is set aside and written again from the catalogue's copy (the one the engine
    compares against), or only set aside when the catalogue has none."""
    import hashlib
    import json

    from kvmemory.store.safe_files import MAX_RECORD_BYTES, loads_bounded, read_regular

    folder = store.path / "profiles"
    if not folder.is_dir():
        return
    for p in sorted(folder.glob("*.json")):
        try:
            d = loads_bounded(read_regular(p, MAX_RECORD_BYTES), "profile file")
            body = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
            why = None if isinstance(d, dict) and hashlib.sha256(body.encode()).hexdigest() == p.stem else \
                "its contents do not hash to its name (edited or damaged)"
        except (OSError, IntegrityError) as exc:
            why = str(exc)
        if why is None:
            continue
        if repair:
            move_aside(p, store.path / "quarantine" / "profiles")
            try:
                cat = store.get_profile(p.stem) if len(p.stem) == 64 else None
            except IntegrityError:
                cat = None
            if cat is not None and store.records is not None:
                store.records.write_profile(p.stem, cat)
        rep.problem("profile_files_damaged", p.name, why + ("; set aside" + (" and written again from the catalogue"
                    if repair and (store.path / "profiles" / p.name).exists() else "") if repair else ""),
                    fixed=repair)


def _adopt_local(rep: FsckReport, store: LocalStore, f: Path, h: str, verified: bool, repair: bool, now: float) -> bool:
    """A block file without a row that an entry's chain names: catalogued again when it checks on its
    own (header, chain hash, payload), else quarantined. True when it was catalogued."""
    try:
        data = read_block_file(f)
    except IntegrityError as exc:  # not a regular file, or not the size its header says
        data, why = None, str(exc)
    except OSError as exc:
        rep.problem("blocks_damaged", h, f"unreadable: {exc}", fixed=False)
        return False
    meta, why = check_block_file(data, h) if data is not None else (None, why)
    if meta is None:
        if repair:
            move_aside(f, store.path / "quarantine")
        rep.problem("blocks_damaged", h, f"an entry names this uncatalogued block file, but {why}", fixed=repair)
        return False
    if repair:
        with store._tx() as db:
            store._insert_block_rows(db, [meta], {h: len(data)}, verified=verified, pinned=False)
            signer = master_signer(store)
            if signer is not None:  # signed again under each namespace whose signed entry names it
                for ns in _namespaces_naming(db, h):
                    db.execute("INSERT OR IGNORE INTO signatures(kind, key, namespace, sig, chain_sha256) "
                               "VALUES('block',?,?,?,'')", (h, ns, signer.sign_block(meta, ns)))
    rep.problem("blocks_adopted", h, "a block file an entry names had no catalogue row; it checks on its own and "
                "is catalogued again", fixed=repair)
    return repair


def _namespaces_naming(db, h: str) -> list[str]:
    """Namespaces of the entries whose chains name block `h` with its payload hash signed (signed stores)."""
    out = []
    for ns, cs, chain in db.execute(
            "SELECT s.namespace, s.chain_sha256, (SELECT group_concat(hash, ',') FROM (SELECT hash FROM entry_blocks "
            "WHERE entry_id=e.id ORDER BY idx)) FROM entries e JOIN signatures s ON s.kind='entry' AND s.key=e.id "
            "WHERE e.id IN (SELECT entry_id FROM entry_blocks WHERE hash=?)", (h,)):
        if ns not in out and chain and h in (chain or "").split(","):
            out.append(ns)
    return out


def _orphan(rep: FsckReport, store: LocalStore, f: Path, repair: bool, grace: float, now: float, kind: str,
            why: str, purge: bool) -> None:
    try:
        age = now - f.stat().st_mtime
    except OSError:
        return  # gone meanwhile (renamed into place, or removed by its writer)
    if age < grace:
        rep.add("orphans_recent_kept")
        return
    if repair:
        try:
            if purge:
                f.unlink()
            else:
                move_aside(f, store.path / "quarantine" / "orphans")
        except OSError as exc:
            rep.problem(kind, f.name, f"{why}; could not {'remove' if purge else 'move'} it: {exc}", fixed=False)
            return
        if purge and kind == "orphan_payloads":
            rep.add("orphans_purged")
    where = "" if not repair else (" (removed)" if purge else " (kept in quarantine/orphans)")
    rep.problem(kind, f.name, why + where, fixed=repair)


def _purge_quarantined_orphans(rep: FsckReport, folder: Path) -> None:
    """`purge_orphans`: what earlier repairs set aside as orphans is removed now (only on request)."""
    if not folder.is_dir():
        return
    for f in sorted(folder.iterdir()):
        try:
            f.unlink()
            rep.add("orphans_purged")
        except OSError:
            pass

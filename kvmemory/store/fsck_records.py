"""fsck's comparison of a local store's entries with their records (store/records.py), and the checks
an entry makes against itself that need no model: its chain is the chain of its own token ids.

Which copy wins when a catalogue row and its record differ:
- the record was written for a version whose commit never happened (a crash between the record's
  write and the catalogue transaction): the row hashes to the record's `previous_sha256`. The row
  stands; the record is written again from it.
- otherwise the row was changed after its commit (damage, or an edit behind kvmemory's back). The
  record stands when it is sound (its own SHA-256 checked on reading; its chain the chain of its token
  ids; `entry_check`, when given, passes; in a signed store, its signature verifies); the row is kept
  in `quarantined_entries` and replaced. When the record is not sound but the row is, the row stands.
  When neither is, the entry is set aside whole (kept, never served).
"""

from __future__ import annotations

from kvmemory.errors import IntegrityError, StoreError, UnknownEntry
from kvmemory.store.fsck_common import set_aside_local
from kvmemory.store.local import EntryRecord, LocalStore
from kvmemory.store.records import Record, content_sha256, entry_json, parse_record
from kvmemory.store.rebuild import chain_matches_ids, chunk_of
from kvmemory.store.safe_files import MAX_RECORD_BYTES, read_regular


def chunk_for(store, entry: EntryRecord) -> int | None:
    """The chunk grid an entry was made under: its profile's, else its first chain block's size."""
    try:
        profile = store.get_profile(entry.profile_id)
    except (IntegrityError, StoreError):
        profile = None
    tokens = None
    if entry.chain and not chunk_of(profile):
        try:
            row = store.get_block(entry.chain[0])
        except (IntegrityError, StoreError):
            row = None
        tokens = row.n_tokens if row is not None else None
    return chunk_of(profile, tokens)


def self_problem(entry: EntryRecord, chunk: int | None, entry_check=None) -> tuple[str, str | None]:
    """(kind, why) when an entry does not check against itself, else (kind, None)."""
    if not chain_matches_ids(entry, chunk):
        return "entries_inconsistent", ("its chain is not the chain of its own token ids under its profile "
                                        "(its token ids or its chain were changed)")
    if entry_check is not None:
        why = entry_check(entry)
        if why is not None:
            return "entries_self_mismatch", why
    return "entries_self_mismatch", None


def differing_fields(a: EntryRecord, b: EntryRecord) -> list[str]:
    ja, jb = entry_json(a), entry_json(b)
    return sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))


def row_signature(store, entry: EntryRecord) -> dict | None:
    """The entry's signature as a signed local store holds it (None elsewhere)."""
    sigs = getattr(store, "_sigs", None)
    if sigs is None:
        return None
    for ns, sig, cs in sigs("entry", entry.id):
        if ns == entry.namespace:
            return {"namespace": ns, "sig": sig, "chain_sha256": cs.split(",") if cs else []}
    return None


def signature_ok(store, entry: EntryRecord, signature: dict | None) -> bool:
    """Whether `signature` vouches for `entry` (always True in an unsigned store)."""
    signer = getattr(store, "signer", None)
    if signer is None:
        return True
    if not signature or signature.get("namespace") != entry.namespace or not signer.can_sign(entry.namespace):
        return False
    try:
        signer.verify_entry(entry, list(signature.get("chain_sha256") or ()), signature.get("sig"))
    except IntegrityError:
        return False
    return True


def _sound(store, entry: EntryRecord, signature: dict | None, entry_check) -> str | None:
    """Why this copy of an entry cannot be trusted, or None."""
    _, why = self_problem(entry, chunk_for(store, entry), entry_check)
    if why is not None:
        return why
    if not signature_ok(store, entry, signature):
        return "its signature does not verify"
    return None


def _restore(store: LocalStore, entry: EntryRecord, signature: dict | None) -> None:
    """Put an entry's row (and chain, and signature) back from its record, in one transaction."""
    with store._tx() as db:
        LocalStore.insert_entry_rows(db, entry)
        if signature and getattr(store, "signer", None) is not None:
            db.execute("INSERT OR REPLACE INTO signatures(kind, key, namespace, sig, chain_sha256) "
                       "VALUES('entry',?,?,?,?)", (entry.id, signature.get("namespace"), signature.get("sig"),
                                                  ",".join(signature.get("chain_sha256") or ())))


def reconcile_local(rep, store: LocalStore, repair: bool, entry_check=None,
                    grace: float = 0.0) -> tuple[dict[str, bool], set[str]]:
    """Compare every entry row with its record, report (and with `repair`, fix) what differs. Returns
    the blocks the entries' chains name (after repair; with check-only, also what records would bring
    back), each with whether a verified entry names it, and the entries reported here. A record without
    a row younger than `grace` seconds is left alone: its writer may not have committed yet."""
    import time

    rf = store.records
    cols = LocalStore._ENTRY_COLS
    reported: set[str] = set()
    if rf is not None:
        ids = [eid for (eid,) in store._q("SELECT id FROM entries")]
        rows: dict[str, EntryRecord | IntegrityError] = {}
        for eid in ids:
            if not isinstance(eid, str):  # a damaged id: the entry checks report and set it aside
                continue
            try:
                rows[eid] = LocalStore.get_entry(store, eid)
            except (IntegrityError, UnknownEntry) as exc:
                rows[eid] = IntegrityError(str(exc))
        ids = [eid for eid in ids if isinstance(eid, str)]
        by_name = {rf.path(eid).name: eid for eid in ids}
        records: dict[str, Record] = {}
        damaged: dict[str, tuple] = {}  # entry id (or file name) -> (path, why)
        for p in rf.files():
            try:
                rec = parse_record(read_regular(p, MAX_RECORD_BYTES))
                if rf.path(rec.entry.id) != p:
                    raise IntegrityError(f"the record file of another entry ({rec.entry.id!r})")
            except (OSError, IntegrityError) as exc:
                damaged[by_name.get(p.name, p.stem)] = (p, str(exc))
                continue
            records[rec.entry.id] = rec
        for p in rf.tombstones():
            eid = by_name.get(p.name[: -len(".forgotten")], p.name.split(".json")[0])
            live = eid in rows
            if repair:
                (rf.undo_forget if live else rf.end_forget)(eid)
            rep.problem("entry_records_forgotten", eid,
                        "a forget was interrupted before its commit: the entry stays" if live else
                        "a forget was interrupted after its commit: its record goes", fixed=repair)
        now = time.time()
        for eid in sorted(set(rows) | set(records) | set(damaged), key=str):
            if eid not in rows and grace > 0:
                try:
                    young = now - rf.path(eid).stat().st_mtime < grace
                except OSError:
                    young = False
                if young:
                    rep.add("orphans_recent_kept")
                    records.pop(eid, None)
                    continue
            before = len(rep.problems)
            _one(rep, store, rf, eid, rows.get(eid), records.get(eid), damaged.get(eid), repair, entry_check, cols,
                 set_aside_local)
            if len(rep.problems) != before:
                reported.add(eid)
    named: dict[str, bool] = {}
    for h, ver in store._q("SELECT eb.hash, e.verified FROM entry_blocks eb JOIN entries e ON e.id = eb.entry_id"):
        named[h] = named.get(h, False) or bool(ver)
    if rf is not None and not repair:
        for rec in records.values():
            for h in rec.entry.chain:
                named[h] = named.get(h, False) or rec.entry.verified
    return named, reported


def _back(repair: bool) -> str:
    return "put back from its record" if repair else "its record can put it back (fsck --repair)"


def _one(rep, store, rf, eid, row, rec, damaged, repair: bool, entry_check, cols, set_aside_local) -> None:
    """One entry id: its row (an EntryRecord, an IntegrityError, or None), its record (or None), and its
    damaged record file (or None)."""
    if damaged is not None:
        path, why = damaged
        sound_row = isinstance(row, EntryRecord) and _sound(store, row, row_signature(store, row), entry_check) is None
        if repair:
            rf.set_aside(path, f"fsck: {why}")
            if sound_row:
                rf.write(row, signature=row_signature(store, row))
        what = ("written again from its catalogue row" if sound_row else
                "set aside" + ("" if row is not None else " (no catalogue row either)"))
        rep.problem("entry_records_damaged", str(eid), f"{why}; {what}", fixed=repair)
        if rec is None:
            return
    if isinstance(row, IntegrityError):
        if rec is not None and _sound(store, rec.entry, rec.signature, entry_check) is None:
            if repair:
                set_aside_local(store, eid, cols, f"fsck: {row}")
                _restore(store, rec.entry, rec.signature)
            rep.problem("entry_rows_damaged", eid, f"{row}; put back from its record", fixed=repair)
        # else: left to the entry checks, which set the row aside
        return
    if row is None:
        if rec is None:
            return
        why = _sound(store, rec.entry, rec.signature, entry_check)
        if why is None:
            if repair:
                _restore(store, rec.entry, rec.signature)
                rep.add("entries_restored")
            rep.problem("entries_missing_from_catalogue", eid, "its record is here but its catalogue row is not; "
                        + _back(repair), fixed=repair)
        else:
            if repair:
                rf.set_aside(rf.path(eid), f"fsck: {why}")
            rep.problem("entry_records_damaged", eid, f"a record without a catalogue row that does not check ({why}); "
                        "set aside", fixed=repair)
        return
    if rec is None:
        if damaged is None:  # a row without a record (a store from before records, or a lost file)
            sound = _sound(store, row, row_signature(store, row), entry_check) is None
            if repair and sound:
                rf.write(row, signature=row_signature(store, row))
            rep.problem("entry_records_missing", eid, "no record beside the blocks" +
                        ("; written from its catalogue row" if sound else ""), fixed=repair and sound)
        return
    have = content_sha256(row)
    if have == rec.content_sha256:
        return
    if rec.previous_sha256 == have:
        if repair:
            rf.write(row, previous_sha256=None, signature=row_signature(store, row))
        rep.problem("entry_records_stale", eid, "its record was written for a version that was never committed; "
                    "written again from the catalogue row", fixed=repair)
        return
    fields = ", ".join(differing_fields(row, rec.entry))
    rec_why = _sound(store, rec.entry, rec.signature, entry_check)
    if rec_why is None:
        if repair:
            set_aside_local(store, eid, cols, f"fsck: the row differs from its record ({fields})")
            _restore(store, rec.entry, rec.signature)
        rep.problem("entries_altered", eid, f"its catalogue row differs from its record in {fields}; "
                    + _back(repair), fixed=repair)
        return
    row_why = _sound(store, row, row_signature(store, row), entry_check)
    if row_why is None:
        if repair:
            rf.set_aside(rf.path(eid), f"fsck: differs from the row and does not check ({rec_why})")
            rf.write(row, signature=row_signature(store, row))
        rep.problem("entry_records_damaged", eid, f"its record differs from its row in {fields} and does not check "
                    f"({rec_why}); written again from the row", fixed=repair)
        return
    if repair:
        set_aside_local(store, eid, cols, f"fsck: neither the row ({row_why}) nor the record ({rec_why}) checks",
                        record_too=True)
    rep.problem("entries_altered", eid, f"its row and its record differ in {fields} and neither checks (row: "
                f"{row_why}; record: {rec_why}); set aside, never served", fixed=repair)


__all__ = ["reconcile_local", "self_problem", "chunk_for", "row_signature", "signature_ok", "differing_fields"]

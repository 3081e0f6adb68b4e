"""`kvmemory fsck`: check a store from end to end, and with `repair=True` put it back in order.

    report = run_fsck(store, repair=False)                       # check only: nothing is changed
    report = run_fsck(store, repair=True, router_rebuild=router_rebuilder(store))   # kvmemory.routing.router; or mem.reindex
    report = fsck_at("./my-store", repair=True)                  # also a store whose catalogue is lost
    print(report.summary()); json.dumps(report.to_json()); sys.exit(report.exit_code)

What is checked (LocalStore, SignedLocalStore and RedisStore alike):
- the catalogue itself: SQLite `PRAGMA integrity_check` (local); index sets against the keys they
  index (Redis); every row parsed and type-checked; a local catalogue that is missing or empty while
  entry records or blocks are there (the store then refuses every other command: `CatalogueLost`);
- every entry against its record (store/records.py: a second copy beside the blocks, with its own
  SHA-256): a row that differs from its record, a missing or damaged record, a record whose row is
  gone, a forget that was interrupted;
- every block: its file (or Redis payload) read whole and checked as a graft would check it --
  canonical header, header against the catalogue row, payload size, payload SHA-256 -- plus, in signed
  stores opened with the master key, that some namespace signed the row;
- orphans: block files or payloads no row names, and stale `tmp/` files of dead writers;
- every entry: readable, signed (signed stores), its chain the chain of its own token ids, what
  `entry_check` (the memory layer: its texts re-tokenize to its token ids) says, and whether its chain
  references blocks that are missing, quarantined or damaged;
- the router, when `router_check` is given (routing/check.py: every routed row names an entry of its
  namespace by one of that entry's own texts, and every entry is routed).

What `repair=True` does, never deleting what could still serve:
- rebuilds a missing, empty or damaged local catalogue from the records and the blocks
  (store/rebuild.py; the old catalogue is kept in quarantine/);
- puts back entry rows from their records (a damaged row is kept in `quarantined_entries`), writes
  missing records, moves damaged records into quarantine/records/ and writes them again from a sound
  row; sets aside entries with no sound copy at all (kept, never served);
- catalogues again a block file that an entry names and whose header and payload check; quarantines
  damaged, missing and forged blocks (never read again; a later write of the same block replaces them);
- moves orphans older than `grace_seconds` into quarantine/orphans/ (younger ones may belong to a
  writer that has not committed yet); `purge_orphans=True` deletes them, and empties that folder;
- marks entries with broken chains (table `fsck_damaged_entries` locally, hash `kvm:{<s>}:damaged` in
  Redis) and, when `recompute` is given (the memory layer: `KVMemory.recompute`), recomputes and
  re-proves their blocks, clearing the mark; marks of entries found whole again are cleared;
- recounts Redis block references, and calls `router_rebuild()` (e.g. `KVMemory.reindex`) so the
  router matches the catalogue again.

Exit codes (`FsckReport.exit_code`): 0 clean, 1 problems found and all repaired, 4 problems left.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmemory.errors import CatalogueLost, IntegrityError, KVMemoryError, StoreError, UnknownEntry
from kvmemory.store.blocks import encode_header, parse_header
from kvmemory.store.local import BlockRow, EntryRecord, LocalStore, block_row_from, check_meta

GRACE_SECONDS = 60.0
MAX_LISTED = 1000

EntryCheck = Callable[[EntryRecord], "str | None"]  # why an entry does not check against itself, or None
RouterCheck = Callable[[], "list[tuple[str, str]]"]  # (key, detail) per problem of the router
Recompute = Callable[["list[str]"], "dict[str, str | None]"]  # entry id -> None (re-proven) or why not

_COUNTS = ("blocks_checked", "blocks_ok", "blocks_damaged", "blocks_missing", "blocks_unsigned",
           "block_rows_damaged", "blocks_already_quarantined", "blocks_adopted", "orphan_payloads",
           "orphans_recent_kept", "orphans_purged", "stale_tmp_files", "entries_checked", "entries_ok",
           "entries_broken_chain", "entries_forged", "entry_rows_damaged", "entries_altered",
           "entries_inconsistent", "entries_self_mismatch", "entries_missing_from_catalogue", "entries_restored",
           "entry_records_missing", "entry_records_damaged", "entry_records_stale", "entry_records_forgotten",
           "entries_marked", "entries_unmarked", "entries_recomputed", "entries_unproven", "index_drift",
           "router_drift", "refs_fixed", "catalogue_rebuilt", "repaired", "unrepaired")


@dataclass
class FsckReport:
    """Counts of what fsck found and did, plus the first `MAX_LISTED` problems by name."""

    store: str
    kind: str
    repair: bool
    catalogue: str = "ok"
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[dict] = field(default_factory=list)
    router_rebuilt: int | None = None
    seconds: float = 0.0
    broken: list[str] = field(default_factory=list)  # entries whose chains are broken (recompute them)
    rebuild: dict | None = None  # what rebuilding the catalogue did (store/rebuild.py), when it ran

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def problem(self, kind: str, key: str, detail: str, *, fixed: bool) -> None:
        self.add(kind)
        if fixed:
            self.add("repaired")
        else:
            self.add("unrepaired")
        if len(self.problems) < MAX_LISTED:
            self.problems.append({"kind": kind, "key": key, "detail": detail, "repaired": fixed})

    def n(self, name: str) -> int:
        return self.counts.get(name, 0)

    @property
    def clean(self) -> bool:
        return self.catalogue == "ok" and not self.n("repaired") and not self.n("unrepaired")

    @property
    def exit_code(self) -> int:
        if self.catalogue != "ok" or self.n("unrepaired"):
            return 4
        return 1 if self.n("repaired") else 0

    def to_json(self) -> dict:
        return {
            "store": self.store, "kind": self.kind, "repair": self.repair, "catalogue": self.catalogue,
            **{k: self.n(k) for k in _COUNTS},
            "router_rebuilt": self.router_rebuilt, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
            "problems": self.problems, **({"rebuild": self.rebuild} if self.rebuild is not None else {}),
        }

    def summary(self) -> str:
        j = self.to_json()
        head = (f"fsck {self.store} ({self.kind}{', repair' if self.repair else ', check only'}): catalogue "
                f"{self.catalogue}; {j['blocks_checked']} blocks checked, {j['blocks_ok']} ok; "
                f"{j['entries_checked']} entries checked, {j['entries_ok']} ok")
        lines = [head]
        for k, v in j.items():
            if isinstance(v, int) and not isinstance(v, bool) and v and k not in (
                    "blocks_checked", "blocks_ok", "entries_checked", "entries_ok", "exit_code"):
                lines.append(f"  {k}: {v}")
        if self.router_rebuilt is not None:
            lines.append(f"  router rebuilt: {self.router_rebuilt} texts")
        for p in self.problems[:20]:
            lines.append(f"  - {p['kind']} {p['key'][:16]}: {p['detail']}{' (repaired)' if p['repaired'] else ''}")
        if len(self.problems) > 20:
            lines.append(f"  ... {len(self.problems) - 20} more (see --json)")
        lines.append("clean" if self.clean else ("repaired" if self.exit_code == 1 else
                                                 "problems left: run `kvmemory fsck --repair`"))
        return "\n".join(lines)


def check_block_bytes(data: bytes, row: BlockRow) -> str | None:
    """Why the bytes of a block file do not match its catalogue row (None when they do). The same checks
    a graft makes before a byte reaches the model, without side effects."""
    try:
        meta, off = parse_header(data)
    except IntegrityError as exc:
        return str(exc)
    if data[:off] != encode_header(meta):
        return "block header is not in canonical form"
    try:
        check_meta(meta, row)
    except IntegrityError as exc:
        return str(exc)
    if len(data) - off != row.payload_nbytes:
        return f"payload has {len(data) - off} bytes, the catalogue says {row.payload_nbytes}"
    if hashlib.sha256(memoryview(data)[off:]).hexdigest() != row.payload_sha256:
        return "payload SHA-256 does not match the catalogue"
    return None


def run_fsck(store, repair: bool = False, router_rebuild: Callable[[], int] | None = None, *,
             grace_seconds: float = GRACE_SECONDS, purge_orphans: bool = False, router_check: RouterCheck | None = None,
             entry_check: EntryCheck | None = None, recompute: Recompute | None = None) -> FsckReport:
    """Check (and with `repair`, fix) `store`; see the module docstring. Never raises for damage it finds:
    damage is what it reports. Raises StoreError only when the store cannot be reached at all."""
    t0 = time.perf_counter()
    if repair and getattr(store, "readonly", False):
        from kvmemory.errors import StoreReadOnly

        raise StoreReadOnly("fsck --repair needs a writable store (this one was opened read-only)")
    if repair and getattr(store, "namespace", None) is not None:
        from kvmemory.errors import InvalidInput

        raise InvalidInput("fsck --repair works on the whole store: open it without a namespace, with the master key")
    if getattr(store, "kind", "") == "redis":
        from kvmemory.store.fsck_redis import fsck_redis

        report = fsck_redis(store, repair, grace_seconds, purge_orphans=purge_orphans, entry_check=entry_check)
    elif isinstance(store, LocalStore):
        report = _fsck_local(store, repair, grace_seconds, purge_orphans, entry_check)
    else:
        raise StoreError(f"fsck does not know stores of kind {getattr(store, 'kind', type(store).__name__)!r}")
    if report.catalogue == "ok" and router_check is not None:
        try:
            found = router_check()
        except KVMemoryError as exc:  # an unreadable router: rebuilt by the repair
            found = [("router", str(exc))]
        for key, detail in found:
            report.problem("router_drift", key, detail, fixed=repair and router_rebuild is not None)
    if repair and report.broken:
        _recompute(report, store, recompute)
    if repair and router_rebuild is not None and report.catalogue == "ok":
        report.router_rebuilt = int(router_rebuild())
    report.seconds = time.perf_counter() - t0
    return report


def _recompute(rep: FsckReport, store, recompute: Recompute | None) -> None:
    """Entries whose chains are broken: recomputed and re-proven by the memory layer when it is given
    (then their marks are cleared), else left marked: `kvmemory verify` counts them unproven."""
    if recompute is None:
        rep.add("entries_unproven", len(rep.broken))
        return
    results = recompute(list(rep.broken))
    for eid in rep.broken:
        why = results.get(eid, "not recomputed")
        if why is None:
            rep.add("entries_recomputed")
            _unmark(store, eid)
        else:
            rep.add("entries_unproven")
            rep.problem("entries_unproven", eid, f"its blocks could not be recomputed and re-proven: {why}",
                        fixed=False)


def _unmark(store, eid: str) -> None:
    if getattr(store, "kind", "") == "redis":
        store.client.hdel(store.k_damaged(), eid)
        return
    try:
        with store._tx() as db:
            db.execute("DELETE FROM fsck_damaged_entries WHERE entry_id=?", (eid,))
    except StoreError:
        pass  # never marked (no table yet)


def fsck_at(spec, *, signing_key=None, repair: bool = False, router: Callable | None = None, **kw) -> FsckReport:
    """`run_fsck` on the store `spec` names (a folder or a redis:// URL), including a local store whose
    catalogue is lost (which every other command refuses): check-only reports it without creating
    anything; `repair` rebuilds the catalogue first (store/rebuild.py). `router(store)` returns
    (router_check, router_rebuild) for the opened store; `kw` goes to `run_fsck`."""
    from kvmemory.store.open import is_redis_url, open_store

    extra = {} if is_redis_url(spec) else {"create": False}
    rebuilt = None
    try:
        store = open_store(spec, signing_key=signing_key, **extra)
    except CatalogueLost as exc:
        path = Path(str(spec)).expanduser()
        if not repair:
            rep = FsckReport(str(path), "local", False, catalogue=f"lost: {exc}")
            rep.problem("catalogue_lost", "catalogue.sqlite", str(exc), fixed=False)
            return rep
        from kvmemory.store.rebuild import rebuild_catalogue
        from kvmemory.store.signing import Signer

        rebuilt = rebuild_catalogue(path, signer=Signer.resolve(signing_key) if signing_key is not None else None)
        store = open_store(spec, signing_key=signing_key, **extra)
    try:
        check, rebuild = router(store) if router is not None else (None, None)
        rep = run_fsck(store, repair=repair, router_rebuild=rebuild, router_check=check, **kw)
    finally:
        store.close()
    if rebuilt is not None:
        _note_rebuild(rep, rebuilt, "the catalogue was missing or empty")
    return rep


def _note_rebuild(rep: FsckReport, rebuilt: dict, why: str) -> None:
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


def _master_signer(store):
    """The signer to check block signatures with: only an unscoped (master) one can judge every row."""
    s = getattr(store, "signer", None)
    return s if s is not None and s.scope is None else None


# ---------------------------------------------------------------------- local
_FSCK_SCHEMA = """
CREATE TABLE IF NOT EXISTS fsck_damaged_entries(entry_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS quarantined_entries(id TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
                                               row_json TEXT NOT NULL);
"""

_BLOCK_COLS = ("hash, parent, profile_id, idx, n_tokens, payload_sha256, payload_nbytes, file_nbytes, verified, "
               "pinned, quarantined")


def _fsck_tables(db) -> None:
    """fsck's own tables, created when a repair first needs them (not before: the disk may be full)."""
    for stmt in _FSCK_SCHEMA.strip().split(";"):
        if stmt.strip():
            db.execute(stmt)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsck_local(store: LocalStore, repair: bool, grace: float, purge: bool = False,
                entry_check: EntryCheck | None = None) -> FsckReport:
    from kvmemory.store.fsck_records import reconcile_local

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
        from kvmemory.store.rebuild import rebuild_catalogue

        store.close()
        _note_rebuild(rep, rebuild_catalogue(store.path, signer=getattr(store, "signer", None)),
                      f"the catalogue was damaged ({detail})")
    signer = _master_signer(store)
    now = time.time()

    # -- entries against their records first: rows put back from records name the blocks adopted below
    # No grace for records without rows: putting back an entry whose writer is about to commit it
    # writes the same row the writer writes (a check-only pass may report it meanwhile).
    named, reported = reconcile_local(rep, store, repair, entry_check)

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
    for raw in store._q(f"SELECT {_BLOCK_COLS} FROM blocks"):
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
            data = path.read_bytes()
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
    from kvmemory.store.fsck_records import chunk_for, self_problem

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
        bad = [h for h in entry.chain if h not in usable]
        if bad:
            first = entry.chain.index(bad[0])
            why = (f"{len(bad)} of {len(entry.chain)} chain blocks missing, quarantined or damaged; grafts stop at "
                   f"block {first}")
            rep.broken.append(eid)
            if eid in marked:
                rep.add("entries_broken_chain")  # known and marked by an earlier repair: not a new problem
            else:
                if repair:
                    with store._tx() as db:
                        _fsck_tables(db)
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


def _adopt_local(rep: FsckReport, store: LocalStore, f: Path, h: str, verified: bool, repair: bool, now: float) -> bool:
    """A block file without a row that an entry's chain names: catalogued again when it checks on its
    own (header, chain hash, payload), else quarantined. True when it was catalogued."""
    from kvmemory.store.rebuild import check_block_file, move_aside

    try:
        data = f.read_bytes()
    except OSError as exc:
        rep.problem("blocks_damaged", h, f"unreadable: {exc}", fixed=False)
        return False
    meta, why = check_block_file(data, h)
    if meta is None:
        if repair:
            move_aside(f, store.path / "quarantine")
        rep.problem("blocks_damaged", h, f"an entry names this uncatalogued block file, but {why}", fixed=repair)
        return False
    if repair:
        with store._tx() as db:
            store._insert_block_rows(db, [meta], {h: len(data)}, verified=verified, pinned=False)
            signer = _master_signer(store)
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
                from kvmemory.store.rebuild import move_aside

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


def set_aside_local(store: LocalStore, eid, cols: str, reason: str, *, record_too: bool = False) -> None:
    """Move an entry row out of the catalogue into `quarantined_entries` (kept, never served); with
    `record_too`, its record into quarantine/records/ as well (so no repair puts it back)."""
    with store._tx() as db:
        _fsck_tables(db)
        row = db.execute(f"SELECT {cols} FROM entries WHERE id=?", (eid,)).fetchone()
        names = [c.strip() for c in cols.split(",")]
        body = {n: (v.hex() if isinstance(v, bytes) else v) for n, v in zip(names, row or ())}
        chain = [h for (h,) in db.execute("SELECT hash FROM entry_blocks WHERE entry_id=? ORDER BY idx", (eid,))]
        body["chain"] = chain
        db.execute("INSERT INTO quarantined_entries(id, reason, at, row_json) VALUES(?,?,?,?)",
                   (str(eid), reason, time.time(), json.dumps(body, default=repr)))
        db.execute("DELETE FROM entries WHERE id=?", (eid,))
        db.execute("DELETE FROM entry_blocks WHERE entry_id=?", (eid,))
        try:
            db.execute("DELETE FROM signatures WHERE kind='entry' AND key=?", (eid,))
        except sqlite3.OperationalError:
            pass  # an unsigned store has no signatures table
    rf = store.records
    if record_too and rf is not None and isinstance(eid, str) and rf.path(eid).exists():
        rf.set_aside(rf.path(eid), reason)


_set_aside_local = set_aside_local  # the name earlier versions used

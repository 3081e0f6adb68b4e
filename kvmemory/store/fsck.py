"""`kvmemory fsck`: check a store from end to end, and with `repair=True` put it back in order.

    report = run_fsck(store, repair=False)                       # check only: nothing is changed
    report = run_fsck(store, repair=True, router_rebuild=router_rebuilder(store))   # kvmemory.routing.router; or mem.reindex
    print(report.summary()); json.dumps(report.to_json()); sys.exit(report.exit_code)

What is checked (LocalStore, SignedLocalStore and RedisStore alike):
- the catalogue itself: SQLite `PRAGMA integrity_check` (local); index sets against the keys they
  index (Redis); every row parsed and type-checked;
- every block: its file (or Redis payload) read whole and checked as a graft would check it --
  canonical header, header against the catalogue row, payload size, payload SHA-256 -- plus, in signed
  stores opened with the master key, that some namespace signed the row;
- orphans: block files or payloads no row names, and stale `tmp/` files of dead writers;
- every entry: readable, signed (signed stores), and whether its chain references blocks that are
  missing, quarantined or damaged (such an entry stays usable: its grafts are just shorter).

What `repair=True` does: quarantines damaged, missing and forged blocks (never read again; a later
write of the same block replaces them); removes orphans older than `grace_seconds` (younger ones may
belong to a writer that has not committed yet); sets aside unreadable, unsigned or forged entries;
marks entries with broken chains (table `fsck_damaged_entries` locally, hash `kvm:{<s>}:damaged` in
Redis; marks of entries found whole again are cleared); recounts Redis block references; and calls
`router_rebuild()` (e.g. `KVMemory.reindex`) so the router matches the catalogue again.

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

from kvmemory.store.blocks import encode_header, parse_header
from kvmemory.errors import IntegrityError, KVMemoryError, StoreError, UnknownEntry
from kvmemory.store.local import BlockRow, LocalStore, block_row_from, check_meta

GRACE_SECONDS = 60.0
MAX_LISTED = 1000


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
        keys = ("blocks_checked", "blocks_ok", "blocks_damaged", "blocks_missing", "blocks_unsigned",
                "block_rows_damaged", "blocks_already_quarantined", "orphan_payloads", "orphans_recent_kept",
                "stale_tmp_files", "entries_checked", "entries_ok", "entries_broken_chain", "entries_forged",
                "entry_rows_damaged", "entries_marked", "entries_unmarked", "index_drift", "refs_fixed",
                "repaired", "unrepaired")
        return {
            "store": self.store, "kind": self.kind, "repair": self.repair, "catalogue": self.catalogue,
            **{k: self.n(k) for k in keys},
            "router_rebuilt": self.router_rebuilt, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
            "problems": self.problems,
        }

    def summary(self) -> str:
        j = self.to_json()
        head = (f"fsck {self.store} ({self.kind}{', repair' if self.repair else ', check only'}): catalogue "
                f"{self.catalogue}; {j['blocks_checked']} blocks checked, {j['blocks_ok']} ok; "
                f"{j['entries_checked']} entries checked, {j['entries_ok']} ok")
        lines = [head]
        for k, v in j.items():
            if isinstance(v, int) and v and k not in ("blocks_checked", "blocks_ok", "entries_checked", "entries_ok",
                                                       "exit_code"):
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
             grace_seconds: float = GRACE_SECONDS) -> FsckReport:
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
        report = _fsck_redis(store, repair, grace_seconds)
    elif isinstance(store, LocalStore):
        report = _fsck_local(store, repair, grace_seconds)
    else:
        raise StoreError(f"fsck does not know stores of kind {getattr(store, 'kind', type(store).__name__)!r}")
    if repair and router_rebuild is not None and report.catalogue == "ok":
        report.router_rebuilt = int(router_rebuild())
    report.seconds = time.perf_counter() - t0
    return report


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


def _fsck_local(store: LocalStore, repair: bool, grace: float) -> FsckReport:
    rep = FsckReport(str(store.path), store.kind, repair)
    try:
        res = [r[0] for r in store._q("PRAGMA integrity_check")]
    except StoreError as exc:
        rep.catalogue = str(exc)
        return rep
    if res != ["ok"]:
        rep.catalogue = "; ".join(str(r) for r in res[:5])
        return rep  # a damaged SQLite file: nothing below could be trusted (restore it, or .recover it)
    signer = _master_signer(store)
    now = time.time()

    # -- orphan block files and stale tmp files first: removing them frees room on a full disk for the rest
    catalogued = {h for (h,) in store._q("SELECT hash FROM blocks")}
    for f in sorted((store.path / "blocks").rglob("*")) if (store.path / "blocks").exists() else []:
        if f.is_dir():
            continue
        h = f.stem if f.suffix == ".kvb" else None
        if h is not None and h in catalogued and f == store.block_path(h):
            continue
        _orphan(rep, f, repair, grace, now, "orphan_payloads", "no catalogue row names this file")
    for f in sorted((store.path / "tmp").iterdir()) if (store.path / "tmp").exists() else []:
        parts = f.name.split(".")
        pid = int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None
        dead = pid is None or not _pid_alive(pid)
        _orphan(rep, f, repair, grace if not dead else 0.0, now, "stale_tmp_files",
                "unfinished write of a writer that is gone" if dead else "unfinished write")

    # -- block rows and their files
    rows: dict[str, BlockRow] = {}
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
            continue
        rows[row.hash] = row
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
    cols = LocalStore._ENTRY_COLS
    marks_ok: list[str] = []
    try:
        marked = {e for (e,) in store._q("SELECT entry_id FROM fsck_damaged_entries")}
    except StoreError:
        marked = set()  # never repaired: no marks table yet
    for (eid,) in store._q("SELECT id FROM entries ORDER BY created, id"):
        rep.add("entries_checked")
        try:
            entry = store.get_entry(eid)
        except IntegrityError as exc:  # SignatureError included
            kind = "entries_forged" if type(exc).__name__ == "SignatureError" else "entry_rows_damaged"
            if repair:
                _set_aside_local(store, eid, cols, f"fsck: {exc}")
            rep.problem(kind, str(eid), str(exc), fixed=repair)
            continue
        except UnknownEntry:
            rep.add("entries_checked", -1)  # another tenant's entry (a scoped store): not ours to judge
            continue
        except KVMemoryError as exc:
            rep.problem("entry_rows_damaged", str(eid), str(exc), fixed=False)
            continue
        bad = [h for h in entry.chain if h not in usable]
        if bad:
            first = entry.chain.index(bad[0])
            why = (f"{len(bad)} of {len(entry.chain)} chain blocks missing, quarantined or damaged; grafts stop at "
                   f"block {first}")
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
    # chain rows of entries that no longer exist
    dangling = store._q("SELECT COUNT(*) FROM entry_blocks WHERE entry_id NOT IN (SELECT id FROM entries)")[0][0]
    if dangling:
        if repair:
            with store._tx() as db:
                db.execute("DELETE FROM entry_blocks WHERE entry_id NOT IN (SELECT id FROM entries)")
        rep.problem("index_drift", "entry_blocks", f"{dangling} chain rows of entries that do not exist", fixed=repair)
    if repair and marks_ok and marked:
        with store._tx() as db:
            for eid in marks_ok:
                if db.execute("DELETE FROM fsck_damaged_entries WHERE entry_id=?", (eid,)).rowcount:
                    rep.add("entries_unmarked")
    return rep


def _orphan(rep: FsckReport, f: Path, repair: bool, grace: float, now: float, kind: str, why: str) -> None:
    try:
        age = now - f.stat().st_mtime
    except OSError:
        return  # gone meanwhile (renamed into place, or removed by its writer)
    if age < grace:
        rep.add("orphans_recent_kept")
        return
    if repair:
        try:
            f.unlink()
        except OSError as exc:
            rep.problem(kind, f.name, f"{why}; could not remove it: {exc}", fixed=False)
            return
    rep.problem(kind, f.name, why, fixed=repair)


def _set_aside_local(store: LocalStore, eid, cols: str, reason: str) -> None:
    """Move an entry row out of the catalogue into `quarantined_entries` (kept, never served)."""
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


# ---------------------------------------------------------------------- redis
def _fsck_redis(store, repair: bool, grace: float) -> FsckReport:
    r = store.client
    rep = FsckReport(f"{store.url} store {store.name!r}", store.kind, repair)
    if not store.ping():
        raise store._unavailable_error("fsck")
    signer = _master_signer(store)
    now = time.time()
    pre = store.k_block("")

    # -- index drift: row keys the blocks zset does not list, and the reverse
    indexed = set(_index(store, rep, repair, store.k_blocks(), lambda: store.all_block_hashes()))
    keyed = {k.decode()[len(pre):] for k in r.scan_iter(match=pre + "*", count=1000)}
    for h in sorted(keyed - indexed):
        if repair:
            r.zadd(store.k_blocks(), {h: now})
        rep.problem("index_drift", h, "block row missing from the blocks index", fixed=repair)
    for h in sorted(indexed - keyed):
        if repair:
            r.zrem(store.k_blocks(), h)
        rep.problem("index_drift", h, "blocks index names a row that does not exist", fixed=repair)

    rows: dict[str, BlockRow] = {}
    usable: set[str] = set()
    hashes = sorted(keyed)
    for i in range(0, len(hashes), 200):
        chunk = hashes[i : i + 200]
        raws = store._fetch(lambda c=chunk: store._raw_rows(c), "fsck")
        p = r.pipeline(transaction=False)
        for h in chunk:
            p.get(store.k_payload(h))
        try:
            payloads = p.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - a pipeline-level failure is an outage
            raise store._unavailable_error("fsck", exc) from exc
        for h, raw, data in zip(chunk, raws, payloads):
            rep.add("blocks_checked")
            try:
                row, sigs = store.parse_block_row(h, raw)
            except IntegrityError as exc:
                if repair:
                    r.rename(store.k_block(h), f"{store._pre}qb:{h}")
                    r.zrem(store.k_blocks(), h)
                    r.rpush(store.k_qlog(), json.dumps({"hash": h, "reason": f"fsck: {exc}", "at": now}))
                rep.problem("block_rows_damaged", h, str(exc), fixed=repair)
                continue
            rows[h] = row
            if row.quarantined:
                rep.add("blocks_already_quarantined")
                continue
            if signer is not None and not store._visible(row, sigs):
                if repair:
                    store.quarantine(h, "fsck: no valid signature")
                rep.problem("blocks_unsigned", h, "no namespace signed this row validly (forged or unsigned)",
                            fixed=repair)
                continue
            if data is None:
                if repair:
                    store.quarantine(h, "fsck: missing payload")
                rep.problem("blocks_missing", h, "catalogued but its payload is missing", fixed=repair)
                continue
            why = (f"unreadable payload key: {data}" if isinstance(data, Exception)
                   else check_block_bytes(bytes(data), row))
            if why is not None:
                if repair:
                    store.quarantine(h, f"fsck: {why}")
                rep.problem("blocks_damaged", h, why, fixed=repair)
                continue
            rep.add("blocks_ok")
            usable.add(h)

    # -- orphan payloads (older than the grace period: a writer SETs payloads before it commits)
    ppre = store.k_payload("")[:-2]  # "kvm:<s>:p:"
    for k in r.scan_iter(match=ppre + "{*}", count=1000):
        h = k.decode()[len(ppre) + 1 : -1]
        if h in rows:
            continue
        idle = r.object("idletime", k) or 0
        if idle < grace:
            rep.add("orphans_recent_kept")
            continue
        if repair:
            r.delete(k)
        rep.problem("orphan_payloads", h, "no catalogue row names this payload", fixed=repair)

    # -- entries and their indexes
    epre = store.k_entry("")
    ekeys = {k.decode()[len(epre):] for k in r.scan_iter(match=epre + "*", count=1000)}
    listed = set(_index(store, rep, repair, store.k_entries(),
                        lambda: [x.decode() for x in r.zrange(store.k_entries(), 0, -1)]))
    refs: dict[str, int] = {}
    marked = set(_index(store, rep, repair, store.k_damaged(), lambda: [k.decode() for k in r.hkeys(store.k_damaged())]))
    for eid in sorted(listed - ekeys):
        if repair:
            r.zrem(store.k_entries(), eid)
        rep.problem("index_drift", eid, "entries index names an entry that does not exist", fixed=repair)
    for eid in sorted(ekeys):
        rep.add("entries_checked")
        raw = store._hgetall_many([store.k_entry(eid)])[0]
        try:
            parsed = store.parse_entry(eid, raw)
            if store.namespace is not None and parsed[0].namespace != store.namespace:
                rep.add("entries_checked", -1)  # another tenant's entry (a scoped store): not ours to judge
                continue
            entry = store.check_entry(*parsed)
        except IntegrityError as exc:
            kind = "entries_forged" if type(exc).__name__ == "SignatureError" else "entry_rows_damaged"
            if repair:
                _set_aside_redis(store, eid, raw, f"fsck: {exc}")
            rep.problem(kind, eid, str(exc), fixed=repair)
            continue
        try:
            in_ns = r.zscore(store.k_ns(entry.namespace), eid) is not None
        except store._resp_err:  # the namespace index is not a sorted set: damaged
            if repair:
                r.delete(store.k_ns(entry.namespace))
            rep.problem("index_drift", entry.namespace, "namespace index key is damaged", fixed=repair)
            in_ns = False
        if eid not in listed or not in_ns:
            if repair:
                r.zadd(store.k_entries(), {eid: entry.created})
                r.zadd(store.k_ns(entry.namespace), {eid: entry.created})
            rep.problem("index_drift", eid, "entry missing from its indexes", fixed=repair)
        for h in entry.chain:
            refs[h] = refs.get(h, 0) + 1
        bad = [h for h in entry.chain if h not in usable]
        if bad:
            first = entry.chain.index(bad[0])
            why = (f"{len(bad)} of {len(entry.chain)} chain blocks missing, quarantined or damaged; grafts stop at "
                   f"block {first}")
            if eid in marked:
                rep.add("entries_broken_chain")  # known and marked by an earlier repair: not a new problem
            else:
                if repair:
                    r.hset(store.k_damaged(), eid, why)
                    rep.add("entries_marked")
                rep.problem("entries_broken_chain", eid, why, fixed=repair)
        else:
            rep.add("entries_ok")
            if repair and eid in marked:
                r.hdel(store.k_damaged(), eid)
                rep.add("entries_unmarked")
    # -- reference counts (they decide when delete_entries frees a block)
    for h, row in rows.items():
        raw_refs = r.hget(store.k_block(h), "refs")
        want = refs.get(h, 0)
        try:
            have = int(raw_refs) if raw_refs is not None else None
        except ValueError:
            have = -1
        if have is not None and have != want:
            if repair:
                r.hset(store.k_block(h), "refs", want)
                rep.add("refs_fixed")
    return rep


def _index(store, rep: FsckReport, repair: bool, key: str, read) -> list[str]:
    """Read an index key; a key of the wrong type is damage: reported, and with repair deleted (fsck then
    re-adds what it finds under the keys it scans)."""
    try:
        return read()
    except (IntegrityError, store._resp_err):  # WRONGTYPE, through the store or the raw client
        pass
    if repair:
        store.client.delete(key)
    rep.problem("index_drift", key, "index key is damaged (wrong type)", fixed=repair)
    return []


def _set_aside_redis(store, eid: str, raw: dict, reason: str) -> None:
    r = store.client
    ns = raw.get(b"namespace", b"").decode("utf-8", "replace") if b"\x00damaged" not in raw else ""
    if b"\x00damaged" not in raw:
        r.hset(store.k_entry(eid), mapping={"fsck_reason": reason, "fsck_at": time.time()})
    r.rename(store.k_entry(eid), store.k_qentry(eid))
    r.zrem(store.k_entries(), eid)
    if ns:
        r.zrem(store.k_ns(ns), eid)

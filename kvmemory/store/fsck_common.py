"""What every part of fsck shares: the report (`FsckReport`), the block-bytes check, the callbacks' types,
fsck's own tables in a local catalogue, and setting an entry row aside (store/fsck.py says what fsck
checks and repairs)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmemory.errors import IntegrityError
from kvmemory.store.blocks import encode_header, parse_header
from kvmemory.store.local import BlockRow, EntryRecord, LocalStore, check_meta

GRACE_SECONDS = 60.0


def progress_bar(total: int, enabled: bool, desc: str = "fsck: blocks"):
    """A bar on stderr over the blocks fsck reads and hashes (the long part on a big store); a
    no-op one when not `enabled`."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="block", disable=not enabled, file=sys.stderr)
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
           "router_drift", "refs_fixed", "catalogue_rebuilt", "redis_wiped", "entries_lost", "profile_files_damaged", "repaired", "unrepaired")


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


def master_signer(store):
    """The signer to check block signatures with: only an unscoped (master) one can judge every row."""
    s = getattr(store, "signer", None)
    return s if s is not None and s.scope is None else None


_FSCK_SCHEMA = """
CREATE TABLE IF NOT EXISTS fsck_damaged_entries(entry_id TEXT PRIMARY KEY, reason TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS quarantined_entries(id TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL,
                                               row_json TEXT NOT NULL);
"""

def fsck_tables(db) -> None:
    """fsck's own tables, created when a repair first needs them (not before: the disk may be full)."""
    for stmt in _FSCK_SCHEMA.strip().split(";"):
        if stmt.strip():
            db.execute(stmt)


def set_aside_local(store: LocalStore, eid, cols: str, reason: str, *, record_too: bool = False) -> None:
    """Move an entry row out of the catalogue into `quarantined_entries` (kept, never served); with
    `record_too`, its record into quarantine/records/ as well (so no repair puts it back)."""
    with store._tx() as db:
        fsck_tables(db)
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


def broken_chain(chain, usable) -> str | None:
    """Why an entry's chain cannot be grafted whole (blocks not in `usable`), or None."""
    bad = [h for h in chain if h not in usable]
    if not bad:
        return None
    return (f"{len(bad)} of {len(chain)} chain blocks missing, quarantined or damaged; grafts stop at "
            f"block {chain.index(bad[0])}")

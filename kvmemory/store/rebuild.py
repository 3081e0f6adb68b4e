"""Rebuilding a local store's catalogue from what the store holds besides it: the entry records
(records.py), the self-describing block files (blocks.py's .kvb headers), the profile files, and
whatever rows of the old catalogue can still be read.

    report = rebuild_catalogue(path, signer=None)     # `kvmemory fsck --repair` runs this when the
                                                      # catalogue is missing, empty or damaged

Steps (nothing is deleted; what cannot be used is moved into quarantine/):
1. The old catalogue (and its -wal / -shm files) is moved to quarantine/catalogue-<time>/.
2. Its readable rows are salvaged (read-only, forwards and backwards around a damaged page): entries,
   chains, profiles, block flags (pinned, verified), signatures.
3. Every entry record is checked (its own SHA-256, its content hash); a damaged one is moved into
   quarantine/records/. An entry comes from its record when the record checks, else from the old
   catalogue when its row was readable and its chain is the chain of its own token ids.
4. Every block file is checked on its own (canonical header, chain hash from its profile, parent and
   tokens, payload size and SHA-256). A block an entry's chain names, or the old catalogue listed, is
   catalogued again; a damaged file goes to quarantine/, an unnamed one to quarantine/orphans/.
5. The new catalogue is written into tmp/ and renamed into place (a reader sees the old state or the
   new one); entries salvaged without a record get one. In a signed store, entry signatures come back
   from the records (or the old catalogue); block signatures of an entry whose signature verifies are
   made again with the master key.

The rebuilt store is then checked by the rest of `fsck` as any other store.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmemory.errors import IntegrityError
from kvmemory.store.blocks import BlockMeta, chain_hash, encode_header, is_entry_chain, parse_header
from kvmemory.store.local import _SCHEMA, EntryRecord, LocalStore, entry_from_fields
from kvmemory.store.records import RecordFolder, parse_record
from kvmemory.store.safe_files import MAX_RECORD_BYTES, read_block_file, read_regular

_CATALOGUE_FILES = ("catalogue.sqlite", "catalogue.sqlite-wal", "catalogue.sqlite-shm")


def check_block_file(data: bytes, expect_hash: str | None = None) -> tuple[BlockMeta | None, str | None]:
    """A block file checked on its own, without a catalogue row: (meta, None) when it is whole, else
    (None, why). The same checks a read makes, against the header instead of a row."""
    try:
        meta, off = parse_header(data)
    except IntegrityError as exc:
        return None, str(exc)
    if data[:off] != encode_header(meta):
        return None, "block header is not in canonical form"
    if expect_hash is not None and meta.hash != expect_hash:
        return None, f"the file of block {expect_hash[:12]} holds block {meta.hash[:12]}"
    try:
        ok = chain_hash(meta.profile_id, meta.parent, meta.token_ids) == meta.hash
    except (ValueError, OverflowError):
        ok = False
    # the same position bound a read makes (local.check_meta): a tail block (fewer tokens than the grid)
    # sits at index * C, not index * n_tokens; the graft checks the exact position against the chain
    if not ok or meta.position < meta.index or (meta.index == 0) != (meta.position == 0):
        return None, "block header is not self-consistent (chain hash or position)"
    if len(data) - off != meta.payload_nbytes:
        return None, f"payload has {len(data) - off} bytes, its header says {meta.payload_nbytes}"
    if hashlib.sha256(memoryview(data)[off:]).hexdigest() != meta.payload_sha256:
        return None, "payload SHA-256 does not match its header"
    return meta, None


def chain_matches_ids(entry: EntryRecord, chunk: int | None) -> bool:
    """Whether an entry's chain is exactly the chain of its own token ids under its profile (`chunk`:
    the profile's grid; None when unknown, then only an empty chain is judged, by nothing)."""
    if chunk is None or chunk <= 0:
        return True
    try:
        return is_entry_chain(entry.chain, entry.profile_id, entry.token_ids, chunk)
    except (ValueError, OverflowError):  # a profile id that is not hex
        return False


def chunk_of(profile: dict | None, block_tokens: int | None = None) -> int | None:
    """The chunk grid of a profile (its `chunk` field), else a chain block's token count, else None."""
    c = profile.get("chunk") if isinstance(profile, dict) else None
    if isinstance(c, int) and not isinstance(c, bool) and c > 0:
        return c
    return block_tokens if block_tokens else None


def move_aside(path: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / path.name
    if dst.exists():
        dst = dst_dir / f"{path.name}.{int(time.time() * 1000)}"
    os.replace(path, dst)
    return dst


@dataclass
class Salvage:
    """What could still be read from an old catalogue."""

    entries: dict[str, EntryRecord] = field(default_factory=dict)
    profiles: dict[str, dict] = field(default_factory=dict)
    blocks: dict[str, tuple[int, int]] = field(default_factory=dict)  # hash -> (verified, pinned)
    signatures: list[tuple] = field(default_factory=list)  # (kind, key, namespace, sig, chain_sha256)
    errors: list[str] = field(default_factory=list)


def _read_around(db: sqlite3.Connection, sql: str, errors: list[str]) -> list[tuple]:
    """Rows of `sql` read forwards and then backwards by rowid, so rows on both sides of a damaged page
    are found; duplicates dropped."""
    out: dict[int, tuple] = {}
    for order in ("ASC", "DESC"):
        try:
            for row in db.execute(f"{sql} ORDER BY rowid {order}"):
                out.setdefault(row[0], row[1:])
        except sqlite3.Error as exc:
            errors.append(f"{sql.split('FROM')[1].split()[0]}: {exc}")
    return list(out.values())


def salvage(db_path: Path) -> Salvage:
    """Read what can be read of a (damaged) catalogue, read-only: it is never written."""
    out = Salvage()
    if not db_path.exists() or db_path.stat().st_size == 0:
        return out
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        out.errors.append(str(exc))
        return out
    try:
        chains: dict[str, dict[int, str]] = {}
        for eid, idx, h in _read_around(db, "SELECT rowid, entry_id, idx, hash FROM entry_blocks", out.errors):
            if isinstance(eid, str) and isinstance(idx, int) and isinstance(h, str):
                chains.setdefault(eid, {})[idx] = h
        cols = LocalStore._ENTRY_COLS
        for row in _read_around(db, f"SELECT rowid, {cols} FROM entries", out.errors):
            links = chains.get(row[0], {})
            chain = [links[i] for i in range(len(links))] if set(links) == set(range(len(links))) else []
            try:
                e = entry_from_fields(row, chain)
            except IntegrityError as exc:
                out.errors.append(str(exc))
                continue
            out.entries[e.id] = e
        for pid, body in _read_around(db, "SELECT rowid, profile_id, profile_json FROM profiles", out.errors):
            try:
                d = json.loads(body)
            except (TypeError, ValueError):
                continue
            if isinstance(pid, str) and isinstance(d, dict):
                out.profiles[pid] = d
        for h, ver, pin in _read_around(db, "SELECT rowid, hash, verified, pinned FROM blocks", out.errors):
            if isinstance(h, str):
                out.blocks[h] = (int(ver == 1), int(pin == 1))
        try:
            has_sigs = db.execute("SELECT 1 FROM sqlite_master WHERE name='signatures'").fetchone() is not None
        except sqlite3.Error:
            has_sigs = False
        if has_sigs:
            out.signatures = _read_around(
                db, "SELECT rowid, kind, key, namespace, sig, chain_sha256 FROM signatures", out.errors)
    finally:
        db.close()
    return out


def rebuild_catalogue(path: str | os.PathLike, *, signer=None) -> dict:
    """Rebuild the catalogue of the local store at `path` (see the module docstring). `signer`: the
    master key's Signer of a signed store (block signatures are made again with it). Returns counts and
    where the old catalogue went."""
    root = Path(path)
    now = time.time()
    rf = RecordFolder(root)
    counts = {"entries_restored": 0, "entries_from_records": 0, "entries_from_old_catalogue": 0,
              "records_damaged": 0, "records_written": 0, "blocks_adopted": 0, "blocks_damaged": 0,
              "orphans_quarantined": 0, "profiles": 0}
    problems: list[dict] = []

    # 1-2. the old catalogue, moved aside, then read for what it still holds
    aside_dir = root / "quarantine" / f"catalogue-{int(now * 1000)}"
    aside = None
    for name in _CATALOGUE_FILES:
        p = root / name
        if p.exists():
            moved = move_aside(p, aside_dir)
            if name == "catalogue.sqlite":
                aside = moved
    old = salvage(aside) if aside is not None else Salvage()
    profiles = {**old.profiles, **rf.read_profiles()}

    # 3a. every block file, checked on its own
    valid: dict[str, tuple[BlockMeta, int]] = {}
    where: dict[str, Path] = {}
    files = sorted((root / "blocks").glob("*/*.kvb")) if (root / "blocks").is_dir() else []
    for f in files:
        try:
            data = read_block_file(f)
        except IntegrityError as exc:  # not a regular file, or not the size its header says
            data, why = None, str(exc)
        except OSError as exc:
            problems.append({"kind": "blocks_damaged", "key": f.stem, "detail": f"unreadable: {exc}",
                             "repaired": False})
            continue
        meta, why = check_block_file(data, f.stem) if data is not None else (None, why)
        if meta is None:
            move_aside(f, root / "quarantine")
            counts["blocks_damaged"] += 1
            problems.append({"kind": "blocks_damaged", "key": f.stem, "detail": why, "repaired": True})
            continue
        valid[meta.hash] = (meta, len(data))
        where[meta.hash] = f

    # 3b. entries: records first, then readable old rows
    entries: dict[str, EntryRecord] = {}
    signatures: dict[str, dict] = {}
    for p in rf.files():
        try:
            rec = parse_record(read_regular(p, MAX_RECORD_BYTES))
        except (OSError, IntegrityError) as exc:
            rf.set_aside(p, f"rebuild: {exc}")
            counts["records_damaged"] += 1
            problems.append({"kind": "entry_records_damaged", "key": p.stem, "detail": str(exc), "repaired": True})
            continue
        if rf.path(rec.entry.id) != p:
            continue  # a record under another entry's name: only its own file counts
        entries[rec.entry.id] = rec.entry
        if rec.signature:
            signatures[rec.entry.id] = rec.signature
        counts["entries_from_records"] += 1
    salvaged_only = []
    for eid, e in old.entries.items():
        if eid in entries:
            continue
        first = valid.get(e.chain[0]) if e.chain else None
        chunk = chunk_of(profiles.get(e.profile_id), first[0].n_tokens if first else None)
        if not chain_matches_ids(e, chunk) or (chunk is None and e.chain):
            problems.append({"kind": "entry_rows_damaged", "key": eid, "repaired": False,
                             "detail": "an old catalogue row whose chain is not its token ids' chain (left in "
                                       f"{aside_dir.name})"})
            continue
        entries[eid] = e
        salvaged_only.append(eid)
        counts["entries_from_old_catalogue"] += 1
    for kind, key, ns, sig, cs in old.signatures:
        if kind == "entry" and key in entries and key not in signatures and entries[key].namespace == ns:
            signatures[key] = {"namespace": ns, "sig": sig, "chain_sha256": cs.split(",") if cs else []}

    # 4. blocks an entry names or the old catalogue listed are catalogued again; others are set aside
    named: dict[str, bool] = {}  # hash -> named by a verified entry
    for e in entries.values():
        for h in e.chain:
            named[h] = named.get(h, False) or e.verified
    metas: dict[str, tuple[BlockMeta, int]] = {}
    for h, (meta, size) in valid.items():
        if h in named or h in old.blocks:
            metas[h] = (meta, size)
        else:
            move_aside(where[h], root / "quarantine" / "orphans")
            counts["orphans_quarantined"] += 1
            problems.append({"kind": "orphan_payloads", "key": h, "repaired": True,
                             "detail": "a block no entry names and the old catalogue did not list (kept in "
                                       "quarantine/orphans)"})

    # 5. the new catalogue, built aside and renamed into place
    (root / "tmp").mkdir(exist_ok=True)
    tmp = root / "tmp" / f"catalogue.{os.getpid()}.{int(now * 1000)}.rebuild"
    db = sqlite3.connect(tmp, isolation_level=None)
    try:
        db.executescript(_SCHEMA)
        if signer is not None:
            from kvmemory.store.signing import _SIG_SCHEMA

            db.executescript(_SIG_SCHEMA)
        db.execute("BEGIN")
        for pid, prof in profiles.items():
            db.execute("INSERT OR IGNORE INTO profiles(profile_id, profile_json) VALUES(?,?)",
                       (pid, json.dumps(prof, sort_keys=True)))
        counts["profiles"] = len(profiles)
        for h, (meta, size) in metas.items():
            ver, pin = old.blocks.get(h, (0, 0))
            LocalStore._insert_block_rows(db, [meta], {h: size}, verified=bool(ver or named.get(h)), pinned=bool(pin))
            counts["blocks_adopted"] += 1
        for e in sorted(entries.values(), key=lambda x: (x.created, x.id)):
            LocalStore.insert_entry_rows(db, e)
            counts["entries_restored"] += 1
        if signer is not None:
            _resign(db, signer, entries, signatures, metas, old)
        db.execute("COMMIT")
        db.execute("PRAGMA journal_mode=DELETE")
    except BaseException:
        db.close()
        tmp.unlink(missing_ok=True)
        raise
    db.close()
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, root / "catalogue.sqlite")

    # entries that had no record get one now (they came from the old catalogue)
    for eid in salvaged_only:
        rf.write(entries[eid], signature=signatures.get(eid))
        counts["records_written"] += 1
    return {"counts": counts, "problems": problems, "old_catalogue": str(aside) if aside else None,
            "salvage_errors": old.errors[:20]}


def _resign(db, signer, entries: dict[str, EntryRecord], signatures: dict[str, dict],
            metas: dict[str, tuple[BlockMeta, int]], old: Salvage) -> None:
    """Signatures of a signed store: entries' from their records (or the old catalogue), blocks' from the
    old catalogue, and for an entry whose own signature verifies, its chain blocks signed again under
    its namespace (the entry's signature vouches for every [hash, payload SHA-256] of its chain)."""
    for eid, s in signatures.items():
        db.execute("INSERT OR REPLACE INTO signatures(kind, key, namespace, sig, chain_sha256) VALUES('entry',?,?,?,?)",
                   (eid, s.get("namespace"), s.get("sig"), ",".join(s.get("chain_sha256") or ())))
    for kind, key, ns, sig, cs in old.signatures:
        if kind == "block" and key in metas:
            db.execute("INSERT OR IGNORE INTO signatures(kind, key, namespace, sig, chain_sha256) VALUES(?,?,?,?,?)",
                       (kind, key, ns, sig, cs))
    if getattr(signer, "scope", None) is not None:
        return  # a tenant's key cannot vouch for blocks of other namespaces: only what was signed comes back
    for eid, e in entries.items():
        s = signatures.get(eid)
        if not s or s.get("namespace") != e.namespace:
            continue
        cs = list(s.get("chain_sha256") or ())
        try:
            signer.verify_entry(e, cs, s.get("sig"))
        except IntegrityError:
            continue
        for h, sha in zip(e.chain, cs):
            got = metas.get(h)
            if got is not None and got[0].payload_sha256 == sha:
                db.execute("INSERT OR IGNORE INTO signatures(kind, key, namespace, sig, chain_sha256) "
                           "VALUES('block',?,?,?,'')", (h, e.namespace, signer.sign_block(got[0], e.namespace)))


__all__ = ["rebuild_catalogue", "salvage", "check_block_file", "chain_matches_ids", "chunk_of", "move_aside"]

"""Entry records: a small self-describing JSON file per entry, beside the blocks, so that a lost or
damaged catalogue can be rebuilt (store/rebuild.py) and a catalogue row can be checked against a
second copy (store/fsck.py).

Layout (a local store folder):

    entries/<id>.json              the record of entry <id> (ids that are not file-name safe: h-<sha256>.json)
    entries/<id>.json.forgotten    a record whose entry is being forgotten (renamed before the catalogue
                                   commit, removed after it: a crash in between is told apart from a loss)
    profiles/<profile_id>.json     an execution profile as the catalogue holds it; its name is the SHA-256
                                   of its canonical JSON, so the file checks itself

A record is canonical JSON (sorted keys, no spaces, ASCII):

    {"format": "kvmemory-entry-record", "version": 1,
     "entry": EntryRecord.to_json() plus "token_ids" (the same object a bundle holds per entry),
     "content_sha256": SHA-256 of the canonical JSON of "entry" (what a catalogue row is compared by),
     "previous_sha256": the content hash of the version this one replaced, or null,
     "signature": {"namespace", "sig", "chain_sha256"} in signed stores, else null,
     "sha256": SHA-256 of the canonical JSON of every other field}

`sha256` makes a damaged record detectable on its own; `previous_sha256` tells a record written for an
update whose catalogue commit never happened (a crash between the two) from a catalogue row that was
damaged: the row then still hashes to the record's `previous_sha256`.

Writes are atomic: the record is written under tmp/, fsynced and renamed into place before the catalogue
transaction that commits the entry (as block files are; a crash may lose the rename, never leave a
partial record). No pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kvmemory.errors import IntegrityError
from kvmemory.store.blocks import ids_bytes
from kvmemory.store.entries import EntryRecord, entry_from_fields
from kvmemory.store.safe_files import MAX_RECORD_BYTES, loads_bounded, read_regular

RECORD_FORMAT = "kvmemory-entry-record"
RECORD_VERSION = 1
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,100}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
FORGOTTEN = ".forgotten"


def canonical(obj: object) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces, ASCII with escapes: any text, even a lone surrogate,
    encodes): what every hash here is taken over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def entry_json(entry: EntryRecord) -> dict:
    """An entry as a record (and a bundle) holds it: `EntryRecord.to_json()` plus its token ids."""
    return {**entry.to_json(), "token_ids": [int(t) for t in entry.token_ids]}


def content_sha256(entry: EntryRecord) -> str:
    """The SHA-256 of everything an entry is (texts, token ids, chain, attestation, metadata, times):
    equal for a catalogue row and its record exactly when every field is equal."""
    return hashlib.sha256(canonical(entry_json(entry))).hexdigest()


def entry_from_dict(d: dict) -> EntryRecord:
    """An EntryRecord from its JSON object (a record's "entry", a bundle's entry: `entry_json`), every field
    type-checked. What is wrong raises KeyError, TypeError, ValueError or OverflowError (the reason), or
    IntegrityError (from `entry_from_fields`); callers say where the object came from."""
    ids = d["token_ids"]
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 2**32 for t in ids):
        raise ValueError("token_ids are not integers in [0, 2**32)")
    if d.get("n_tokens") != len(ids):
        raise ValueError("n_tokens does not match token_ids")
    chain = d["chain"]
    if not isinstance(chain, list):
        raise ValueError("chain is not a list")
    if not isinstance(d["verified"], bool) or not all(
            isinstance(d[k], (int, float)) and not isinstance(d[k], bool) for k in ("created", "updated")):
        raise ValueError("verified / created / updated have the wrong type")
    row = (d["id"], d["namespace"], d["problem"], d["solution"], d["answer"], json.dumps(d["verifier"]),
           int(d["verified"]), ids_bytes(ids), d["profile_id"], json.dumps(d["attestation"]),
           json.dumps(d["meta"]), d["created"], d["updated"])
    return entry_from_fields(row, chain)


# What `entry_from_dict` raises for a malformed object (besides IntegrityError).
MALFORMED = (KeyError, TypeError, ValueError, OverflowError)


def entry_from_json(d: object) -> EntryRecord:
    """An EntryRecord from a record's "entry" object, every field type-checked (IntegrityError)."""
    if not isinstance(d, dict):
        raise IntegrityError("the record's entry is not a JSON object")
    try:
        return entry_from_dict(d)
    except MALFORMED as exc:
        raise IntegrityError(f"the record's entry is malformed ({exc})") from None


def make_record(entry: EntryRecord, *, previous_sha256: str | None = None, signature: dict | None = None) -> dict:
    """The record of `entry` (see the module docstring)."""
    rec = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "entry": entry_json(entry),
           "content_sha256": content_sha256(entry), "previous_sha256": previous_sha256, "signature": signature}
    rec["sha256"] = hashlib.sha256(canonical(rec)).hexdigest()
    return rec


def record_bytes(rec: dict) -> bytes:
    return canonical(rec)


@dataclass(slots=True, frozen=True)
class Record:
    """A record read back and checked: its entry, content hash, the hash of the version it replaced and
    (signed stores) the entry's signature."""

    entry: EntryRecord
    content_sha256: str
    previous_sha256: str | None
    signature: dict | None


def parse_record(data: bytes, expect_id: str | None = None) -> Record:
    """Check a record's bytes and return it; IntegrityError (saying what is wrong) for anything else."""
    rec = loads_bounded(data, "entry record")
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise IntegrityError("not a kvmemory entry record")
    if not isinstance(rec.get("version"), int) or rec["version"] > RECORD_VERSION:
        raise IntegrityError(f"entry record version {rec.get('version')!r} is newer than this kvmemory reads")
    body = {k: v for k, v in rec.items() if k != "sha256"}
    if rec.get("sha256") != hashlib.sha256(canonical(body)).hexdigest():
        raise IntegrityError("the entry record's SHA-256 does not match its contents (damaged)")
    entry = entry_from_json(rec.get("entry"))
    if content_sha256(entry) != rec.get("content_sha256"):
        raise IntegrityError("the entry record's content hash does not match its entry (damaged)")
    prev, sig = rec.get("previous_sha256"), rec.get("signature")
    if not (prev is None or (isinstance(prev, str) and _HEX64.fullmatch(prev))):
        raise IntegrityError("the entry record's previous_sha256 is malformed")
    if not (sig is None or isinstance(sig, dict)):
        raise IntegrityError("the entry record's signature is malformed")
    if expect_id is not None and entry.id != expect_id:
        raise IntegrityError(f"the record names entry {entry.id!r}, not {expect_id!r}")
    return Record(entry, rec["content_sha256"], prev, sig)


class RecordFolder:
    """The `entries/` and `profiles/` folders of a local store (see the module docstring).

    Writers create the folders on first use; readers never create anything."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.folder = self.root / "entries"
        self.profiles = self.root / "profiles"
        self.tmp = self.root / "tmp"

    def path(self, entry_id: str) -> Path:
        if _SAFE_ID.fullmatch(entry_id):
            return self.folder / f"{entry_id}.json"
        return self.folder / f"h-{hashlib.sha256(entry_id.encode()).hexdigest()}.json"

    def _write_atomic(self, final: Path, data: bytes, tag: str) -> None:
        final.parent.mkdir(exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        # <tag>.<pid>.<random>.part: fsck tells a dead writer's leftovers by the pid (store/fsck.py)
        tmp = self.tmp / f"{tag}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # No fsync of the folder after the rename, as for block files (local.py): a crash may lose the
        # rename, never leave a partial record; fsck writes a missing record again from its row.

    # ------------------------------------------------------------------ entries
    def read_bytes(self, entry_id: str) -> bytes | None:
        try:
            return read_regular(self.path(entry_id), MAX_RECORD_BYTES)
        except FileNotFoundError:
            return None

    def read(self, entry_id: str) -> Record | None:
        """The checked record of `entry_id`, None when there is none; IntegrityError when it is damaged."""
        data = self.read_bytes(entry_id)
        return None if data is None else parse_record(data, entry_id)

    def write(self, entry: EntryRecord, *, previous_sha256: str | None = None, signature: dict | None = None) -> bytes:
        """Write (replace) the record of `entry`, durably; returns the bytes written."""
        data = record_bytes(make_record(entry, previous_sha256=previous_sha256, signature=signature))
        self.write_bytes(entry.id, data)
        return data

    def write_bytes(self, entry_id: str, data: bytes) -> None:
        self._write_atomic(self.path(entry_id), data, self.path(entry_id).stem)

    def restore(self, entry_id: str, old: bytes | None) -> None:
        """Put back what `read_bytes` returned before a write whose commit failed (None: remove it)."""
        if old is None:
            self.path(entry_id).unlink(missing_ok=True)
        else:
            self.write_bytes(entry_id, old)

    def begin_forget(self, entry_id: str) -> bool:
        """Mark a record as being forgotten (before the catalogue commit); True when there was one."""
        p = self.path(entry_id)
        try:
            os.replace(p, p.with_name(p.name + FORGOTTEN))
            return True
        except FileNotFoundError:
            return False

    def end_forget(self, entry_id: str) -> None:
        """After the catalogue commit: the forgotten record goes."""
        p = self.path(entry_id)
        p.with_name(p.name + FORGOTTEN).unlink(missing_ok=True)

    def undo_forget(self, entry_id: str) -> None:
        """The catalogue commit failed: the record is live again."""
        p = self.path(entry_id)
        try:
            os.replace(p.with_name(p.name + FORGOTTEN), p)
        except FileNotFoundError:
            pass

    def files(self) -> list[Path]:
        """Every live record file (not tombstones), sorted."""
        if not self.folder.is_dir():
            return []
        # a symbolic link (or another non-regular file) is listed too: the bounded read refuses it as damage
        return sorted(p for p in self.folder.iterdir() if p.suffix == ".json" and (p.is_symlink() or not p.is_dir()))

    def tombstones(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.name.endswith(".json" + FORGOTTEN))

    def set_aside(self, path: Path, why: str) -> Path:
        """Move a damaged record into quarantine/records/ (kept, never read again); returns where."""
        dst_dir = self.root / "quarantine" / "records"
        dst_dir.mkdir(parents=True, exist_ok=True)
        dst = dst_dir / f"{path.name}.{int(time.time() * 1000)}"
        os.replace(path, dst)
        (dst_dir / f"{dst.name}.why").write_text(why + "\n")
        return dst

    # ------------------------------------------------------------------ profiles
    def write_profile(self, profile_id: str, profile: dict) -> None:
        """Keep a profile beside the blocks (once: its name is its hash)."""
        if not _HEX64.fullmatch(profile_id):
            return
        final = self.profiles / f"{profile_id}.json"
        if final.exists():
            return
        self._write_atomic(final, canonical(profile), f"profile-{profile_id[:16]}")

    def read_profiles(self) -> dict[str, dict]:
        """Every profile file whose contents hash to its name (the profile id), by id."""
        out: dict[str, dict] = {}
        if not self.profiles.is_dir():
            return out
        for p in sorted(self.profiles.glob("*.json")):
            try:
                d = loads_bounded(read_regular(p, MAX_RECORD_BYTES), "profile file")
            except (OSError, IntegrityError):
                continue
            # the profile id is the SHA-256 of the profile's canonical JSON (engine/profile.py)
            body = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
            if isinstance(d, dict) and hashlib.sha256(body.encode()).hexdigest() == p.stem:
                out[p.stem] = d
        return out


def holds_data(root: Path) -> bool:
    """Whether a store folder holds entry records or block files (what a missing catalogue would lose)."""
    entries = root / "entries"
    if entries.is_dir() and any(p.suffix == ".json" for p in entries.iterdir()):
        return True
    return holds_blocks(root)


def holds_blocks(root: Path) -> bool:
    """Whether a store folder holds block files."""
    blocks = root / "blocks"
    if blocks.is_dir():
        for sub in blocks.iterdir():
            if sub.is_dir() and any(True for _ in sub.glob("*.kvb")):
                return True
    return False


__all__ = ["RecordFolder", "Record", "make_record", "parse_record", "content_sha256", "entry_json", "canonical",
           "holds_data", "holds_blocks", "RECORD_FORMAT"]

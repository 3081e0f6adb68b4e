"""The local store: content-addressed block files plus a SQLite catalogue of blocks and entries.

Layout of a store folder:

    FORMAT                 JSON {"format": N, ...}: a store from a newer format is refused
    catalogue.sqlite       blocks, entries, entry->block chains, profiles, quarantine (WAL mode)
    blocks/ab/<hash>.kvb   one file per block (see blocks.py), named by its chain hash
    entries/<id>.json      one record per entry (records.py): the catalogue can be rebuilt from these
    profiles/<id>.json     the execution profiles, beside the blocks made under them (records.py)
    quarantine/            damaged block files, records and catalogues moved aside, never read again
    tmp/                   files being written; renamed into place only when complete

Guarantees:
- Atomic: a block file appears under its name only once fully written and fsynced (write to tmp/,
  fsync, rename); an entry appears only when its catalogue transaction commits, after its blocks and
  its record are in place. A process killed mid-write leaves at most an orphan file (or a record
  `kvmemory fsck --repair` commits), never a visible partial entry.
- Rebuildable: every entry is also recorded beside its blocks (entries/, written and fsynced before
  the commit), and blocks describe themselves (.kvb headers), so `kvmemory fsck --repair` rebuilds a
  missing or damaged catalogue (store/rebuild.py). A store whose catalogue is missing while records or
  blocks are there is refused (`CatalogueLost`), never served as an empty store.
- Verified reads: every payload read is hashed (SHA-256) and compared with the catalogue before any
  byte can reach the model; a mismatch quarantines the block and raises `IntegrityError`.
- Several processes may read and write at once (SQLite WAL + busy timeout; content addressing makes
  concurrent writes of the same block write the same bytes).
- No pickle: the catalogue holds text, integers, JSON and raw token-id bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmemory.store import drops
from kvmemory.store.blocks import BlockMeta, chain_hash, encode_header, read_header
from kvmemory.store.feed import LOCAL_FEED_ID, LOCAL_FEED_SCHEMA, Change, FeedHead, local_changes, local_head
from kvmemory.store.entries import EntryRecord, _is_hex64, entry_from_fields  # noqa: F401 (EntryRecord: re-exported)
from kvmemory.store.records import RecordFolder, content_sha256, holds_blocks, holds_data
from kvmemory.errors import (CatalogueLost, IntegrityError, InvalidInput, StoreError, StoreFormatError, StoreFull, StoreReadOnly,
                             UnknownEntry)

STORE_FORMAT = 1
_log = logging.getLogger("kvmemory.store.local")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS profiles(profile_id TEXT PRIMARY KEY, profile_json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks(
    hash TEXT PRIMARY KEY,
    parent TEXT,
    profile_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    payload_sha256 TEXT NOT NULL,
    payload_nbytes INTEGER NOT NULL,
    file_nbytes INTEGER NOT NULL,
    verified INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0,
    quarantined INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    last_used REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS entries(
    id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    problem TEXT NOT NULL,
    solution TEXT NOT NULL,
    answer TEXT,
    verifier_json TEXT NOT NULL,
    verified INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    n_tokens INTEGER NOT NULL,
    profile_id TEXT NOT NULL,
    attestation_json TEXT NOT NULL,
    meta_json TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS entry_blocks(
    entry_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    hash TEXT NOT NULL,
    PRIMARY KEY(entry_id, idx)
);
CREATE INDEX IF NOT EXISTS entry_blocks_hash ON entry_blocks(hash);
CREATE INDEX IF NOT EXISTS entries_ns ON entries(namespace);
CREATE TABLE IF NOT EXISTS quarantine(hash TEXT NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL, path TEXT);
""" + LOCAL_FEED_SCHEMA  # the change feed (store/feed.py): written by triggers, in the entries' own transactions


@dataclass(slots=True, frozen=True)
class BlockRow:
    hash: str
    parent: str | None
    profile_id: str
    index: int
    n_tokens: int
    payload_sha256: str
    payload_nbytes: int
    file_nbytes: int
    verified: bool
    pinned: bool
    quarantined: bool


@dataclass(slots=True, frozen=True)
class StoreStats:
    entries: int
    verified_entries: int
    blocks: int
    quarantined_blocks: int
    bytes: int
    tokens_stored: int
    tokens_referenced: int

    @property
    def dedup_ratio(self) -> float:
        """Tokens the entries reference per token actually stored (>= 1 when prefixes are shared)."""
        return self.tokens_referenced / self.tokens_stored if self.tokens_stored else 1.0

    def to_json(self) -> dict:
        return {
            "entries": self.entries,
            "verified_entries": self.verified_entries,
            "blocks": self.blocks,
            "quarantined_blocks": self.quarantined_blocks,
            "bytes": self.bytes,
            "tokens_stored": self.tokens_stored,
            "tokens_referenced": self.tokens_referenced,
            "dedup_ratio": round(self.dedup_ratio, 4),
        }


def _load_syncfs():
    """libc's syncfs (Linux): flushes one filesystem; chosen once, with per-file fsync as the fallback."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).syncfs
        fn.argtypes = [ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


_SYNCFS = _load_syncfs()


def _sync_files(files: Sequence[Path], folder: Path) -> None:
    """Make `files` durable: one syncfs for a batch, else an fsync each."""
    if _SYNCFS is not None and len(files) > 1:
        fd = os.open(folder, os.O_RDONLY)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_meta(meta: BlockMeta, row: BlockRow) -> None:
    """Raise IntegrityError unless a block header agrees with its catalogue row and with itself: every
    field the row repeats, and the chain hash recomputed from the header's profile, parent and tokens
    (so a damaged token id, parent or profile in a header is caught here, not later in the graft)."""
    if (meta.hash != row.hash or meta.payload_sha256 != row.payload_sha256 or meta.payload_nbytes != row.payload_nbytes
            or meta.parent != row.parent or meta.profile_id != row.profile_id or meta.index != row.index
            or meta.n_tokens != row.n_tokens):
        raise IntegrityError("block header does not match the catalogue")
    try:
        ok = chain_hash(meta.profile_id, meta.parent, meta.token_ids) == meta.hash
    except (ValueError, OverflowError):  # non-hex profile / parent, token ids outside uint32
        ok = False
    # A chain's chunks are C long except where a cut ends or starts one (runner.chunk_spans), so a header
    # alone bounds its position (the first chunk at 0, each chunk at least one token); the graft checks
    # the exact position against the chain before a byte is placed (graft.load_chain, pipeline).
    if not ok or meta.position < meta.index or (meta.index == 0) != (meta.position == 0):
        raise IntegrityError("block header is not self-consistent (chain hash or position)")


def block_row_from(row: Sequence) -> BlockRow:
    """A BlockRow from catalogue values (hash, parent, profile, idx, n_tokens, sha, nbytes, file nbytes,
    verified, pinned, quarantined), type-checked: a damaged row raises IntegrityError, never reaches a read."""
    h, parent, profile, idx, n_tok, sha, nbytes, fbytes, ver, pin, quar = row
    ints = (idx, n_tok, nbytes, fbytes, ver, pin, quar)
    if not (_is_hex64(h) and (parent is None or _is_hex64(parent)) and _is_hex64(sha) and isinstance(profile, str)
            and all(type(v) is int for v in ints) and min(ints) >= 0):  # `type is`: no bool, no int subclass
        name = h[:12] if isinstance(h, str) else repr(h)[:20]
        raise IntegrityError(f"the catalogue row of block {name} is damaged; run `kvmemory fsck`")
    return BlockRow(h, parent, profile, idx, n_tok, sha, nbytes, fbytes, bool(ver), bool(pin), bool(quar))


_IOV_MAX = 1024  # Linux's limit on buffers per preadv call


def _preadv_all(fd: int, parts: list, offset: int) -> int:
    """Read from `offset` across `parts` in order until they are full or the file ends; bytes read."""
    total = 0
    parts = [p.cast("B") if p.ndim != 1 or p.format != "B" else p for p in parts]
    i = 0
    while i < len(parts):
        batch = parts[i : i + _IOV_MAX]
        n = os.preadv(fd, batch, offset + total)
        if n == 0:
            return total
        total += n
        # Skip the buffers filled; a short read leaves the rest of one buffer for the next call.
        while n and i < len(parts):
            if n >= parts[i].nbytes:
                n -= parts[i].nbytes
                i += 1
            else:
                parts[i] = parts[i][n:]
                n = 0
    return total


class LocalStore:
    """A store folder on the local disk (the default store)."""

    kind = "local"

    def __init__(self, path: str | os.PathLike, *, readonly: bool = False, create: bool = True, records: bool = True):
        """`records=False`: a cache (Redis's local tier): no entry records are kept, and a lost catalogue
        is simply started again."""
        self.keeps_records = records
        try:
            self._open(path, readonly, create)
        except (OSError, ValueError) as exc:  # a path that is a file, holds a NUL, is unreadable, ...
            raise StoreError(f"cannot open a store at {str(path)!r}: {exc}") from exc

    def _open(self, path, readonly: bool, create: bool) -> None:
        self.path = Path(path).expanduser()
        self.readonly = readonly
        if self.path.exists() and not self.path.is_dir():
            raise StoreError(f"{self.path} is a file, not a store folder")
        if not self.path.exists():
            if readonly or not create:
                raise StoreError(f"no store at {self.path}: nothing was created (a command that only reads needs "
                                 "an existing store; `kvmemory remember` creates one)")
            try:
                self.path.mkdir(parents=True)
            except OSError as exc:
                raise StoreError(f"cannot create the store folder {self.path}: {exc}") from exc
        # A read-only folder is served read-only rather than refused. os.access says "writable" to root
        # whatever the mode: a folder whose owner made it read-only (chmod a-w) is read-only for root too.
        if not readonly and (not os.access(self.path, os.W_OK) or not self.path.stat().st_mode & 0o222):
            self.readonly = True
        self._check_format()
        self._check_catalogue_present()
        self._local = threading.local()
        self._init_lock = threading.Lock()
        # Headers already checked in full (parsed, canonical, matching the catalogue, chain hash
        # recomputed): hash -> (meta, the header's exact bytes). A later read compares the file's
        # header bytes to these and skips the parse; any changed byte takes the full check again.
        self._checked_headers: dict[str, tuple[BlockMeta, bytes]] = {}
        if not self.readonly:
            for sub in ("blocks", "quarantine", "tmp"):
                (self.path / sub).mkdir(exist_ok=True)
            try:
                self._db().executescript(_SCHEMA)  # idempotent; executescript manages its own transaction
            except sqlite3.Error as exc:
                raise self._wrap(exc) from exc
            try:
                self._db().execute(LOCAL_FEED_ID)  # store/feed.py
            except sqlite3.DatabaseError:
                pass  # a damaged catalogue still opens: `kvmemory fsck` reports it, and readers resync
        elif not (self.path / "catalogue.sqlite").exists():
            raise StoreError(f"{self.path} is read-only and holds no catalogue")

    # ----------------------------------------------------------------- format and connection
    @property
    def records(self):
        """The store's entry records and profile files (records.py); None for a cache."""
        if not self.keeps_records:
            return None
        rf = self.__dict__.get("_records")
        if rf is None:
            rf = self._records = RecordFolder(self.path)
        return rf

    def _check_catalogue_present(self) -> None:
        """Refuse a store whose catalogue is missing or empty while its records or blocks are there: it
        is not an empty store, and creating a new catalogue would hide every entry it holds."""
        if not self.keeps_records:
            return
        cat = self.path / "catalogue.sqlite"
        try:
            empty = cat.stat().st_size == 0
        except FileNotFoundError:
            empty = True
        if not empty:
            return
        if holds_data(self.path):
            state = "is empty" if cat.exists() else "is missing"
            ents = self.path / "entries"
            has_records = ents.is_dir() and any(p.suffix == ".json" for p in ents.iterdir())
            there = ("its entry records and blocks are there" if has_records and holds_blocks(self.path) else
                     "its entry records are there" if has_records else
                     "block files are there (no entry records: only the blocks can be kept, their entries are gone)")
            raise CatalogueLost(
                f"the catalogue of the store at {self.path} {state}, but {there}: nothing is served from it. Run "
                "`kvmemory fsck --repair` to rebuild the catalogue from what is there")

    def _check_format(self) -> None:
        f = self.path / "FORMAT"
        if f.exists():
            try:
                info = json.loads(f.read_text())
                fmt = int(info["format"])
            except (ValueError, KeyError, TypeError) as exc:
                raise StoreFormatError(f"{f} is unreadable ({exc}); this folder is not a kvmemory store") from exc
            if fmt > STORE_FORMAT:
                raise StoreFormatError(
                    f"the store at {self.path} was written by a newer kvmemory (store format {fmt}; this "
                    f"version reads up to {STORE_FORMAT}). Upgrade kvmemory to use it."
                )
            return
        if any(p.name != "FORMAT" for p in self.path.iterdir()):
            if (self.path / "catalogue.sqlite").exists():
                raise StoreFormatError(f"{self.path} has a catalogue but no FORMAT file; run `kvmemory fsck`")
            raise StoreFormatError(f"{self.path} is not empty and not a kvmemory store; choose another folder")
        if self.readonly:
            raise StoreError(f"no store at {self.path}")
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": STORE_FORMAT, "created": time.time()}))
        os.replace(tmp, f)

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            uri = self._readonly_uri() if self.readonly else f"file:{self.path / 'catalogue.sqlite'}"
            try:
                db = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA busy_timeout=60000")
                if not self.readonly:
                    db.execute("PRAGMA journal_mode=WAL")
                    db.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise self._wrap(exc) from exc
            self._local.db = db
        return db

    def _readonly_uri(self) -> str:
        """How a read-only store opens its catalogue. SQLite opens a WAL database read-only only with
        its `-shm` file beside it, which it creates on open: in a folder nobody may write (chmod a-w,
        a read-only mount, a snapshot) that fails ("unable to open database file"). A cleanly closed
        store has checkpointed its WAL and removed both files, so the database file alone is the
        whole catalogue: it is opened immutable (no locks, no -shm). WAL content that cannot be read
        without writing is refused, never skipped (it would silently hide committed entries)."""
        db = self.path / "catalogue.sqlite"
        shm, wal = Path(f"{db}-shm"), Path(f"{db}-wal")
        if os.access(self.path, os.W_OK) or shm.exists():
            return f"file:{db}?mode=ro"
        if wal.exists() and wal.stat().st_size > 0:
            raise StoreReadOnly(
                f"the store at {self.path} is read-only and its catalogue has writes not yet checkpointed "
                f"({wal.name}); SQLite cannot read them without writing beside it. Open the store once where "
                "it is writable (e.g. `kvmemory stats`), or copy the folder somewhere writable")
        return f"file:{db}?immutable=1"

    def _q(self, sql: str, args: tuple = ()) -> list[tuple]:
        """A read query; a damaged or unreadable catalogue surfaces as a typed StoreError."""
        try:
            return self._db().execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise self._wrap(exc) from exc

    @contextmanager
    def _tx(self):
        """A write transaction (BEGIN IMMEDIATE: one writer at a time across processes)."""
        self._require_writable()
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self._wrap(exc) from exc
        try:
            yield db
            db.execute("COMMIT")
        except BaseException as exc:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise self._wrap(exc) from exc
            raise

    def _wrap(self, exc: Exception) -> StoreError:
        msg = str(exc)
        if "full" in msg or getattr(exc, "errno", None) == errno.ENOSPC:
            return StoreFull(f"the disk holding {self.path} is full; nothing was written ({msg})")
        if "readonly" in msg or "read-only" in msg:
            return StoreReadOnly(f"the store at {self.path} is read-only ({msg})")
        if "malformed" in msg or "not a database" in msg or "corrupt" in msg:
            return CatalogueLost(f"the catalogue at {self.path} is damaged ({msg}); run `kvmemory fsck --repair` "
                                 "to rebuild it from the entry records and blocks")
        return StoreError(f"store catalogue error at {self.path}: {msg}")

    def _require_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnly(f"the store at {self.path} is read-only; open a writable store to remember")

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # ----------------------------------------------------------------- profiles
    def put_profile(self, profile_id: str, profile: dict) -> None:
        self._require_writable()
        if self.records is not None:
            try:
                self.records.write_profile(profile_id, profile)
            except OSError as exc:
                raise self._wrap_os(exc, "writing the profile file") from exc
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO profiles(profile_id, profile_json) VALUES(?, ?)",
                (profile_id, json.dumps(profile, sort_keys=True)),
            )

    def get_profile(self, profile_id: str) -> dict | None:
        rows = self._q("SELECT profile_json FROM profiles WHERE profile_id=?", (profile_id,))
        if not rows:
            return None
        try:
            d = json.loads(rows[0][0])
        except (TypeError, ValueError) as exc:
            raise IntegrityError(f"the catalogue row of profile {profile_id[:12]} is damaged ({exc})") from exc
        if not isinstance(d, dict):
            raise IntegrityError(f"the catalogue row of profile {profile_id[:12]} is damaged (not an object)")
        return d

    # ----------------------------------------------------------------- blocks
    def block_path(self, h: str) -> Path:
        return self.path / "blocks" / h[:2] / f"{h}.kvb"

    _BLOCK_COLS = ("hash, parent, profile_id, idx, n_tokens, payload_sha256, payload_nbytes, file_nbytes, "
                   "verified, pinned, quarantined")

    def _raw_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]:
        """Catalogue rows of `hashes` that exist, by hash, in few queries (a chain of 128 blocks in one,
        where one query per block took 7 ms). A damaged row counts as no row (the graft stops before
        it and recomputes; `kvmemory fsck` reports and removes it)."""
        out: dict[str, BlockRow] = {}
        hashes = list(dict.fromkeys(hashes))
        for i in range(0, len(hashes), 500):  # under SQLite's bound on parameters per statement
            part = hashes[i : i + 500]
            for raw in self._q(f"SELECT {self._BLOCK_COLS} FROM blocks WHERE hash IN ({','.join('?' * len(part))})",
                               tuple(part)):
                try:
                    row = block_row_from(raw)
                except IntegrityError as exc:
                    _log.warning("%s", exc)
                    continue
                out[row.hash] = row
        return out

    def block_visible(self, row: BlockRow) -> bool:
        """Whether this reader may use the block (every row here; a signed store checks signatures)."""
        return True

    def get_block(self, h: str) -> BlockRow | None:
        """The catalogue row of block `h`, or None (missing, damaged, or not visible to this reader)."""
        row = self._raw_blocks([h]).get(h)
        return row if row is not None and self.block_visible(row) else None

    def known_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]:
        """Rows of the given hashes that exist, are visible to this reader and are not quarantined."""
        return {h: r for h, r in self._raw_blocks(hashes).items() if not r.quarantined and self.block_visible(r)}

    def write_block_file(self, meta: BlockMeta, payload: torch.Tensor) -> int:
        """Write one block file atomically (no catalogue change). Returns the file size."""
        return self.write_block_files([(meta, payload)])[meta.hash]

    def write_block_files(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> dict[str, int]:
        """Write block files atomically (no catalogue change); returns {hash: file size}.

        Each file is written under tmp/, all of them are made durable with one `syncfs` (one flush
        for the batch instead of one fsync per file), and only then renamed into place: a file is
        visible under its name only when complete. Existing files (content-addressed) are kept.
        """
        self._require_writable()
        sizes: dict[str, int] = {}
        pending: list[tuple[Path, Path]] = []
        try:
            for meta, payload in blocks:
                final = self.block_path(meta.hash)
                header = encode_header(meta)
                size = len(header) + meta.payload_nbytes
                sizes[meta.hash] = size
                if final.exists() and final.stat().st_size == size:
                    continue
                tmp = self.path / "tmp" / f"{meta.hash}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
                pending.append((tmp, final))
                with open(tmp, "wb") as fh:
                    fh.write(header)
                    fh.write(memoryview(payload.contiguous().numpy()))
            if pending:
                _sync_files([t for t, _ in pending], self.path / "tmp")
                for tmp, final in pending:
                    final.parent.mkdir(exist_ok=True)
                    os.replace(tmp, final)
        except OSError as exc:
            for tmp, _ in pending:
                tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFull(f"no room on the disk holding {self.path}; nothing was stored ({exc})") from exc
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise StoreReadOnly(f"cannot write into {self.path} ({exc})") from exc
            raise StoreError(f"writing blocks into {self.path} failed: {exc}") from exc
        return sizes

    @staticmethod
    def _insert_block_rows(db: sqlite3.Connection, metas: Iterable[BlockMeta], sizes: dict[str, int],
                           verified: bool, pinned: bool) -> None:
        now = time.time()
        for m in metas:
            db.execute(
                "INSERT INTO blocks(hash, parent, profile_id, idx, n_tokens, payload_sha256, payload_nbytes, "
                "file_nbytes, verified, pinned, quarantined, created, last_used) "
                "VALUES(?,?,?,?,?,?,?,?,?,?,0,?,?) "
                "ON CONFLICT(hash) DO UPDATE SET quarantined=0, payload_sha256=excluded.payload_sha256, "
                "verified=MAX(verified, excluded.verified), pinned=MAX(pinned, excluded.pinned), "
                "last_used=excluded.last_used",
                (m.hash, m.parent, m.profile_id, m.index, m.n_tokens, m.payload_sha256, m.payload_nbytes,
                 sizes[m.hash], int(verified), int(pinned), now, now),
            )

    def put_blocks(self, blocks: Sequence[tuple[BlockMeta, torch.Tensor]], *, verified: bool = False,
                   pinned: bool = False) -> int:
        """Store loose blocks (not part of an entry), e.g. newly computed context blocks. Returns bytes written."""
        sizes = self.write_block_files(blocks)
        with self._tx() as db:
            self._insert_block_rows(db, [m for m, _ in blocks], sizes, verified, pinned)
        return sum(sizes.values())

    def read_block(self, row: BlockRow, into=None) -> tuple[BlockMeta, object]:
        """Read a block's payload and verify it against the catalogue before returning it.

        `into` (a writable buffer of `row.payload_nbytes` bytes, e.g. a slice of a staging tensor)
        receives the payload straight from the file: one copy, the one that cannot be avoided. The
        payload is hashed where it lies, with one call, so the verified bytes are the bytes that are
        used. Raises IntegrityError (after quarantining the block) on any mismatch.
        """
        if into is None:
            into = memoryview(bytearray(row.payload_nbytes))
        if into.nbytes != row.payload_nbytes:
            raise ValueError("the destination buffer has the wrong size")
        fh, meta, head = self._open_checked(row)
        with fh:
            # One read fills the payload and asks for one byte more: a file with trailing bytes
            # (or a truncated one) shows in the count.
            got = _preadv_all(fh.fileno(), [into, memoryview(bytearray(1))], len(head))
        self._check_size(row, got)
        self._check_digest(row, hashlib.sha256(into).hexdigest())
        return meta, into

    def block_meta(self, row: BlockRow) -> BlockMeta:
        """A block's header, checked against the catalogue as `read_block` checks it (the payload is
        not read: `read_block` checks it when it reads it)."""
        fh, meta, _ = self._open_checked(row)
        fh.close()
        return meta

    def read_blocks_lanes(self, rows: Sequence[BlockRow], place, _retry: bool = True) -> list:
        """Read and verify up to 16 blocks of one payload size together, into their places.

        `place(meta)` returns where block `meta`'s payload goes: the addresses of its segments (a
        uint64 array, in payload order) and their size in bytes, or raises IntegrityError (a block
        laid out unlike the rest). Each block's header is checked as `read_block` checks it (a header
        checked before is compared byte for byte, by the reader); then `sha256_lanes.read_hash_lanes`
        opens every block's file, reads and hashes its payload and stores the bytes hashed into its
        segments, 16 messages at once, without the GIL. Returns per row its BlockMeta or the
        IntegrityError it failed with (after quarantining it), in order.
        """
        from kvmemory.kernels import sha256_lanes

        out: list = [None] * len(rows)
        lanes, paths, heads, segments, seg_bytes = [], [], [], [], None
        for i, row in enumerate(rows):
            try:
                meta, head = self._checked_meta(row)
                segs, size = place(meta)
                if seg_bytes not in (None, size) or len(segs) * size != row.payload_nbytes:
                    raise ValueError("blocks read together must have segments of one size covering the payload")
            except IntegrityError as exc:
                out[i] = exc
                continue
            seg_bytes = size
            out[i] = meta
            lanes.append(i)
            paths.append(self.block_path(row.hash))
            heads.append(head)
            segments.append(segs)
        if not lanes:
            return out
        got, digests = sha256_lanes.read_hash_lanes(paths, [len(h) for h in heads], np.stack(segments), seg_bytes,
                                                    heads)
        again = []
        for i, n, digest in zip(lanes, got, digests):
            row = rows[i]
            try:
                if n == sha256_lanes.MISSING:
                    raise self._missing(row)
                if n == sha256_lanes.HEAD_CHANGED:
                    self._checked_headers.pop(row.hash, None)
                    if _retry:  # the file changed since its header was checked: check it afresh
                        again.append(i)
                        continue
                    raise self._quarantined(row, "block header changed while the block was read")
                if n < 0:
                    raise OSError(f"reading block {row.hash[:12]} failed")  # as read_block lets an I/O error through
                self._check_size(row, n)
                self._check_digest(row, digest.hex())
            except IntegrityError as exc:
                out[i] = exc
        if again:
            for i, res in zip(again, self.read_blocks_lanes([rows[i] for i in again], place, _retry=False)):
                out[i] = res
        return out

    def _checked_meta(self, row: BlockRow) -> tuple[BlockMeta, bytes]:
        """A block's header checked against the catalogue, and its bytes: a header checked before
        is trusted to be the file's (the caller compares the file's bytes with it); else the file's
        header is read and checked in full. Damage is quarantined and raises IntegrityError."""
        meta, head = self._checked_headers.get(row.hash, (None, b""))
        if meta is None:
            fh, meta, head = self._open_checked(row)
            fh.close()
            return meta, head
        try:
            check_meta(meta, row)  # the same header bytes: only the row may differ
        except IntegrityError as exc:
            raise self._quarantined(row, str(exc)) from None
        return meta, head

    def _missing(self, row: BlockRow) -> IntegrityError:
        """Quarantine a block whose file is gone; the error to raise."""
        self.quarantine(row.hash, "missing block file")
        return IntegrityError(f"block {row.hash[:12]} is in the catalogue but its file is missing")

    def _quarantined(self, row: BlockRow, why: str) -> IntegrityError:
        """Quarantine a damaged block; the error to raise."""
        self.quarantine(row.hash, why)
        return IntegrityError(f"block {row.hash[:12]}: {why}")

    def _open_checked(self, row: BlockRow):
        """The block file, open, with its header checked against the catalogue: (file, meta, header
        bytes). A missing or damaged file is quarantined and raises IntegrityError."""
        try:
            fh = open(self.block_path(row.hash), "rb", buffering=0)
        except FileNotFoundError:
            raise self._missing(row) from None
        try:
            meta, head = self._checked_headers.get(row.hash, (None, b""))
            if meta is not None and os.pread(fh.fileno(), len(head), 0) == head:
                check_meta(meta, row)  # the same header bytes: only the row may differ
            else:
                meta, head = self._check_header(fh, row)
        except IntegrityError as exc:
            fh.close()
            raise self._quarantined(row, str(exc)) from None
        except BaseException:
            fh.close()
            raise
        return fh, meta, head

    def _check_size(self, row: BlockRow, got: int) -> None:
        """`got`: payload bytes read, asking for one byte more than the payload. A wrong size
        quarantines the block and raises IntegrityError."""
        if got < row.payload_nbytes:
            raise self._quarantined(row, f"block file truncated ({got} of {row.payload_nbytes} payload bytes)")
        if got > row.payload_nbytes:
            raise self._quarantined(row, "block file has trailing bytes")

    def _check_digest(self, row: BlockRow, hexdigest: str) -> None:
        if hexdigest != row.payload_sha256:
            raise self._quarantined(row, "payload SHA-256 does not match the catalogue")

    def _check_header(self, fh, row: BlockRow) -> tuple[BlockMeta, bytes]:
        """Parse a block file's header and check it in full; remember it as checked."""
        meta, off = read_header(fh)
        fh.seek(0)
        head = fh.read(off)
        # The header must be byte-for-byte the canonical encoding of what it says: a flipped bit
        # in the prefix, the JSON or the padding is caught here, not only one that breaks parsing.
        if head != encode_header(meta):
            raise IntegrityError("block header is not in canonical form (damaged)")
        check_meta(meta, row)
        if len(self._checked_headers) >= 16384:  # bounded: ~2 KB a block
            self._checked_headers.clear()
        self._checked_headers[row.hash] = (meta, head)
        return meta, head

    def touch_blocks(self, hashes: Sequence[str]) -> None:
        if self.readonly or not hashes:
            return
        try:
            with self._tx() as db:
                db.executemany("UPDATE blocks SET last_used=? WHERE hash=?", [(time.time(), h) for h in hashes])
        except StoreError:
            pass  # LRU bookkeeping must never fail a read

    def quarantine(self, h: str, reason: str) -> None:
        """Move a damaged block aside and mark it so it is never read again (read-only: mark nothing)."""
        self._checked_headers.pop(h, None)
        drops.dropped([h], "quarantined")  # copies held in memory (engine/tier.py) go too
        if self.readonly:
            return
        src = self.block_path(h)
        dst = self.path / "quarantine" / f"{h}.{int(time.time())}.kvb"
        moved = None
        try:
            if src.exists():
                os.replace(src, dst)
                moved = str(dst)
        except OSError:
            pass
        try:
            with self._tx() as db:
                db.execute("UPDATE blocks SET quarantined=1 WHERE hash=?", (h,))
                db.execute("INSERT INTO quarantine(hash, reason, at, path) VALUES(?,?,?,?)",
                           (h, reason, time.time(), moved))
        except StoreError:
            pass

    # ----------------------------------------------------------------- entries
    def commit_entry(self, entry: EntryRecord, blocks: Sequence[tuple[BlockMeta, torch.Tensor]]) -> None:
        """Write the entry's new block files and its record, then the entry and its chain in one transaction."""
        sizes = self.write_block_files(blocks)
        with self._recorded(entry, self._record_signature(entry)), self._tx() as db:
            self._insert_block_rows(db, [m for m, _ in blocks], sizes, verified=entry.verified, pinned=False)
            self.insert_entry_rows(db, entry)

    def commit_entries(self, items: Sequence[tuple[EntryRecord, Sequence[tuple[BlockMeta, torch.Tensor]]]]) -> None:
        """`commit_entry` of several entries at once (a batch `remember`, memory/many.py): every new block
        file written (one sync), every entry's record written, then every entry and its chain in ONE
        transaction: all of them are in the catalogue (and its change feed) after it, or none is."""
        if not items:
            return
        if len({e.id for e, _ in items}) != len(items):
            raise InvalidInput("an entry appears twice in one commit")
        unique: dict[str, tuple[BlockMeta, torch.Tensor]] = {}
        for _, blocks in items:
            for m, payload in blocks:
                unique.setdefault(m.hash, (m, payload))
        sizes = self.write_block_files(list(unique.values()))
        with ExitStack() as records:
            for entry, _ in items:
                records.enter_context(self._recorded(entry, self._record_signature(entry)))
            with self._tx() as db:
                for entry, blocks in items:
                    self._insert_block_rows(db, [m for m, _ in blocks], sizes, verified=entry.verified, pinned=False)
                    self.insert_entry_rows(db, entry)

    @staticmethod
    def insert_entry_rows(db: sqlite3.Connection, entry: EntryRecord) -> None:
        """The entry's catalogue row and chain rows (replacing any), inside the caller's transaction."""
        db.execute("DELETE FROM entry_blocks WHERE entry_id=?", (entry.id,))
        db.execute(
                "INSERT OR REPLACE INTO entries(id, namespace, problem, solution, answer, verifier_json, verified, "
                "token_ids, n_tokens, profile_id, attestation_json, meta_json, created, updated) "
                "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (entry.id, entry.namespace, entry.problem, entry.solution, entry.answer,
                 json.dumps(entry.verifier, sort_keys=True), int(entry.verified),
                 np.asarray(entry.token_ids, dtype="<u4").tobytes(), len(entry.token_ids), entry.profile_id,
                 json.dumps(entry.attestation, sort_keys=True), json.dumps(entry.meta, sort_keys=True),
                 entry.created, entry.updated),
            )
        db.executemany("INSERT INTO entry_blocks(entry_id, idx, hash) VALUES(?,?,?)",
                       [(entry.id, i, h) for i, h in enumerate(entry.chain)])

    # Records (records.py) are written, fsynced, before the catalogue commit: a crash after the write
    # and before the commit leaves a record whose `previous_sha256` is the row's hash, which fsck tells
    # from a damaged row. A commit that fails in this process puts the previous record back at once.
    @contextmanager
    def _recorded(self, entry: EntryRecord, signature: dict | None = None):
        rf = self.records
        if rf is None:
            yield
            return
        self._require_writable()
        prev = self.raw_entry(entry.id)
        try:
            old = rf.read_bytes(entry.id)
            rf.write(entry, previous_sha256=content_sha256(prev) if prev is not None else None, signature=signature)
        except OSError as exc:
            raise self._wrap_os(exc, f"writing the record of entry {entry.id}") from exc
        try:
            yield
        except BaseException:
            try:
                rf.restore(entry.id, old)
            except OSError:
                pass  # fsck tells the uncommitted record by its previous_sha256
            raise

    def _record_signature(self, entry: EntryRecord) -> dict | None:
        """What a record keeps of the entry's signature (signed stores: signing.py)."""
        return None

    def has_record(self, entry_id: str) -> bool:
        """Whether the entry has a record beside the blocks (then an entry the catalogue lacks was lost
        by the catalogue, not forgotten: `kvmemory fsck --repair` puts it back)."""
        rf = self.records
        return rf is not None and rf.path(entry_id).exists()

    def set_aside_entries(self) -> list[dict]:
        """Entries `fsck --repair` set aside (kept in `quarantined_entries`, never served) that the catalogue
        does not serve again: [{"id", "namespace", "problem", "reason"}], so the router keeps routing their
        questions and an answer names them in `refused` instead of answering as if they never were."""
        try:
            rows = self._q("SELECT id, reason, row_json FROM quarantined_entries ORDER BY at")
            live = {eid for (eid,) in self._q("SELECT id FROM entries")}
        except StoreError:
            return []  # never repaired: no such table
        from kvmemory.store.safe_files import loads_bounded

        out: dict[str, dict] = {}
        for eid, reason, body in rows:
            if not isinstance(eid, str) or eid in live:
                continue
            try:
                d = loads_bounded(body, "set-aside row")
            except IntegrityError:
                d = {}
            d = d if isinstance(d, dict) else {}
            out[eid] = {"id": eid, "namespace": d.get("namespace"), "problem": d.get("problem"),
                        "reason": str(reason)}
        return list(out.values())

    def raw_entry(self, entry_id: str) -> EntryRecord | None:
        """The catalogue row of an entry as it is (no signature check), None when absent or unreadable."""
        try:
            return LocalStore.get_entry(self, entry_id)
        except (UnknownEntry, IntegrityError, StoreError):
            return None

    def _wrap_os(self, exc: OSError, what: str) -> StoreError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return StoreFull(f"no room on the disk holding {self.path}: {what} failed; nothing was stored ({exc})")
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return StoreReadOnly(f"cannot write into {self.path}: {what} failed ({exc})")
        return StoreError(f"{what} in {self.path} failed: {exc}")

    def _entry_from_row(self, row) -> EntryRecord:
        chain = tuple(h for (h,) in self._q("SELECT hash FROM entry_blocks WHERE entry_id=? ORDER BY idx", (row[0],)))
        return entry_from_fields(row, chain)

    _ENTRY_COLS = ("id, namespace, problem, solution, answer, verifier_json, verified, token_ids, profile_id, "
                   "attestation_json, meta_json, created, updated")

    def get_entry(self, entry_id: str, namespace: str | None = None) -> EntryRecord:
        rows = self._q(f"SELECT {self._ENTRY_COLS} FROM entries WHERE id=?", (entry_id,))
        row = rows[0] if rows else None
        if row is None or (namespace is not None and row[1] != namespace):
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise UnknownEntry(f"no entry {entry_id!r}{where}; `kvmemory list` (`KVMemory.list`) lists entries")
        return self._entry_from_row(row)

    def list_entries(self, namespace: str | None = None) -> list[EntryRecord]:
        q = f"SELECT {self._ENTRY_COLS} FROM entries"
        args: tuple = ()
        if namespace is not None:
            q += " WHERE namespace=?"
            args = (namespace,)
        return [self._entry_from_row(r) for r in self._q(q + " ORDER BY created, id", args)]

    def namespace_counts(self) -> dict[str, int]:
        """Every namespace that holds entries, with how many (sorted by name)."""
        return {str(ns): int(n) for ns, n in self._q(
            "SELECT namespace, COUNT(*) FROM entries GROUP BY namespace ORDER BY namespace")}

    # ----------------------------------------------------------------- the change feed (store/feed.py)
    def feed_head(self) -> FeedHead | None:
        """The feed's id and last sequence number (one indexed read); None for a catalogue without one."""
        return local_head(self._q)

    def changes_since(self, seq: int, limit: int = 10_000) -> list[Change] | None:
        """Entries committed or deleted after `seq`, oldest first (at most `limit`); None when some of
        them were trimmed from the feed (the reader resyncs from the catalogue)."""
        return local_changes(self._q, seq, limit)

    def entry_ids(self, namespace: str | None = None) -> list[str]:
        if namespace is None:
            return [r[0] for r in self._q("SELECT id FROM entries ORDER BY created, id")]
        return [r[0] for r in self._q("SELECT id FROM entries WHERE namespace=? ORDER BY created, id", (namespace,))]

    def update_attestation(self, entry_id: str, attestation: dict, verified: bool) -> None:
        import dataclasses

        now = time.time()
        cur = self.raw_entry(entry_id)
        new = None if cur is None else dataclasses.replace(
            cur, attestation=json.loads(json.dumps(attestation, sort_keys=True)), updated=now)
        with (self._recorded(new) if new is not None else nullcontext()), self._tx() as db:
            db.execute("UPDATE entries SET attestation_json=?, updated=? WHERE id=?",
                       (json.dumps(attestation, sort_keys=True), now, entry_id))
            if verified:
                db.execute("UPDATE blocks SET verified=1 WHERE hash IN "
                           "(SELECT hash FROM entry_blocks WHERE entry_id=?)", (entry_id,))

    def delete_entries(self, entry_ids: Sequence[str]) -> int:
        """Remove entries and every block no longer referenced by an entry (pinned blocks stay).

        Each record is marked forgotten before the catalogue commit and removed after it, so a crash in
        between is not mistaken by fsck for a catalogue row that was lost."""
        rf = self.records
        self._require_writable()
        try:
            marked = [eid for eid in dict.fromkeys(entry_ids) if rf is not None and rf.begin_forget(eid)]
        except OSError as exc:
            raise self._wrap_os(exc, "marking entry records forgotten") from exc
        try:
            with self._tx() as db:
                for eid in entry_ids:
                    db.execute("DELETE FROM entries WHERE id=?", (eid,))
                    db.execute("DELETE FROM entry_blocks WHERE entry_id=?", (eid,))
                gone = [h for (h,) in db.execute(
                    "SELECT hash FROM blocks WHERE pinned=0 AND hash NOT IN (SELECT hash FROM entry_blocks)")]
                db.executemany("DELETE FROM blocks WHERE hash=?", [(h,) for h in gone])
        except BaseException:
            for eid in marked:
                rf.undo_forget(eid)
            raise
        for eid in marked:
            rf.end_forget(eid)
        drops.dropped(gone, "deleted")
        for h in gone:
            self.block_path(h).unlink(missing_ok=True)
        return len(gone)

    # ----------------------------------------------------------------- accounting and eviction
    def stats(self) -> StoreStats:
        ((entries, verified),) = self._q("SELECT COUNT(*), COALESCE(SUM(verified),0) FROM entries")
        ((blocks, quarantined, nbytes, tokens),) = self._q(
            "SELECT COUNT(*), COALESCE(SUM(quarantined),0), COALESCE(SUM(file_nbytes),0), "
            "COALESCE(SUM(n_tokens),0) FROM blocks")
        ((referenced,),) = self._q(
            "SELECT COALESCE(SUM(b.n_tokens),0) FROM entry_blocks eb JOIN blocks b ON b.hash=eb.hash")
        try:
            return StoreStats(int(entries), int(verified), int(blocks), int(quarantined), int(nbytes), int(tokens),
                              int(referenced))
        except (TypeError, ValueError) as exc:  # text where numbers belong: a damaged row
            raise IntegrityError(f"the catalogue at {self.path} holds damaged rows ({exc}); run `kvmemory fsck`") from exc

    def evict(self, max_bytes: int) -> int:
        """Delete least-recently-used blocks that are neither pinned nor verified until the store
        holds at most `max_bytes` of blocks. Entries that referenced them simply graft less."""
        freed = 0
        with self._tx() as db:
            total = db.execute("SELECT COALESCE(SUM(file_nbytes),0) FROM blocks").fetchone()[0]
            victims = []
            for h, size in db.execute(
                    "SELECT hash, file_nbytes FROM blocks WHERE pinned=0 AND verified=0 ORDER BY last_used, hash"):
                if total - freed <= max_bytes:
                    break
                victims.append(h)
                freed += size
            db.executemany("DELETE FROM blocks WHERE hash=?", [(h,) for h in victims])
        drops.dropped(victims, "evicted")
        for h in victims:
            self.block_path(h).unlink(missing_ok=True)
        return freed

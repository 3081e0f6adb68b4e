"""Portable bundles: chosen entries with their KV blocks, profiles and attestations in one file.

`kvmemory export` writes one, `kvmemory import` reads one (memory/transfer.py checks the profile and
proves the entries on arrival). A bundle is an uncompressed POSIX ustar archive of plain files, in
this order (`P` is the prefix `kvmemory-bundle/`):

    P bundle.json          {"format": "kvmemory-bundle", "version": 1, "created": unix time,
                           "kvmemory_version", "entries": n, "blocks": n, "profiles": [profile ids]}
    P profiles.json        {profile_id: the execution profile as the store holds it
                           (ExecutionProfile.to_dict(), engine/profile.py)}
    P entries.json         [entry, ...] in export order: `EntryRecord.to_json()` (id, namespace, problem,
                           solution, answer, verifier, verified, n_tokens, profile_id, chain, attestation,
                           meta, created, updated) plus "token_ids" (the rendered prompt's ids, ints)
    P blocks/<hash>.bin    one per block of the entries' chains, deduplicated, in chain order: the raw
                           payload bytes as the store holds them (blocks.py's layout, no conversion: for
                           each layer l, K_l then V_l, each a C-contiguous [H_kv, T, D] array in the
                           block's dtype); <hash> is the block's chain hash (64 lowercase hex digits)
    P catalogue.json       {"blocks": [header, ...]}: each block's header (`BlockMeta.to_json()`: hash,
                           parent, profile_id, index, position, token_ids, dtype, k_shapes, v_shapes,
                           payload_nbytes, payload_sha256, format), in the order of the block members
    P MANIFEST.json        LAST: {"format": "kvmemory-bundle", "version": 1, "members": [{"name", "size",
                           "sha256"}, ...]}: every other member, in archive order

JSON members are UTF-8, sorted keys, no spaces. Nothing is pickled; the payload bytes are never
converted (a NaN payload or a signed zero travels as it is). There are no signatures: a shared store's
HMAC keys are its own secret, and the importing store signs what it accepts with its key
(memory/transfer.py says when).

Writing (`write_bundle`) reads every block through the store's verified read path (SHA-256 against
the catalogue: a damaged source block is refused, not exported), streams the archive into a temporary
file next to the target (`.<name>.<pid>.<random>.partial`), fsyncs it and renames it into place: the
target name never holds a half-written bundle. A process killed mid-way leaves at most that hidden
partial file.

Reading (`read_bundle`) checks the whole file before anything is used, in one sequential pass:
- a complete uncompressed tar (end-of-archive marker present, nothing after it but zeros);
- every member a plain file with a known name (the six above), none twice, none absolute or with a
  `..` component (refused by name: `path-traversing`), no links, devices or folders;
- the manifest present and the last member, listing every other member in archive order, each
  member's size and SHA-256 equal to the manifest's;
- bundle.json's format and version readable here; the JSON members well-formed;
- each block: a well-formed header whose chain hash recomputes from its profile, parent and tokens, at
  its own position, whose payload size follows from its shapes and dtype and equals the member's
  size, and whose payload SHA-256 equals the header's `payload_sha256`; every block member in the
  catalogue and every catalogued block in the archive, each in some entry's chain;
- each entry: well-typed fields, a profile the bundle carries, and a complete chain: its blocks, all
  present, are exactly the chain hashes of its own token ids under its profile (`chain_hashes`).

Any failure raises `BundleError` naming the member and what is wrong. `Bundle.blocks_of(entry)` reads
an entry's payloads again when they are written into a store and checks each one's SHA-256 once more
(the file may have changed since it was checked): the bytes stored are the bytes checked.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import os
import re
import sys
import tarfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmemory.errors import BundleError, IntegrityError, InvalidInput, StoreError
from kvmemory.store.blocks import BlockMeta, chain_hash, chain_hashes
from kvmemory.store.local import EntryRecord
from kvmemory.store.records import MALFORMED, entry_from_dict

FORMAT = "kvmemory-bundle"
VERSION = 1
PREFIX = "kvmemory-bundle/"
BUNDLE_JSON = PREFIX + "bundle.json"
PROFILES_JSON = PREFIX + "profiles.json"
ENTRIES_JSON = PREFIX + "entries.json"
CATALOGUE_JSON = PREFIX + "catalogue.json"
MANIFEST_JSON = PREFIX + "MANIFEST.json"
_JSON_MEMBERS = (BUNDLE_JSON, PROFILES_JSON, ENTRIES_JSON, CATALOGUE_JSON, MANIFEST_JSON)
_BLOCK_MEMBER = re.compile(r"kvmemory-bundle/blocks/([0-9a-f]{64})\.bin")
MAX_JSON_BYTES = 1 << 30  # a JSON member larger than this is not a bundle this reads
_READ = 1 << 20
_TAR_BLOCK = 512


def block_member(h: str) -> str:
    return f"{PREFIX}blocks/{h}.bin"


def _json_bytes(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _version() -> str:
    try:
        return importlib.metadata.version("kvmemory")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _bar(progress: bool, **kw):
    from tqdm import tqdm

    return tqdm(disable=not progress, file=sys.stderr, **kw)


# ---------------------------------------------------------------------- entries as JSON
def entry_to_json(e: EntryRecord) -> dict:
    """An entry as the bundle keeps it: `EntryRecord.to_json()` plus its token ids."""
    return {**e.to_json(), "token_ids": [int(t) for t in e.token_ids]}


def entry_from_json(d: object, where: str) -> EntryRecord:
    """An EntryRecord from its bundle JSON, every field type-checked (as a record's entry is)."""
    if not isinstance(d, dict):
        raise BundleError(f"{where}: an entry is not a JSON object")
    try:
        rec = entry_from_dict(d)
    except (*MALFORMED, IntegrityError) as exc:
        name = d.get("id") if isinstance(d.get("id"), str) else "?"
        raise BundleError(f"{where}: entry {name!r} is malformed ({exc})") from None
    if not rec.id or not rec.namespace:
        raise BundleError(f"{where}: an entry has an empty id or namespace")
    return rec


# ---------------------------------------------------------------------- writing
@dataclass(slots=True, frozen=True)
class ExportReport:
    """What `write_bundle` wrote."""

    out: str
    entry_ids: list[str]
    namespaces: list[str]
    profiles: list[str]
    blocks: int
    payload_bytes: int
    bytes: int  # the bundle file's size
    sha256: str  # the bundle file's SHA-256
    left_out: list[str] = field(default_factory=list)  # entries a signed store refused to read (unsigned / forged)

    def to_json(self) -> dict:
        return {"out": self.out, "entries": len(self.entry_ids), "entry_ids": self.entry_ids,
                "namespaces": self.namespaces, "profiles": self.profiles, "blocks": self.blocks,
                "payload_bytes": self.payload_bytes, "bytes": self.bytes, "sha256": self.sha256,
                "left_out": self.left_out}


class _HashingWriter:
    """A write-only file wrapper that hashes (SHA-256) and counts what passes through: the bundle's
    digest without reading it back. tarfile asks only for write() and tell() in "w" mode."""

    def __init__(self, fh):
        self._fh = fh
        self.sha = hashlib.sha256()
        self.n = 0

    def write(self, b) -> int:
        self._fh.write(b)
        self.sha.update(b)
        self.n += len(b)
        return len(b)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self._fh.flush()


def _select(store, entry_ids: Sequence[str] | None, namespace: str | None) -> list[EntryRecord]:
    if entry_ids:
        out = []
        for eid in dict.fromkeys(entry_ids):
            out.append(store.get_entry(eid, namespace))  # UnknownEntry names it (and the namespace)
        return out
    return store.list_entries(namespace)


def write_bundle(store, out: str | os.PathLike, *, entry_ids: Sequence[str] | None = None,
                 namespace: str | None = None, progress: bool = False) -> ExportReport:
    """Write the chosen entries (`entry_ids`, else every entry of `namespace`, else every entry) of
    `store` with every block of their chains, their profiles and attestations to the bundle `out`
    (layout and guarantees: the module docstring). Returns what was written."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise InvalidInput(f"{out} is a folder; give the bundle's file name (e.g. {out / 'entries.kvmb'})")
    if not out.parent.is_dir():
        raise InvalidInput(f"the folder {out.parent} does not exist; create it first")
    entries = _select(store, entry_ids, namespace)
    if not entries:
        where = f" in namespace {namespace!r}" if namespace is not None else ""
        raise InvalidInput(f"nothing to export: the store holds no entries{where}")
    hashes = list(dict.fromkeys(h for e in entries for h in e.chain))
    rows = store.known_blocks(hashes)
    for e in entries:
        for h in e.chain:
            if h not in rows:
                raise StoreError(f"entry {e.id}: block {h[:12]} of its chain is not in the store (evicted or "
                                 "quarantined; `kvmemory fsck` reports it). Leave the entry out (--entry) or "
                                 "remember it again, then export")
    profiles = {}
    for pid in dict.fromkeys(e.profile_id for e in entries):
        prof = store.get_profile(pid)
        if prof is None:
            raise StoreError(f"the store has no record of execution profile {pid[:12]} its entries were made "
                             "under; they cannot be exported with it")
        profiles[pid] = prof
    left_out = list(getattr(store, "rejected", []) or []) if not entry_ids else []
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial"
    now = time.time()
    manifest: list[dict] = []
    metas: list[dict] = []
    payload_bytes = 0
    try:
        with open(tmp, "wb") as raw:
            w = _HashingWriter(raw)
            with tarfile.open(fileobj=w, mode="w", format=tarfile.USTAR_FORMAT) as tf:
                def add(name: str, data) -> None:
                    ti = tarfile.TarInfo(name)
                    ti.size = len(data)
                    ti.mtime = int(now)
                    ti.mode = 0o644
                    ti.type = tarfile.REGTYPE
                    tf.addfile(ti, io.BytesIO(data))
                    manifest.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})

                add(BUNDLE_JSON, _json_bytes({"format": FORMAT, "version": VERSION, "created": now,
                                              "kvmemory_version": _version(), "entries": len(entries),
                                              "blocks": len(hashes), "profiles": list(profiles)}))
                add(PROFILES_JSON, _json_bytes(profiles))
                add(ENTRIES_JSON, _json_bytes([entry_to_json(e) for e in entries]))
                with _bar(progress, total=len(hashes), desc="export", unit="block") as bar:
                    for h in hashes:
                        meta, payload = store.read_block(rows[h])  # verified against the catalogue
                        if meta.hash != h:
                            raise IntegrityError(f"block {h[:12]}: the store returned block {meta.hash[:12]}")
                        add(block_member(h), memoryview(payload).cast("B"))
                        metas.append(meta.to_json())
                        payload_bytes += meta.payload_nbytes
                        bar.update(1)
                add(CATALOGUE_JSON, _json_bytes({"blocks": metas}))
                add(MANIFEST_JSON, _json_bytes({"format": FORMAT, "version": VERSION, "members": manifest}))
            raw.flush()
            os.fsync(raw.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out.parent)
    return ExportReport(out=str(out), entry_ids=[e.id for e in entries],
                        namespaces=sorted({e.namespace for e in entries}), profiles=list(profiles),
                        blocks=len(hashes), payload_bytes=payload_bytes, bytes=size, sha256=w.sha.hexdigest(),
                        left_out=left_out)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- reading
@dataclass(slots=True, frozen=True)
class Member:
    name: str
    offset: int  # where its data starts in the file
    size: int
    sha256: str


@dataclass(slots=True)
class Bundle:
    """A bundle checked in full by `read_bundle` (see the module docstring)."""

    path: Path
    sha256: str  # of the whole file
    size: int
    info: dict  # bundle.json
    profiles: dict[str, dict]
    entries: list[EntryRecord]
    blocks: dict[str, BlockMeta]  # by hash, in archive order
    members: dict[str, Member]

    @property
    def payload_bytes(self) -> int:
        return sum(m.payload_nbytes for m in self.blocks.values())

    def payload(self, h: str) -> torch.Tensor:
        """Block `h`'s payload (uint8), read from the file again and checked against its header's
        SHA-256 (a file changed since `read_bundle` checked it raises BundleError)."""
        meta, m = self.blocks[h], self.members[block_member(h)]
        buf = bytearray(m.size)
        try:
            with open(self.path, "rb", buffering=0) as fh:
                got = os.preadv(fh.fileno(), [buf], m.offset) if m.size else 0
        except OSError as exc:
            raise BundleError(f"{self.path}: cannot read {m.name} again ({exc})") from exc
        if got != m.size or hashlib.sha256(buf).hexdigest() != meta.payload_sha256:
            raise BundleError(f"{self.path} changed after it was checked ({m.name} no longer matches its "
                              "SHA-256); nothing more of it is used")
        return torch.frombuffer(buf, dtype=torch.uint8) if m.size else torch.empty(0, dtype=torch.uint8)

    def blocks_of(self, entry: EntryRecord) -> list[tuple[BlockMeta, torch.Tensor]]:
        """The entry's chain as (header, payload) pairs, in chain order, ready for `Store.commit_entry`."""
        return [(self.blocks[h], self.payload(h)) for h in entry.chain]


def _member_kind(ti: tarfile.TarInfo) -> str:
    for test, what in ((ti.isdir, "a folder"), (ti.issym, "a symbolic link"), (ti.islnk, "a hard link"),
                       (ti.ischr, "a character device"), (ti.isblk, "a block device"), (ti.isfifo, "a FIFO")):
        if test():
            return what
    return "not a plain file"


def _check_name(name: str, seen: set[str]) -> None:
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts or (len(name) > 1 and name[1] == ":"):
        raise BundleError(f"member {name!r} has a path-traversing or absolute name; a bundle holds only "
                          f"names under {PREFIX}")
    if name not in _JSON_MEMBERS and not _BLOCK_MEMBER.fullmatch(name):
        raise BundleError(f"unknown member {name!r}: a kvmemory bundle holds only {', '.join(_JSON_MEMBERS)} and "
                          f"{PREFIX}blocks/<hash>.bin")
    if name in seen:
        raise BundleError(f"member {name!r} appears twice")
    seen.add(name)


def _list_members(fh, path: Path) -> list[tarfile.TarInfo]:
    """The archive's members, each checked for its kind and name (nothing is extracted)."""
    out: list[tarfile.TarInfo] = []
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=fh, mode="r:") as tf:
            while True:
                ti = tf.next()
                if ti is None:
                    break
                if not ti.isreg() or ti.issparse():
                    raise BundleError(f"member {ti.name!r} is {_member_kind(ti)}; a bundle holds plain files only")
                _check_name(ti.name, seen)
                out.append(ti)
    except BundleError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeError) as exc:
        raise BundleError(f"{path} is not a complete uncompressed tar archive ({exc}); it is truncated or "
                          "not a kvmemory bundle") from None
    return out


def _scan(fh, path: Path, members: list[tarfile.TarInfo], file_size: int, keep: set[str], progress: bool):
    """One sequential pass over the file: the whole file's SHA-256, each member's SHA-256, the bytes
    of the members named in `keep`, and the tail after the last member (it must be zeros)."""
    whole = hashlib.sha256()
    digests: dict[str, str] = {}
    kept: dict[str, bytes] = {}
    pos = 0
    fh.seek(0)

    def feed(n: int, member_hash=None, sink: list | None = None) -> None:
        nonlocal pos
        while n:
            chunk = fh.read(min(_READ, n))
            if not chunk:
                raise BundleError(f"{path}: the file ends inside a member: it is truncated")
            whole.update(chunk)
            if member_hash is not None:
                member_hash.update(chunk)
            if sink is not None:
                sink.append(chunk)
            n -= len(chunk)
            pos += len(chunk)
            bar.update(len(chunk))

    with _bar(progress, total=file_size, desc="check", unit="B", unit_scale=True) as bar:
        for ti in members:
            if ti.offset_data < pos or ti.offset_data + ti.size > file_size:
                raise BundleError(f"{path}: member {ti.name!r} runs past the end of the file: it is truncated")
            feed(ti.offset_data - pos)
            h = hashlib.sha256()
            sink: list | None = [] if ti.name in keep else None
            feed(ti.size, h, sink)
            digests[ti.name] = h.hexdigest()
            if sink is not None:
                kept[ti.name] = b"".join(sink)
        # After the last member: its padding, the end-of-archive marker (two zero blocks) and the
        # record padding, all zeros. Anything else is appended data.
        tail_zero = True
        tail = 0
        while True:
            chunk = fh.read(_READ)
            if not chunk:
                break
            whole.update(chunk)
            tail += len(chunk)
            bar.update(len(chunk))
            if chunk.count(0) != len(chunk):
                tail_zero = False
    end = members[-1].offset_data + members[-1].size if members else 0
    padded = end + (-end % _TAR_BLOCK)
    if not tail_zero:
        raise BundleError(f"{path}: there are bytes after the last member that are not the archive's end (data "
                          "appended)")
    if pos + tail < padded + 2 * _TAR_BLOCK:
        raise BundleError(f"{path}: the archive's end-of-archive marker is missing: the file is truncated")
    return whole.hexdigest(), digests, kept


def _load_json(name: str, data: bytes):
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{name} is not valid JSON ({exc})") from None


def read_bundle(path: str | os.PathLike, *, progress: bool = False) -> Bundle:
    """Read and check a whole bundle (every check of the module docstring); BundleError on any failure."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidInput(f"no bundle at {path} (give the file `kvmemory export --out` wrote)")
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise InvalidInput(f"cannot open {path}: {exc}") from exc
    with fh:
        size = os.fstat(fh.fileno()).st_size
        members = _list_members(fh, path)
        if not members or members[-1].name != MANIFEST_JSON:
            if any(ti.name == MANIFEST_JSON for ti in members):
                raise BundleError(f"{path}: the manifest ({MANIFEST_JSON}) is not the last member; a bundle is "
                                  "written with it last, so this one was altered or is incomplete")
            raise BundleError(f"{path}: no manifest ({MANIFEST_JSON}, the last member of every bundle); the "
                              "file is truncated or not a kvmemory bundle")
        for ti in members:
            if ti.name in _JSON_MEMBERS and ti.size > MAX_JSON_BYTES:
                raise BundleError(f"{ti.name} is {ti.size} bytes; the limit is {MAX_JSON_BYTES}")
        file_sha, digests, kept = _scan(fh, path, members, size, set(_JSON_MEMBERS), progress)
    manifest = _load_json(MANIFEST_JSON, kept[MANIFEST_JSON])
    _check_manifest(manifest, members[:-1], digests)
    missing = [n for n in _JSON_MEMBERS if n not in kept]
    if missing:
        raise BundleError(f"{path}: members {missing} are missing")
    info = _load_json(BUNDLE_JSON, kept[BUNDLE_JSON])
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise BundleError(f"{path} is not a kvmemory bundle ({BUNDLE_JSON} does not say format {FORMAT!r})")
    if not isinstance(info.get("version"), int) or info["version"] > VERSION:
        raise BundleError(f"{path} was written by a newer kvmemory (bundle version {info.get('version')!r}; this "
                          f"one reads up to {VERSION}). Upgrade kvmemory to import it")
    profiles = _load_json(PROFILES_JSON, kept[PROFILES_JSON])
    if not isinstance(profiles, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in profiles.items()):
        raise BundleError(f"{PROFILES_JSON} is not an object of profile id -> profile")
    raw_entries = _load_json(ENTRIES_JSON, kept[ENTRIES_JSON])
    if not isinstance(raw_entries, list) or not raw_entries:
        raise BundleError(f"{ENTRIES_JSON} is not a non-empty list of entries")
    catalogue = _load_json(CATALOGUE_JSON, kept[CATALOGUE_JSON])
    if not isinstance(catalogue, dict) or not isinstance(catalogue.get("blocks"), list):
        raise BundleError(f"{CATALOGUE_JSON} is not an object with a list of blocks")
    by_name = {ti.name: Member(ti.name, ti.offset_data, ti.size, digests[ti.name]) for ti in members}
    blocks = _check_blocks(catalogue["blocks"], by_name, profiles)
    entries = _check_entries(raw_entries, blocks, profiles)
    return Bundle(path=path, sha256=file_sha, size=size, info=info, profiles=profiles, entries=entries,
                  blocks=blocks, members=by_name)


def _check_manifest(manifest: object, members: list[tarfile.TarInfo], digests: dict[str, str]) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("members"), list):
        raise BundleError(f"{MANIFEST_JSON} is not a kvmemory bundle manifest")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > VERSION:
        raise BundleError(f"the manifest is of bundle version {manifest.get('version')!r}; this kvmemory reads up to "
                          f"{VERSION}. Upgrade kvmemory to import it")
    listed = manifest["members"]
    for i, rec in enumerate(listed):
        if not (isinstance(rec, dict) and isinstance(rec.get("name"), str) and type(rec.get("size")) is int
                and isinstance(rec.get("sha256"), str)):
            raise BundleError(f"{MANIFEST_JSON}: record {i} is not {{name, size, sha256}}")
    names = [rec["name"] for rec in listed]
    actual = [ti.name for ti in members]
    if names != actual:
        extra = [n for n in actual if n not in set(names)]
        gone = [n for n in names if n not in set(actual)]
        if extra:
            raise BundleError(f"member {extra[0]!r} is not in the manifest (an extra member)")
        if gone:
            raise BundleError(f"member {gone[0]!r} is in the manifest but not in the archive")
        raise BundleError("the members are not in the manifest's order")
    for rec, ti in zip(listed, members):
        if rec["size"] != ti.size:
            raise BundleError(f"member {ti.name!r} has {ti.size} bytes; the manifest says {rec['size']}")
        if rec["sha256"] != digests[ti.name]:
            raise BundleError(f"member {ti.name!r}: its SHA-256 does not match the manifest (damaged)")


def _check_blocks(raw: list, members: dict[str, Member], profiles: dict) -> dict[str, BlockMeta]:
    blocks: dict[str, BlockMeta] = {}
    for i, d in enumerate(raw):
        if not isinstance(d, dict):
            raise BundleError(f"{CATALOGUE_JSON}: block {i} is not a JSON object")
        try:
            meta = BlockMeta.from_json(d)
            nbytes = meta.expected_nbytes()
        except IntegrityError as exc:
            raise BundleError(f"{CATALOGUE_JSON}: block {i}: {exc}") from None
        h = meta.hash
        name = block_member(h) if re.fullmatch(r"[0-9a-f]{64}", h) else None
        if name is None or name not in members:
            raise BundleError(f"{CATALOGUE_JSON}: block {h[:12]!r} has no payload member in the archive")
        if h in blocks:
            raise BundleError(f"{CATALOGUE_JSON}: block {h[:12]} is listed twice")
        try:
            ok = chain_hash(meta.profile_id, meta.parent, meta.token_ids) == h
        except (ValueError, OverflowError):
            ok = False
        # Positions are checked exactly along each entry's chain below (_check_entries); a header alone
        # bounds them (chunks are C long but where a cut ends one: runner.chunk_spans).
        if not ok or meta.n_tokens == 0 or meta.position < meta.index or (meta.index == 0) != (meta.position == 0):
            raise BundleError(f"block {h[:12]}: its header is not self-consistent (chain hash or position)")
        if meta.profile_id not in profiles:
            raise BundleError(f"block {h[:12]} was made under profile {meta.profile_id[:12]}, which the bundle "
                              "does not carry")
        m = members[name]
        if nbytes != meta.payload_nbytes or m.size != meta.payload_nbytes:
            raise BundleError(f"block {h[:12]}: its payload member has {m.size} bytes, its header says "
                              f"{meta.payload_nbytes} (its shapes: {nbytes})")
        if m.sha256 != meta.payload_sha256:
            raise BundleError(f"block {h[:12]}: its payload's SHA-256 does not match the block's recorded "
                              "payload_sha256 (the payload was altered)")
        blocks[h] = meta
    extra = [n for n in members if _BLOCK_MEMBER.fullmatch(n) and _BLOCK_MEMBER.fullmatch(n).group(1) not in blocks]
    if extra:
        raise BundleError(f"member {extra[0]!r} is a block the catalogue does not list")
    return blocks


def _check_entries(raw: list, blocks: dict[str, BlockMeta], profiles: dict) -> list[EntryRecord]:
    entries: list[EntryRecord] = []
    seen: set[str] = set()
    used: set[str] = set()
    for i, d in enumerate(raw):
        e = entry_from_json(d, f"{ENTRIES_JSON}[{i}]")
        if e.id in seen:
            raise BundleError(f"entry {e.id} appears twice")
        seen.add(e.id)
        if e.profile_id not in profiles:
            raise BundleError(f"entry {e.id} was made under profile {e.profile_id[:12]}, which the bundle does "
                              "not carry")
        missing = [h for h in e.chain if h not in blocks]
        if missing:
            raise BundleError(f"entry {e.id}: its chain is incomplete (block {missing[0][:12]} is not in the "
                              "bundle)")
        if e.chain:
            # An entry's chain: every chunk of its token ids, the last one cut at their end (a tail block);
            # its first block is a whole one of the grid C, or the entry's only block
            chunk = blocks[e.chain[0]].n_tokens
            expected = chain_hashes(e.profile_id, list(e.token_ids), chunk, tail=True)
            pos, placed = 0, True
            for k, h in enumerate(e.chain):
                placed = placed and blocks[h].position == pos and blocks[h].index == k
                pos += blocks[h].n_tokens
            if list(e.chain) != expected[: len(e.chain)] or not placed:
                raise BundleError(f"entry {e.id}: its chain is not the chain of its own token ids under its profile")
        used.update(e.chain)
        entries.append(e)
    unused = [h for h in blocks if h not in used]
    if unused:
        raise BundleError(f"block {unused[0][:12]} is in no entry's chain")
    return entries


__all__ = ["Bundle", "ExportReport", "read_bundle", "write_bundle", "entry_to_json", "entry_from_json",
           "FORMAT", "VERSION", "MANIFEST_JSON", "block_member"]

"""The SHA-256 of files, remembered across processes, so a model's files are hashed once, not at every open.

An execution profile names a model loaded from files by its files' SHA-256 (loading.weights_files), and
an attestation names them too (loading.model_identity). Hashing an 8B model's 16 GB at every open costs
seconds; this module remembers each digest in a small JSON file in the user cache folder
(`paths.cache_dir() / file-sha256.json`), keyed by what the kernel says about the file:

    (resolved path, size, mtime_ns, ctime_ns, inode, device id)

A file rewritten in place gets a new mtime (and a new ctime even when a tool puts the old mtime back:
`touch -d`, `cp -p`, `rsync -t` can set mtime but nobody can set ctime), a replaced file a new inode or
ctime, so any change makes a new key and the file is hashed again; an unchanged file is not read at all.
What this cannot see is a file changed without the kernel noticing (a disk edited underneath the
filesystem), which the in-memory hash it replaces could not see either at the next open.

The cache file is a convenience, never an authority it would be unsafe to lose:
- written whole to a temporary name and renamed into place (readers see an old file or a new one),
  by one process at a time (cache_files.exclusive), merging what is already there;
- read whole or not at all: it carries the SHA-256 of its entries, and a file that is not JSON, is of
  another format, fails that checksum or holds one malformed entry is ignored entirely (and replaced
  at the next write), never trusted in part;
- JSON only (no pickle); a cache folder that cannot be written costs a re-hash next time, no error.
Who can write the user's cache folder can make a changed file pass for the old one, but they could
equally replace the converted model kept in the same folder: no new trust is placed in it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

from kvmemory.models import cache_files
from kvmemory.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT = "kvmemory-file-sha256"
VERSION = 1
FILE_NAME = "file-sha256.json"
MAX_ENTRIES = 4096  # oldest dropped past this (a digest is ~200 bytes of JSON: the file stays small)
_TMP_PREFIX = ".file-sha256-"

Key = tuple[str, int, int, int, int, int]  # (path, size, mtime_ns, ctime_ns, inode, device)

_memo: dict[Key, str] = {}  # this process's digests (also what it has read from the cache file)
_memo_lock = threading.Lock()
_write_failed_logged = False


def cache_path() -> Path:
    return cache_dir() / FILE_NAME


def file_key(path: Path) -> Key:
    """What identifies `path`'s current content without reading it (its resolved path and stat)."""
    path = Path(path).resolve()
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def hash_file(path: Path) -> str:
    """SHA-256 of `path`'s bytes, read in 4 MiB pieces (hashlib releases the GIL while it hashes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes: remembered (in this process and in the cache file) for as long as
    its key (module docstring) stays the same, else read and hashed, and remembered."""
    key = file_key(Path(path))
    with _memo_lock:
        if key in _memo:
            return _memo[key]
    known = _read_cache()
    with _memo_lock:
        _memo.update(known)  # the model's other files are looked up next: one read of the cache file for all
    found = known.get(key)
    if found is not None:
        return found
    digest = _hash_stable(key)
    with _memo_lock:
        _memo[key] = digest
    _write_entries({key: digest})
    return digest


def _hash_stable(key: Key, attempts: int = 3) -> str:
    """Hash the file and check it did not change while it was read (same key before and after), so the
    digest remembered under `key` is the digest of that content."""
    path = Path(key[0])
    for _ in range(attempts):
        digest = hash_file(path)
        after = file_key(path)
        if after == key:
            return digest
        key = after
    from kvmemory.errors import KVMemoryError

    raise KVMemoryError(f"{path} kept changing while it was hashed ({attempts} tries): wait until whatever "
                        "writes it has finished, then open the model again")


# ---------------------------------------------------------------------- the cache file
def _checksum(entries: list) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _valid_entry(e: object) -> bool:
    return (isinstance(e, list) and len(e) == 7 and isinstance(e[0], str) and e[0]
            and all(type(x) is int and x >= 0 for x in e[1:6])
            and isinstance(e[6], str) and len(e[6]) == 64 and all(c in "0123456789abcdef" for c in e[6]))


def _parse(text: str) -> dict[Key, str] | None:
    """The entries of a cache file's text, or None when any part of it is not what this module writes."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("version") == VERSION
            and isinstance(doc.get("entries"), list) and isinstance(doc.get("sha256"), str)):
        return None
    entries = doc["entries"]
    if not all(_valid_entry(e) for e in entries) or _checksum(entries) != doc["sha256"]:
        return None
    return {tuple(e[:6]): e[6] for e in entries}


def _read_cache() -> dict[Key, str]:
    """The cache file's entries ({} when it is missing, unreadable or damaged: then it is ignored whole)."""
    path = cache_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        log.info("kvmemory: ignoring the file hash cache %s (%s)", path, exc)
        return {}
    entries = _parse(text)
    if entries is None:
        log.warning("kvmemory: the file hash cache %s is damaged or of another format; ignoring it (it is "
                    "written again)", path)
        return {}
    return entries


def _write_entries(new: dict[Key, str]) -> None:
    """Merge `new` into the cache file: under the writers' lock, read what is there (a damaged file
    counts as empty), add `new`, drop the oldest past MAX_ENTRIES, write a temporary file and rename it."""
    global _write_failed_logged
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with cache_files.exclusive(path.parent / (FILE_NAME + ".lock"), "the file hash cache"):
            cache_files.remove_leftovers(path.parent, _TMP_PREFIX)
            merged = _read_cache()
            for k in new:  # re-inserted last: the newest survive the cut below
                merged.pop(k, None)
            merged.update(new)
            items = list(merged.items())[-MAX_ENTRIES:]
            entries = [[*k, v] for k, v in items]
            body = json.dumps({"format": FORMAT, "version": VERSION, "entries": entries,
                               "sha256": _checksum(entries)}, separators=(",", ":"))
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(body)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    except OSError as exc:  # a read-only or full cache folder: the digest is simply computed again next time
        if not _write_failed_logged:
            _write_failed_logged = True
            log.warning("kvmemory: cannot write the file hash cache %s (%s); model files will be hashed again "
                        "at the next open", path, exc)


def forget_memo() -> None:
    """Forget this process's digests (tests: make the next lookup go to the cache file)."""
    with _memo_lock:
        _memo.clear()

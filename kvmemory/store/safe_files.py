"""Bounded reads for what fsck, the catalogue rebuild and the record checks open: a store's files may be
damaged or planted, so every one is read as untrusted.

    data = read_regular(path, max_bytes)      # UnsafeFile unless a regular file of at most max_bytes
    meta, data = read_block_file(path)        # a block file: header first, then exactly its payload
    obj = loads_bounded(data, "entry record") # IntegrityError for deep nesting (never RecursionError)

Rules: regular files only (a symbolic link, device, FIFO or socket is refused, never followed or read:
the open uses O_NOFOLLOW and O_NONBLOCK, and the type is checked on the open descriptor); the size is
checked against the bound (or the block header) before a byte of the body is read; JSON nesting deeper
than `MAX_JSON_DEPTH` is refused.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from kvmemory.errors import IntegrityError

MAX_RECORD_BYTES = 64 << 20  # an entry record or a profile file (texts, token ids, metadata)
MAX_JSON_DEPTH = 200


class UnsafeFile(IntegrityError):
    """A file a check will not read: not a regular file, or larger than it can be."""


def _open(path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{Path(path).name} is a symbolic link (not followed: a store holds regular files "
                             "only)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeFile(f"{Path(path).name} is not a regular file (a device, FIFO or socket is never read)")
    return fd


def _read_n(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 24))
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes`; UnsafeFile otherwise, OSError when unreadable."""
    fd = _open(Path(path))
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeFile(f"{Path(path).name} has {size} bytes, more than the {max_bytes} it can hold")
        data = _read_n(fd, max_bytes + 1)
        if len(data) > max_bytes:
            raise UnsafeFile(f"{Path(path).name} grew past {max_bytes} bytes while it was read")
        return data
    finally:
        os.close(fd)


def read_block_file(path: str | os.PathLike, expect_nbytes: int | None = None) -> bytes:
    """The bytes of a block file, read only when its size is what its header (and `expect_nbytes`, the
    catalogue's file size, when given) says it is; IntegrityError otherwise."""
    from kvmemory.store.blocks import read_header

    fd = _open(Path(path))
    try:
        size = os.fstat(fd).st_size
        if expect_nbytes is not None and size != expect_nbytes:
            raise IntegrityError(f"block file has {size} bytes, the catalogue says {expect_nbytes}")
        with os.fdopen(os.dup(fd), "rb", buffering=0) as fh:
            meta, off = read_header(fh)
        want = off + meta.payload_nbytes
        if size != want:
            raise IntegrityError(f"payload has {size - off} bytes, its header says {meta.payload_nbytes}")
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_n(fd, want)
    finally:
        os.close(fd)


def _depth_ok(data: bytes | str, limit: int) -> bool:
    """Whether the nesting of `data` (brackets outside strings) stays within `limit`; cheap pre-check."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return True
    depth, in_str, esc = 0, False, False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif c in (0x5D, 0x7D):
            depth -= 1
    return True


def loads_bounded(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH):
    """`json.loads` for untrusted bytes: IntegrityError (naming `what`) for JSON that does not parse,
    is not UTF-8, or nests deeper than `max_depth`."""
    if not _depth_ok(data, max_depth):
        raise IntegrityError(f"the {what} nests deeper than {max_depth} levels (damaged or hostile)")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise IntegrityError(f"the {what} is not JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


__all__ = ["read_regular", "read_block_file", "loads_bounded", "UnsafeFile", "MAX_RECORD_BYTES", "MAX_JSON_DEPTH"]

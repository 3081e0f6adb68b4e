"""Writing derived files into the cache folder so that a killed process blocks and corrupts nothing.

The converted embedded model and the GGUF panels are made once and shared by every process (and
every install) that uses one cache folder. Each is written under a temporary name and renamed into
place, so a reader sees all of it or none. Writers take an exclusive `fcntl.flock` on a lock file
next to it: the kernel drops the lock when its holder dies (SIGKILL included), so a lock file left
behind locks nothing, and a temporary file or folder found while holding the lock is a killed
writer's leftover, removed before writing again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


@contextlib.contextmanager
def exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` (created if missing) for the block; waits, saying so on
    stderr once, while another live process holds it."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("kvmemory: waiting for another process writing %s (%s)", what, lock_path.parent)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_leftovers(folder: Path, prefix: str) -> list[Path]:
    """Remove `folder`'s entries whose names start with `prefix` (a killed writer's temporary files or
    folders). Call it holding the lock that every writer of those names holds."""
    removed = []
    for p in folder.glob(f"{prefix}*"):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except FileNotFoundError:
            continue
        removed.append(p)
    if removed:
        log.info("kvmemory: removed %d leftover(s) of an interrupted write in %s", len(removed), folder)
    return removed

"""The page-cache state of the files a timed side reads, set before each timing: warm or cold.

A graft reads the store's block files; llama.cpp's restore reads its state file; the floor reads the
block files again. Whether those bytes come from the page cache or the disk changes a read by 3-6x,
and it is not a state a bench can leave to chance: the VM these benches run on pages out file pages
that no process maps once they have sat idle for about a minute (a DAMON scheme,
/sys/kernel/mm/damon: `pageout` of unmapped, non-anonymous memory aged 12 x 5 s; `reclaimer()` says
what this machine runs). A round of the graft bench at 8k takes minutes (llama.cpp's prefills), so
the side that came first after an idle spell read its files from the disk and the next one from
memory: measured at 8k, the same graft read its 189 MB in 0.056 s right after another graft and in
0.131 s after 100 s idle, while the floor, timed just after it, always found the files hot.

So each timed side that reads files is preceded by `warm` (every byte read once, untimed: the files
are in the page cache, as for a store in regular use) or `drop` (`posix_fadvise(DONTNEED)` after
`fdatasync`: the clean pages leave the page cache, so the side reads from the disk, as after a
reboot or a long idle spell). Both sides of a comparison get the same state.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_CHUNK = 1 << 20
_DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")


def warm(paths: Iterable[Path | str]) -> int:
    """Read every byte of `paths` once (untimed), so the next reads find them in the page cache;
    returns the bytes read."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total


def drop(paths: Iterable[Path | str]) -> None:
    """Evict `paths` from the page cache (written back first, so every page is clean and goes): the
    next read of them goes to the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def reclaimer() -> str | None:
    """What pages out idle file pages on this machine, where the kernel says (a running DAMON
    `pageout` scheme and its minimum age); None where none is found."""
    found = []
    for state in sorted(_DAMON.glob("*/state")):
        try:
            if state.read_text().strip() != "on":
                continue
            for scheme in sorted(state.parent.glob("contexts/*/schemes/*")):
                action = (scheme / "action").read_text().strip()
                if action != "pageout":
                    continue
                ctx = scheme.parent.parent
                aggr_us = int((ctx / "monitoring_attrs/intervals/aggr_us").read_text())
                age = int((scheme / "access_pattern/age/min").read_text())
                found.append(f"DAMON pageout of pages idle >= {age * aggr_us / 1e6:g} s")
        except (OSError, ValueError):
            continue
    return "; ".join(found) or None

"""Notices of blocks a store stops serving (quarantined, deleted, evicted), for whoever in this process
holds copies of their bytes.

The verified-once tier (engine/tier.py) keeps payloads it verified in memory. Its safety does not rest
on these notices: a graft serves a block from the tier only for a catalogue row the store returned for
that graft (present, visible, not quarantined) whose payload SHA-256 equals the digest the tier
verified the bytes against. The notices make it drop the bytes at once, so a quarantined or forgotten
block does not keep memory, and no later graft can find it there even under a row that reappears.

A store calls `dropped(hashes, why)`; listeners are registered with `listen`. Bound methods are held
by weak reference (a tier that is garbage collected stops listening by itself). A listener that
raises is logged and skipped: a quarantine must never fail because a cache could not be told.
Process-wide, not per store: a hash dropped by any store is dropped from every tier (content
addressing makes equal hashes the same block; dropping too much only costs a re-read).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable

_log = logging.getLogger("kvmemory.store.drops")
_lock = threading.Lock()
_listeners: list[Callable[[], Callable | None]] = []  # weak references (or plain ones, wrapped)


def listen(callback: Callable[[list[str], str], None]) -> None:
    """Call `callback(hashes, why)` whenever a store in this process stops serving blocks."""
    ref = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else (lambda cb=callback: cb)
    with _lock:
        _listeners.append(ref)


def dropped(hashes: Iterable[str], why: str) -> None:
    """Tell every listener that these blocks are no longer served (quarantine, delete, evict)."""
    hashes = list(hashes)
    if not hashes:
        return
    with _lock:
        live = [(ref, ref()) for ref in _listeners]
        _listeners[:] = [ref for ref, cb in live if cb is not None]
    for _, cb in live:
        if cb is None:
            continue
        try:
            cb(hashes, why)
        except Exception:  # a cache that cannot be told must not fail the store's operation
            _log.exception("a block-drop listener failed (%s)", why)

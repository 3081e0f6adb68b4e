"""Keeping this process's router current with its store: the change feed, never a listing per question.

Several processes on one local store, or servers on one Redis store, each route with their own router.
Before a search, `follow` asks the store for its feed head (store/feed.py: one read). Nothing new:
nothing else is read, whatever the store's size. Newer records: only the entries they name are read
and routed again (their texts changed, or they are new) or dropped (forgotten), O(changes) and in one
router change, made in memory (`Router.apply_unsaved`: writing the router's folder costs as much as
the namespace is large; this process's next router commit writes them, and a reload of the folder
that drops them makes the namespaces resync). An entry this process routed itself comes back as a
record too; its texts are already the router's, so it costs one catalogue read and no embedding.

A namespace is resynced in full from the catalogue (`resync`: its entry ids against the router's) the
first time this process searches it, and again whenever the feed cannot say what changed: another feed
(a rebuilt catalogue, a Redis server that lost its data), a head that went backwards, records trimmed
before this process read them, or more than `MAX_CHANGES` behind. A store without a feed (an old
read-only catalogue) is resynced at each search, as before. While the store cannot be read (Redis
away), the router is searched as it is.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvmemory.errors import KVMemoryError, StoreError, UnknownEntry

__all__ = ["MAX_CHANGES", "FeedCursor", "follow", "resync", "route_texts"]

_log = logging.getLogger("kvmemory.memory")

# Records applied one by one at most; further behind, a full resync of the searched namespace is cheaper.
MAX_CHANGES = 10_000
_PAGE = 1_000


@dataclass(slots=True)
class FeedCursor:
    """What this process's router reflects: the feed read, its last record applied, and the namespaces
    resynced in full since (only those follow the feed; the others are resynced when first searched)."""

    feed_id: str | None = None
    seq: int = 0
    synced: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    outage_logged: bool = False
    unsaved_lost: int = 0  # the router's count of reloads that dropped records applied in memory only


def route_texts(entry) -> list[str]:
    """What routes to an entry: its problem, then its aliases (as the router keeps them: no repeats)."""
    texts = [entry.problem, *(entry.meta.get("aliases") or ())]
    return list(dict.fromkeys(t for t in texts if isinstance(t, str) and t.strip()))


def follow(mem, namespace: str) -> int:
    """Bring `mem.router` up to date for a search of `namespace` (the module docstring); returns how many
    entries were routed again or dropped."""
    cur: FeedCursor = mem._feed
    head_of = getattr(mem.store, "feed_head", None)
    try:
        head = head_of() if head_of is not None else None
    except StoreError as exc:  # Redis away (StoreUnavailable), a damaged counter: search what is routed
        if not cur.outage_logged:
            cur.outage_logged = True
            _log.warning("the store's change feed cannot be read (%s); routing with the router as it is", exc)
        return 0
    cur.outage_logged = False
    if head is None:
        return resync(mem, namespace)
    changed = 0
    router = mem.router
    with cur.lock:
        lost = getattr(router, "unsaved_lost", 0)
        if lost != cur.unsaved_lost:  # records applied in memory only were dropped by a reload of the folder
            cur.unsaved_lost, cur.synced = lost, set()
        if head.feed_id != cur.feed_id or head.seq < cur.seq:
            cur.feed_id, cur.seq, cur.synced = head.feed_id, head.seq, set()
        elif head.seq > cur.seq:
            changes = _read(mem.store, cur.seq, head.seq)
            if changes is None:  # trimmed, or too far behind: every namespace is resynced when searched
                cur.seq, cur.synced = head.seq, set()
            elif changes:
                changed += _apply(mem, [c for c in changes if c.namespace in cur.synced])
                cur.seq = changes[-1].seq
        if namespace not in cur.synced:
            # The head was read before this listing: a change made meanwhile is both listed and applied
            # later, and applying is idempotent (the catalogue decides, not the record).
            changed += resync(mem, namespace)
            cur.synced.add(namespace)
    return changed


def _read(store, after: int, head: int):
    """The records after `after` up to at least `head`, or None (trimmed, or more than MAX_CHANGES)."""
    if head - after > MAX_CHANGES:
        return None
    out = []
    while True:
        page = store.changes_since(after, _PAGE)
        if page is None:
            return None
        out += page
        if len(page) < _PAGE or out[-1].seq >= head:
            return out
        after = out[-1].seq


def _apply(mem, changes) -> int:
    """Route or drop the entries these records name, as the catalogue has them now."""
    router = mem.router
    if not changes or not router.writable:
        return 0
    puts, drops = [], []
    for eid, ns in {c.entry_id: c.namespace for c in changes}.items():
        try:
            entry = mem.store.get_entry(eid, ns)
        except UnknownEntry:
            if eid in mem._pending or mem._lost(eid) or mem._set_aside(eid) is not None:
                # routed before its commit (remember_later), lost by damage (recall names it), or set aside
                # by fsck --repair (still routed, so that an answer names it in `refused`)
                continue
            drops.append(eid)
            continue
        except KVMemoryError:  # refused (unsigned or forged in a shared store): never routed
            drops.append(eid)
            continue
        texts = route_texts(entry)
        if router.namespace_of(eid) == entry.namespace and router.texts(eid) == texts:
            continue  # routed already (by this process, or by another sharing the router's folder)
        puts.append((eid, entry.namespace, texts))
    # In memory only: writing the router's folder costs as much as the namespace is large; the next
    # commit of this router writes them, and a restart resyncs whatever was not written.
    return router.apply_unsaved(puts, drops) if (puts or drops) else 0


def resync(mem, namespace: str) -> int:
    """Route the entries of `namespace` the router lacks and drop routes to entries that are gone, by
    listing both (O(entries)). The catalogue is the truth; the router is its index."""
    stored = set(mem.store.entry_ids(namespace))
    routed = {r.entry_id for r in mem.router.rows(namespace)}
    if not mem.router.writable:
        # A read-only store is read, never written: routes to forgotten entries are skipped by recall
        # anyway; entries the router lacks cannot be routed, and the caller is told so.
        unrouted = sorted(stored - routed)
        once = f"{namespace}\x00unrouted"  # its own key: a namespace never holds a NUL
        if unrouted and once not in mem._warned_namespaces:
            mem._warned_namespaces.add(once)
            _log.warning("%d entries of namespace %r are not in the router, whose folder %s is read-only: "
                         "recall cannot find them until `kvmemory reindex` runs where the store is writable",
                         len(unrouted), namespace, mem.router.folder)
        return 0
    gone = routed - stored
    listed = getattr(mem.store, "set_aside_entries", None) if gone else None
    aside = {d.get("id") for d in listed()} if listed is not None else set()
    drops = [eid for eid in gone
             # pending: routed before its KV is committed; lost: recorded but missing from a damaged
             # catalogue (`recall` names it, fsck brings it back); set aside by fsck --repair: still
             # routed, so that an answer names it (refused)
             if eid not in mem._pending and not mem._lost(eid) and eid not in aside]
    puts = []
    for eid in sorted(stored - routed):
        try:
            e = mem.store.get_entry(eid, namespace)
        except KVMemoryError:  # refused (unsigned / forged in a shared store): never routed
            continue
        puts.append((e.id, e.namespace, route_texts(e)))
    n = mem.router.delete_many(drops) if drops else 0
    return n + (mem.router.update_many(puts) if puts else 0)

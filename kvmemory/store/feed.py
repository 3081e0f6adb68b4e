"""The change feed: every entry a store commits or deletes, in order, with a sequence number.

Several processes (or servers on one Redis store) each keep a router over the same catalogue. Listing
the catalogue to find what changed costs as much as the store is large, so a store also keeps a feed:
records `(seq, op, entry_id, namespace)`, `op` being "put" (the entry was committed, or its routed text
changed) or "del" (it was deleted), `seq` increasing by one per record. A record is written in the same
transaction as the change it describes (the local store: SQLite triggers on the entries table, so
every writer, fsck and rebuild included, records its changes; Redis: inside the commit and delete
scripts), so a reader never sees a change without its record or the reverse.

A reader keeps `(feed_id, seq)`: the feed it read and the last record it applied. `feed_head()` is one
cheap read; `changes_since(seq)` returns the newer records, or None when some were trimmed (the feed
keeps the last `FEED_KEEP`): then, and whenever `feed_id` changed (a rebuilt catalogue, a Redis server
that lost its data) or the head went backwards, the reader resyncs from the catalogue in full.
A store without a feed (an old read-only catalogue) answers `feed_head()` with None.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FEED_KEEP", "Change", "FeedHead", "LOCAL_FEED_ID", "LOCAL_FEED_SCHEMA", "local_head", "local_changes"]

# Records kept; a reader further behind than this resyncs from the catalogue (it would anyway: reading
# 100,000 changes costs about what listing the namespace does).
FEED_KEEP = 100_000
OPS = ("put", "del")


@dataclass(slots=True, frozen=True)
class Change:
    """One record of the feed."""

    seq: int
    op: str  # "put" | "del"
    entry_id: str
    namespace: str


@dataclass(slots=True, frozen=True)
class FeedHead:
    """Which feed (a random id, new with every catalogue) and the last sequence number written (0: none)."""

    feed_id: str | None
    seq: int


# The local store's feed (part of its catalogue schema). AUTOINCREMENT never reuses a number and a
# rolled-back transaction takes its numbers back with it, so the numbers are contiguous but for trims.
# The problem, the aliases (in meta_json) and the namespace are what the router reads: an update of the
# attestation alone is not a change to route.
LOCAL_FEED_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS changes(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    op TEXT NOT NULL,
    entry_id TEXT NOT NULL,
    namespace TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS changes_put AFTER INSERT ON entries BEGIN
    INSERT INTO changes(op, entry_id, namespace) VALUES('put', NEW.id, NEW.namespace);
END;
CREATE TRIGGER IF NOT EXISTS changes_edit AFTER UPDATE OF problem, meta_json, namespace ON entries BEGIN
    INSERT INTO changes(op, entry_id, namespace) VALUES('put', NEW.id, NEW.namespace);
END;
CREATE TRIGGER IF NOT EXISTS changes_del AFTER DELETE ON entries BEGIN
    INSERT INTO changes(op, entry_id, namespace) VALUES('del', OLD.id, OLD.namespace);
END;
CREATE TRIGGER IF NOT EXISTS changes_trim AFTER INSERT ON changes WHEN NEW.seq % 1000 = 0 BEGIN
    DELETE FROM changes WHERE seq <= NEW.seq - {FEED_KEEP};
END;
"""


# The feed's id, given when a writable store opens (apart from the schema: a damaged catalogue must still
# open for fsck, and this is a write).
LOCAL_FEED_ID = "INSERT OR IGNORE INTO meta(key, value) VALUES('feed_id', lower(hex(randomblob(16))))"


def local_head(q) -> FeedHead | None:
    """The head of a catalogue's feed (`q`: the store's read query); None when it has none."""
    try:
        rows = q("SELECT (SELECT value FROM meta WHERE key='feed_id'), (SELECT MAX(seq) FROM changes)")
    except Exception as exc:  # noqa: BLE001 - a catalogue made before the feed existed (read-only)
        if "no such table" in str(exc):
            return None
        raise
    feed_id, seq = rows[0]
    return FeedHead(None if feed_id is None else str(feed_id), int(seq or 0))


def local_changes(q, after: int, limit: int) -> list[Change] | None:
    """Records after `after`, oldest first, at most `limit`; None when the one right after it was trimmed."""
    rows = q("SELECT seq, op, entry_id, namespace FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
             (int(after), int(limit)))
    out = [Change(int(s), str(op), str(e), str(ns)) for s, op, e, ns in rows]
    if out and out[0].seq != after + 1:
        return None
    return out


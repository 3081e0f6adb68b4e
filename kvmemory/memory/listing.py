"""Listing and reading entries: the pages of `KVMemory.list`, and the versions of `KVMemory.history`.

Paging is by cursor, not offset: entries are ordered by (created, id), oldest first (the stores'
own order), and a page's `next_cursor` names the last entry it showed, so a page asked for later
starts right after it even when entries were added or forgotten meanwhile (an offset would skip or
repeat). The cursor is opaque text ("c1:" + base64 of the last entry's created time and id).

Versions: `KVMemory.update` keeps what an entry was in its own metadata (`meta["history"]`, a list of
version snapshots, oldest first), so the history is written in the same atomic commit as the new
version, on every store (local, signed, Redis), and travels with the entry in bundles. A snapshot
keeps the texts, answer, verifier outcome, metadata, chain hashes and attestation; not the token ids
or blocks (a version's KV can be recomputed from its texts, and proven again, at any time).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmemory.errors import InvalidInput
from kvmemory.memory.filters import matches
from kvmemory.memory.verifiers import kind_of
from kvmemory.store.local import EntryRecord

# Keys of an entry's meta that kvmemory itself writes: `aliases` (extra routed texts) and `history`
# (earlier versions). User metadata may not set them directly.
HISTORY_KEY = "history"
RESERVED_META = ("aliases", HISTORY_KEY)
MAX_PAGE = 1000
DEFAULT_PAGE = 50


def user_meta(entry: EntryRecord) -> dict:
    """An entry's metadata without the keys kvmemory keeps there (aliases, history)."""
    return {k: v for k, v in entry.meta.items() if k not in RESERVED_META}


def version_of(entry: EntryRecord) -> int:
    """1 for an entry never updated; each `update` adds one."""
    return len(entry.meta.get(HISTORY_KEY) or ()) + 1


def entry_summary(entry: EntryRecord) -> dict:
    """What a listing shows of an entry (JSON): its texts, kind ("solution" or "note": memory/notes.py),
    provenance and user metadata, without the
    token ids, block chain and history (`KVMemory.get` / `history` give those)."""
    return {
        "id": entry.id,
        "namespace": entry.namespace,
        "problem": entry.problem,
        "solution": entry.solution,
        "answer": entry.answer,
        "verified": entry.verified,
        "kind": kind_of(entry),
        "version": version_of(entry),
        "n_tokens": len(entry.token_ids),
        "n_blocks": len(entry.chain),
        "attestation_id": entry.attestation.get("attestation_id"),
        "aliases": list(entry.meta.get("aliases") or ()),
        "meta": user_meta(entry),
        "created": entry.created,
        "updated": entry.updated,
    }


@dataclass(slots=True, frozen=True)
class EntryPage:
    """One page of `KVMemory.list`.

    `entries`: this page's entries, oldest first; `total`: how many entries match the listing's
    namespace and filter in all (every page); `next_cursor`: pass it as `cursor=` for the next page
    (None on the last page); `namespaces`: every namespace of the store with its entry count, so a
    listing of a namespace that holds nothing shows where the entries are."""

    entries: list[EntryRecord]
    total: int
    next_cursor: str | None
    namespace: str | None  # None: every namespace was listed
    namespaces: dict[str, int] = field(default_factory=dict)
    limit: int = DEFAULT_PAGE

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def to_json(self) -> dict:
        return {
            "namespace": self.namespace,
            "total": self.total,
            "limit": self.limit,
            "next_cursor": self.next_cursor,
            "namespaces": dict(self.namespaces),
            "entries": [entry_summary(e) for e in self.entries],
        }


@dataclass(slots=True, frozen=True)
class EntryVersion:
    """One version of an entry (`KVMemory.history`): `version` counts from 1; `replaced` is when an
    update replaced it (None for the current version)."""

    version: int
    problem: str
    solution: str
    answer: str | None
    verified: bool
    meta: dict
    aliases: list[str]
    chain: list[str]
    attestation_id: str | None
    updated: float
    replaced: float | None

    def to_json(self) -> dict:
        return {"version": self.version, "problem": self.problem, "solution": self.solution, "answer": self.answer,
                "verified": self.verified, "meta": self.meta, "aliases": self.aliases, "chain": self.chain,
                "attestation_id": self.attestation_id, "updated": self.updated, "replaced": self.replaced}


def snapshot(entry: EntryRecord, replaced: float) -> dict:
    """What `meta["history"]` keeps of a version that an update replaces (JSON)."""
    return {"version": version_of(entry), "problem": entry.problem, "solution": entry.solution,
            "answer": entry.answer, "verifier": entry.verifier, "verified": entry.verified,
            "meta": user_meta(entry), "aliases": list(entry.meta.get("aliases") or ()),
            "chain": list(entry.chain), "attestation": entry.attestation, "updated": entry.updated,
            "replaced": replaced}


def versions(entry: EntryRecord) -> list[EntryVersion]:
    """Every version of an entry, oldest first, the current one last."""
    out = []
    for s in entry.meta.get(HISTORY_KEY) or ():
        out.append(EntryVersion(version=int(s["version"]), problem=s["problem"], solution=s["solution"],
                                answer=s.get("answer"), verified=bool(s.get("verified")), meta=dict(s.get("meta") or {}),
                                aliases=list(s.get("aliases") or ()), chain=list(s.get("chain") or ()),
                                attestation_id=(s.get("attestation") or {}).get("attestation_id"),
                                updated=float(s.get("updated", 0.0)), replaced=float(s["replaced"])))
    out.append(EntryVersion(version=version_of(entry), problem=entry.problem, solution=entry.solution,
                            answer=entry.answer, verified=entry.verified, meta=user_meta(entry),
                            aliases=list(entry.meta.get("aliases") or ()), chain=list(entry.chain),
                            attestation_id=entry.attestation.get("attestation_id"), updated=entry.updated,
                            replaced=None))
    return out


# ------------------------------------------------------------------ cursors
def encode_cursor(entry: EntryRecord) -> str:
    raw = json.dumps([repr(float(entry.created)), entry.id]).encode()
    return "c1:" + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(created, id) of the last entry a page showed; InvalidInput for anything not made by
    `encode_cursor`."""
    bad = InvalidInput(f"cursor {cursor!r} is not a cursor from a previous page's next_cursor")
    if not isinstance(cursor, str) or not cursor.startswith("c1:"):
        raise bad
    body = cursor[3:]
    try:
        created, eid = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        return float(created), str(eid)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise bad from None


def check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be an integer from 1 to {MAX_PAGE}, got {limit!r}")
    return limit


def page_of(entries: Iterable[EntryRecord], *, where: dict | None, limit: int, cursor: str | None,
            namespace: str | None, namespaces: dict[str, int]) -> EntryPage:
    """The page of `entries` (any order) matching `where` after `cursor`."""
    after = decode_cursor(cursor) if cursor is not None else None
    chosen = sorted((e for e in entries if matches(user_meta(e), where)), key=lambda e: (e.created, e.id))
    start = 0
    if after is not None:
        while start < len(chosen) and (chosen[start].created, chosen[start].id) <= after:
            start += 1
    shown = chosen[start:start + limit]
    more = start + limit < len(chosen)
    return EntryPage(entries=shown, total=len(chosen), next_cursor=encode_cursor(shown[-1]) if more else None,
                     namespace=namespace, namespaces=namespaces, limit=limit)

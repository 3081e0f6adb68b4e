"""Remembering many entries at once (`KVMemory.remember_many`), each item's fate reported.

One item at a time, `remember` pays for each entry: a verifier run and the KV computed and proven (the
model's work), then one catalogue transaction (a record fsynced, the entry's rows, its change-feed
record), then one router write (the problem embedded, the index rewritten and synced). A batch keeps
the model's work per entry and shares the rest:

1. every item is checked and planned first (`KVMemory._plan`: its texts, its verifier's verdict, its
   id); an item refused there (InvalidInput, VerificationFailed, ...) is refused alone;
2. the KV of every planned item is computed and proven back to back (writes.compute_entry: the block
   files are written, the graft is proven bit-identical, nothing is committed yet); an item whose proof
   fails is refused alone;
3. the computed items are committed together: `Store.commit_entries` where the store has it (the local
   and signed stores: one transaction, so one catalogue write and one run of change-feed records),
   else `commit_entry` one after the other (Redis: each entry its own atomic script). A batch commit
   that fails is retried item by item, so one item the store refuses is refused alone;
4. the committed entries are routed together: `Router.update_many` (their problems and aliases
   embedded in one embedder call, one index write).

Steps 2-4 run per slice of at most `MAX_BATCH_BYTES` of KV payload (the computed blocks are held in
memory until their commit), so a long file does not hold every entry's KV at once.

A crash at any point leaves each item either absent (before its slice's commit: its block files are
orphans fsck removes, its record is an uncommitted one fsck tells by its previous hash) or fully
stored (committed: in the catalogue and its change feed, so every router follows it, this process's
own by step 4 or, if it died before that, the next that syncs from the feed).

The same id twice in one batch (the same namespace, texts and profile) is computed once, with the
last occurrence's metadata and aliases (what remembering them one after the other leaves); every
occurrence reports that entry.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmemory.errors import InvalidInput, KVMemoryError
from kvmemory.memory import notes, writes
from kvmemory.store.local import EntryRecord

# What an item may hold (the keyword arguments of `KVMemory.remember`).
ITEM_FIELDS = ("problem", "solution", "answer", "verifier", "namespace", "allow_unverified", "meta", "aliases")
# KV payload bytes computed before a commit (a slice of the batch): ~35 entries of 150 tokens on the
# embedded SmolLM2 (46 KB a token in float32).
MAX_BATCH_BYTES = 256 << 20


@dataclass(slots=True)
class ItemFate:
    """One item of a batch: remembered (`entry`) or refused (`error`, the typed error it raised)."""

    index: int
    status: str = "pending"  # "remembered" | "refused"
    entry: EntryRecord | None = None
    error: KVMemoryError | None = None

    @property
    def ok(self) -> bool:
        return self.status == "remembered"

    def to_json(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "status": self.status}
        if self.entry is not None:
            out.update(id=self.entry.id, namespace=self.entry.namespace)
        if self.error is not None:
            out.update(error=type(self.error).__name__, message=str(self.error))
        return out


def _refuse(fate: ItemFate, exc: KVMemoryError) -> None:
    fate.status, fate.error, fate.entry = "refused", exc, None


def _remembered(fate: ItemFate, entry: EntryRecord) -> None:
    fate.status, fate.entry, fate.error = "remembered", entry, None


def _plan(mem, item: object, defaults: dict) -> dict:
    if not isinstance(item, dict):
        raise InvalidInput(f"an item is an object with {', '.join(ITEM_FIELDS)}, got {type(item).__name__}")
    unknown = sorted(set(item) - set(ITEM_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown field(s) {', '.join(map(repr, unknown))}; an item takes {', '.join(ITEM_FIELDS)}")
    d = {**defaults, **{k: v for k, v in item.items() if v is not None}}
    if d.get("aliases") is not None and not isinstance(d["aliases"], (list, tuple)):
        raise InvalidInput(f"aliases must be a list of strings, got {type(d['aliases']).__name__}")
    if not isinstance(d.get("allow_unverified", False), bool):
        raise InvalidInput(f"allow_unverified must be true or false, got {d['allow_unverified']!r}")
    p = mem._plan(d.get("problem"), d.get("solution"), d.get("answer"), d.get("verifier"), d.get("namespace"),
                  d.get("allow_unverified", False), d.get("meta"), d.get("aliases") or ())
    return {**p, "note": d.get("solution") is None}


def _same_note(mem, p: dict) -> EntryRecord | None:
    """The note already stored as `p` plans it (notes.commit returns it as it is), else None."""
    from kvmemory.errors import UnknownEntry
    from kvmemory.memory.listing import user_meta

    try:
        cur = mem.store.get_entry(p["id"], p["namespace"])
    except UnknownEntry:
        return None
    if (notes.is_note(cur) and (cur.problem, cur.solution, cur.answer) == (p["problem"], p["solution"], None)
            and user_meta(cur) == p["meta"] and list(cur.meta.get("aliases") or ()) == p["aliases"]):
        return cur
    return None


def _commit(mem, done: list[tuple[list[ItemFate], EntryRecord, list]]) -> None:
    """Commit computed entries (one transaction where the store can), then route those committed."""
    if not done:
        return
    store = mem.store
    committed: list[tuple[list[ItemFate], EntryRecord]] = []
    batch = getattr(store, "commit_entries", None)
    together = batch is not None and len(done) > 1
    if together:
        try:
            batch([(e, b) for _, e, b in done])
            committed = [(f, e) for f, e, _ in done]
        except KVMemoryError:
            together = False  # nothing of it was committed: each item alone, so a refusal is its own
    if not together:
        for fates, entry, blocks in done:
            try:
                store.commit_entry(entry, blocks)
                committed.append((fates, entry))
            except KVMemoryError as exc:
                for f in fates:
                    _refuse(f, exc)
    if not committed:
        return
    # Route them together: one embedder call, one index write (a crash before it leaves them committed,
    # and routed by the next sync from the store's change feed).
    mem.router.update_many([(e.id, e.namespace, [e.problem, *e.meta.get("aliases", [])]) for _, e in committed])
    for fates, entry in committed:
        for f in fates:
            _remembered(f, entry)


def remember_many(mem, items: Sequence[dict], *, defaults: dict | None = None, progress: bool = False,
                  max_batch_bytes: int = MAX_BATCH_BYTES) -> list[ItemFate]:
    """What `KVMemory.remember_many` does (the module docstring); one ItemFate per item, in order."""
    from tqdm import tqdm

    defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
    bad = sorted(set(defaults) - set(ITEM_FIELDS))
    if bad:
        raise InvalidInput(f"unknown default(s) {', '.join(map(repr, bad))}; an item takes {', '.join(ITEM_FIELDS)}")
    fates = [ItemFate(i) for i in range(len(items))]
    # 1. plan every item (texts checked, verifier run, id); the last occurrence of an id wins
    plans: dict[str, tuple[dict, list[ItemFate]]] = {}
    for fate, item in zip(fates, items):
        try:
            p = _plan(mem, item, defaults)
        except KVMemoryError as exc:
            _refuse(fate, exc)
            continue
        prev = plans.pop(p["id"], None)
        plans[p["id"]] = (p, (prev[1] if prev else []) + [fate])
    # 2-4. compute back to back; commit and route per slice of MAX_BATCH_BYTES
    done: list[tuple[list[ItemFate], EntryRecord, list]] = []
    held = 0
    todo = list(plans.values())
    for p, its in tqdm(todo, desc="remember", unit="entry", disable=not progress or len(todo) < 2, file=sys.stderr):
        try:
            same = _same_note(mem, p) if p["note"] else None
            if same is not None:
                for f in its:
                    _remembered(f, same)
                continue
            entry, blocks = writes.compute_entry(mem, p)
        except KVMemoryError as exc:
            for f in its:
                _refuse(f, exc)
            continue
        done.append((its, entry, blocks))
        held += sum(m.payload_nbytes for m, _ in blocks)
        if held >= max_batch_bytes:
            _commit(mem, done)
            done, held = [], 0
    _commit(mem, done)
    return fates

"""LangGraph long-term memory backed by kvmemory: `KVMemoryStore` (a `langgraph.store.base.BaseStore`)
and `KVMemoryByteStore` (a `langchain_core.stores.BaseStore` key-value view of one namespace).

Every indexed item is a kvmemory entry in the namespace ".".join(namespace) (LangGraph forbids "." in
labels, so the mapping is one-to-one), with its exact KV computed once and its text routed by the
FAISS router, so `ChatKVGraft(namespace=...)` grafts what the store holds. An item whose value has
"problem" and "solution" strings is remembered as a solution (its verifier runs, and `verified` says
whether it passed); any other JSON value (a fact, a preference: {"text": "Alice has a cat named Tom."})
is remembered as a note (kvmemory/memory/notes.py): the text at its index paths is the statement the
entry holds, its kind is "note", unverified. The value itself is kept exactly in the table below.

`search(query=...)` ranks, as LangGraph's own stores do: the items under the namespace prefix best
first by the router's cosine score, `limit` of them, each at least its calibrated gate (the default,
`threshold="calibrated"`): a note from the notes' measured threshold (0.54 with MiniLM, as `answer`
routes notes: "What pet does Alice have?" finds "Alice has a cat named Tom."), a solution from the
router's (0.83), so an unrelated question finds nothing. `KVMemoryStore(threshold=0.7)` gates both
kinds at 0.7; `threshold=None` ranks every indexed item, as LangGraph's InMemoryStore does.

`search` sees every note of its namespaces, whoever wrote it: a note `KVMemory.add` / `remember` /
`note`, the HTTP API or MCP stored in the kvmemory namespace ".".join(namespace) is an item too (key:
its entry id; value: {"text": the statement, "kind": "note", "entry_id"}), listed and ranked with the
items `put` here (read-only through the store: `get`/`delete` address the items `put` here).

kvmemory entries are addressed by content, LangGraph items by (namespace, key), so a small SQLite
table beside the catalogue (`<store>/langgraph.sqlite`) maps keys to entries and keeps each value's
JSON exactly as it was put.

Writes return at once (`put` takes milliseconds, not the seconds a KV takes): the item's row is
written and its text routed now, so a `get` or `search` right after sees it; its KV is computed by
the memory's writer thread (in order, under the memory's lock: `KVMemory.remember_later`), or by the
first call that routes to it, whichever comes first. `flush()` / `aflush()` wait for every pending
write and raise the first failure. A normal exit finishes them (atexit); a killed process leaves
items whose entry was not committed yet (an entry's commit is atomic: never half an entry), and the
next `KVMemoryStore` over the same folder computes them again from the values kept in the table.
Replacing or deleting an item forgets its old entry in the same order, once no key refers to it.

Items may expire (`put(..., ttl=minutes)`, or `ttl={"default_ttl": ...}` for every item): an expired
item is never returned, and is deleted with its entry by the next write.
"""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from langchain_core.stores import BaseStore as KeyValueStore
from langgraph.store.base import (
    NOT_PROVIDED,
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
    _ensure_refresh,
    get_text_at_path,
    tokenize_path,
)

from kvmemory import (DEFAULT_MODEL, InvalidInput, KVMemory, SharedMemory, borrow_memory, check_where, env_store,
                      is_note, matches, resolve_device, resolve_dtype)

from .errors import InvalidNamespace

_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    ns TEXT NOT NULL,
    key TEXT NOT NULL,
    entry_id TEXT,
    value TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (ns, key)
);
CREATE INDEX IF NOT EXISTS items_entry ON items(entry_id);
"""
# Columns added after the first release (a table made before gets them on open): the put's `index`
# (JSON; NULL = the store's index_fields), to compute an item's entry again after a crash; its TTL
# in minutes and when it expires (NULL: never).
_ADDED = {"index_json": "TEXT", "ttl": "REAL", "expires": "REAL"}


# `KVMemoryStore(threshold=CALIBRATED)`: each kind searched at its calibrated gate (the module docstring)
CALIBRATED = "calibrated"


def kv_namespace(namespace: Sequence[str]) -> str:
    """The kvmemory namespace of a LangGraph namespace tuple."""
    if not namespace or any(not isinstance(p, str) or not p or "." in p or "\0" in p for p in namespace):
        raise InvalidNamespace(f"invalid namespace {tuple(namespace)!r}: non-empty labels without '.' or NUL")
    return ".".join(namespace)


def _now() -> float:
    """The clock of timestamps and TTLs (one function, so tests can move it)."""
    return time.time()


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _check_namespace_arg(namespace: Any, what: str = "namespace") -> tuple[str, ...]:
    """A LangGraph namespace (a tuple of labels), or InvalidNamespace saying what was given."""
    if isinstance(namespace, str) or not isinstance(namespace, (tuple, list)):
        raise InvalidNamespace(f"{what} must be a tuple of strings such as ('users', 'alice'), got {namespace!r}")
    if any(not isinstance(p, str) for p in namespace):
        raise InvalidNamespace(f"{what} labels must be strings, got {tuple(namespace)!r}")
    return tuple(namespace)


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"key must be a non-empty string, got {key!r}")
    return key


def _check_value(value: Any) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"a store value must be a dict of JSON (LangGraph items are documents), got "
                           f"{type(value).__name__}; wrap it: {{'value': ...}} (or delete the item with delete())")
    if any(not isinstance(k, str) for k in value):
        raise InvalidInput(f"a store value's keys must be strings, got {[k for k in value if not isinstance(k, str)]!r}")
    return value


def _check_ttl(ttl: Any) -> float | None:
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) or ttl <= 0:
        raise InvalidInput(f"ttl is in minutes and must be a positive number (or None: never expires), got {ttl!r}")
    return float(ttl)


def _namespace_matches(ns: tuple[str, ...], cond: MatchCondition) -> bool:
    path = tuple(cond.path)
    if len(ns) < len(path):
        return False
    pairs = zip(ns, path) if cond.match_type == "prefix" else zip(reversed(ns), reversed(path))
    return all(p == "*" or a == p for a, p in pairs)


class KVMemoryStore(BaseStore):
    """A LangGraph store whose items are kvmemory entries (see the module docstring).

    ```python
    from langchain_kvmemory import KVMemoryStore

    store = KVMemoryStore(store="./my-store")
    store.put(("solutions",), "eggs", {"problem": "...", "solution": "3 * 12 = 36 ...", "answer": "31"})
    store.search(("solutions",), query="how many eggs are left?", limit=3)
    ```

    `index_fields` are the JSON paths whose text routes a non-solution item (default: the whole value);
    `put(..., index=[...])` overrides them per item and `index=False` stores the item unrouted (found by
    key and by listing, never by a query). `verifier` checks solution items (None: "exact-answer" when
    they carry an answer); with `require_verified=True` a refused solution raises
    `VerificationFailed` instead of being stored unverified.
    """

    supports_ttl = True

    def __init__(self, *, store: str | None = None, model: str = DEFAULT_MODEL, memory: KVMemory | None = None,
                 index_fields: Sequence[str] | None = None, verifier: str | None = None,
                 require_verified: bool = False, threshold: float | str | None = CALIBRATED,
                 ttl: TTLConfig | None = None,
                 device: str = "auto", dtype: str = "auto"):
        """`threshold`: the lowest cosine score `search(query=...)` returns: "calibrated" (default) the
        calibrated one of each kind (notes: the notes' threshold, 0.54 with MiniLM; solutions: the
        router's, 0.83), a number for both kinds, None for none (every indexed item ranked, as
        LangGraph's InMemoryStore does).
        `ttl`: LangGraph's TTLConfig (`default_ttl` minutes for every put, `refresh_on_read`).
        `device` / `dtype`: where and in what `model` runs when the store opens it (as `ChatKVGraft`'s)."""
        self._memory = memory
        self._model = model
        self._device, self._dtype = device, dtype
        if memory is None:  # a device that is not here is refused now, not at the first call
            resolve_dtype(dtype, resolve_device(device, model=model))
        self._store = store or env_store()
        self.index_fields = list(index_fields) if index_fields else ["$"]
        self.verifier = verifier
        self.require_verified = require_verified
        if not (threshold is None or threshold == CALIBRATED or (
                isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold)
                and -1.0 <= threshold <= 1.0)):
            raise InvalidInput(f"threshold must be {CALIBRATED!r}, a cosine score in [-1, 1] or None, got {threshold!r}")
        self.threshold = threshold
        self.ttl_config = ttl
        if ttl is not None:
            _check_ttl(ttl.get("default_ttl"))
        self._db_path: Path | None = None
        self._resumed = False
        self._resume_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def shared(self) -> SharedMemory:
        return borrow_memory(self._memory, self._model, self._store, device=self._device, dtype=self._dtype)

    def _connect(self, memory: KVMemory) -> sqlite3.Connection:
        if self._db_path is None:
            self._db_path = Path(memory.store.path) / "langgraph.sqlite"
        # check_same_thread=False: the memory's writer thread asks the table whether a key still
        # refers to an entry before forgetting it (each call opens and closes its own connection).
        db = sqlite3.connect(self._db_path, timeout=30, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        have = {r[1] for r in db.execute("PRAGMA table_info(items)")}
        for col, kind in _ADDED.items():
            if col not in have:
                try:
                    with db:
                        db.execute(f"ALTER TABLE items ADD COLUMN {col} {kind}")
                except sqlite3.OperationalError:  # another connection added it meanwhile
                    pass
        return db

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        # No memory lock here: nothing below computes a KV (the writer thread does, under the lock),
        # so a put or a search is not kept waiting behind a write in progress.
        ops = list(ops)
        sm = self.shared()
        with closing(self._connect(sm.memory)) as db:
            self._resume(sm, db)
            if any(isinstance(op, PutOp) for op in ops):
                self._sweep(sm, db)
            return [self._apply(sm, db, op) for op in ops]

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        # Disk I/O and the embedder: run it off the event loop.
        return await asyncio.to_thread(self.batch, list(ops))

    def flush(self) -> None:
        """Wait until every pending write of this store's memory has its KV committed (or been
        forgotten), in order; raise the first failure (e.g. `VerificationFailed`) not raised before."""
        self.shared().memory.flush()

    async def aflush(self) -> None:
        await asyncio.to_thread(self.flush)

    # ------------------------------------------------------------------ typed checks before LangGraph's own
    def get(self, namespace, key, *, refresh_ttl=None):  # type: ignore[override]
        return super().get(_check_namespace_arg(namespace), _check_key(key), refresh_ttl=refresh_ttl)

    async def aget(self, namespace, key, *, refresh_ttl=None):  # type: ignore[override]
        return await super().aget(_check_namespace_arg(namespace), _check_key(key), refresh_ttl=refresh_ttl)

    def put(self, namespace, key, value, index=None, *, ttl=NOT_PROVIDED):  # type: ignore[override]
        if ttl is not NOT_PROVIDED:
            _check_ttl(ttl)
        return super().put(_check_namespace_arg(namespace), _check_key(key), _check_value(value), index, ttl=ttl)

    async def aput(self, namespace, key, value, index=None, *, ttl=NOT_PROVIDED):  # type: ignore[override]
        if ttl is not NOT_PROVIDED:
            _check_ttl(ttl)
        return await super().aput(_check_namespace_arg(namespace), _check_key(key), _check_value(value), index,
                                  ttl=ttl)

    def delete(self, namespace, key):  # type: ignore[override]
        return super().delete(_check_namespace_arg(namespace), _check_key(key))

    async def adelete(self, namespace, key):  # type: ignore[override]
        return await super().adelete(_check_namespace_arg(namespace), _check_key(key))

    def search(self, namespace_prefix, /, **kw):  # type: ignore[override]
        return super().search(_check_namespace_arg(namespace_prefix, "namespace_prefix"), **kw)

    async def asearch(self, namespace_prefix, /, **kw):  # type: ignore[override]
        return await super().asearch(_check_namespace_arg(namespace_prefix, "namespace_prefix"), **kw)

    def _apply(self, sm: SharedMemory, db: sqlite3.Connection, op: Op) -> Result:
        if isinstance(op, GetOp):
            return self._get(db, op)
        if isinstance(op, PutOp):
            if op.value is None:
                self._delete(sm, db, op.namespace, op.key)
            else:
                self._put(sm, db, op)
            return None
        if isinstance(op, SearchOp):
            return self._search(sm.memory, db, op)
        if isinstance(op, ListNamespacesOp):
            return self._list_namespaces(db, op)
        raise InvalidInput(f"unknown store operation {type(op).__name__}")

    # ------------------------------------------------------------------ TTL and recovery
    def _refresh(self, db: sqlite3.Connection, op: GetOp | SearchOp, keys: list[tuple[str, str]]) -> None:
        if keys and _ensure_refresh(self.ttl_config, op.refresh_ttl):
            with db:
                db.executemany("UPDATE items SET expires=?+ttl*60 WHERE ns=? AND key=? AND ttl IS NOT NULL",
                               [(_now(), ns, k) for ns, k in keys])

    def _sweep(self, sm: SharedMemory, db: sqlite3.Connection) -> None:
        """Delete expired items, and forget their entries (in order, once no key refers to them)."""
        gone = db.execute("SELECT ns, key FROM items WHERE expires IS NOT NULL AND expires <= ?",
                          (_now(),)).fetchall()
        for ns, key in gone:
            self._delete(sm, db, tuple(ns.split(".")), key)

    def _resume(self, sm: SharedMemory, db: sqlite3.Connection) -> None:
        """Once per store object: items whose entry a killed process never committed are computed
        again (from the value and index the table kept)."""
        with self._resume_lock:
            if self._resumed:
                return
            self._resumed = True
            memory = sm.memory
            pending = set(memory.pending())
            by_ns: dict[str, set[str]] = {}
            for ns, key, entry_id, body, index_json in db.execute(
                    "SELECT ns, key, entry_id, value, index_json FROM items WHERE entry_id IS NOT NULL"):
                if entry_id in pending:
                    continue
                stored = by_ns.get(ns)
                if stored is None:
                    stored = by_ns[ns] = set(memory.store.entry_ids(ns))
                if entry_id in stored:
                    continue
                index = json.loads(index_json) if index_json else None
                job = self._remember(sm, ns, tuple(ns.split(".")), key, json.loads(body), index)
                if job is not None and job.id != entry_id:  # another verifier or index setting today
                    with db:
                        db.execute("UPDATE items SET entry_id=? WHERE ns=? AND key=?", (job.id, ns, key))

    # ------------------------------------------------------------------ operations
    def _get(self, db: sqlite3.Connection, op: GetOp) -> Item | None:
        ns = kv_namespace(op.namespace)
        row = db.execute("SELECT value, created, updated FROM items WHERE ns=? AND key=? "
                         "AND (expires IS NULL OR expires > ?)", (ns, op.key, _now())).fetchone()
        if row is None:
            return None
        self._refresh(db, op, [(ns, op.key)])
        return Item(value=json.loads(row[0]), key=op.key, namespace=tuple(op.namespace),
                    created_at=_ts(row[1]), updated_at=_ts(row[2]))

    def _route_text(self, value: dict, index: list[str] | None) -> str:
        texts: list[str] = []
        for path in index or self.index_fields:
            if path == "$":
                texts.append(json.dumps(value, ensure_ascii=False, sort_keys=True))
            else:
                texts.extend(t for t in get_text_at_path(value, tokenize_path(path)) if t and t.strip())
        return "\n".join(texts)

    def _remember(self, sm: SharedMemory, ns: str, namespace: tuple[str, ...], key: str, value: dict,
                  index: list[str] | None):
        """Route the item now and have its KV computed later (None: nothing of it is routed)."""
        meta = {"langgraph": {"namespace": list(namespace), "key": key}}
        memory = sm.memory
        if isinstance(value.get("problem"), str) and isinstance(value.get("solution"), str):
            answer = value.get("answer")
            job = memory.remember_later(value["problem"], value["solution"], None if answer is None else str(answer),
                                        verifier=self.verifier, namespace=ns, meta=meta,
                                        allow_unverified=not self.require_verified, lock=sm.lock)
        else:
            text = self._route_text(value, index)
            if not text.strip():
                return None
            # A fact or preference: a note (no solution), its statement the indexed text.
            job = memory.remember_later(text, None, namespace=ns, meta=meta, lock=sm.lock)
        job.add_done_callback(self._unindex_failed)
        return job

    def _unindex_failed(self, job) -> None:
        """An item whose KV cannot be computed (longer than the model's context, ...) stays, unindexed
        (found by key and listing, as with index=False), so no later store retries it forever;
        `flush()` raises why."""
        if job.error is None:
            return
        with closing(sqlite3.connect(self._db_path, timeout=30)) as db, db:
            db.execute("UPDATE items SET entry_id=NULL WHERE entry_id=?", (job.id,))

    def _put(self, sm: SharedMemory, db: sqlite3.Connection, op: PutOp) -> None:
        ns = kv_namespace(op.namespace)
        value = _check_value(op.value)
        try:
            body = json.dumps(value, ensure_ascii=False, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"a store value must be JSON (strings, numbers, booleans, lists, dicts): {exc}") from None
        ttl = _check_ttl(op.ttl)
        entry_id = None
        if op.index is not False:
            job = self._remember(sm, ns, tuple(op.namespace), op.key, value, op.index)
            entry_id = job.id if job is not None else None
        now = _now()
        old = db.execute("SELECT entry_id, created FROM items WHERE ns=? AND key=?", (ns, op.key)).fetchone()
        with db:
            db.execute("INSERT OR REPLACE INTO items(ns, key, entry_id, value, created, updated, index_json, ttl, "
                       "expires) VALUES(?,?,?,?,?,?,?,?,?)",
                       (ns, op.key, entry_id, body, old[1] if old else now, now,
                        None if op.index in (None, False) else json.dumps(list(op.index)), ttl,
                        None if ttl is None else now + ttl * 60))
        if old and old[0] and old[0] != entry_id:
            self._release(sm, old[0], ns)

    def _referenced(self, entry_id: str) -> bool:
        """Whether some key refers to `entry_id` (asked by the writer thread when it runs a release)."""
        with closing(sqlite3.connect(self._db_path, timeout=30)) as db:
            return db.execute("SELECT 1 FROM items WHERE entry_id=? LIMIT 1", (entry_id,)).fetchone() is not None

    def _release(self, sm: SharedMemory, entry_id: str, ns: str) -> None:
        """Forget an entry once no key refers to it any more, in order after the writes before it
        (asked when it runs: a key put again meanwhile keeps it)."""
        sm.memory.forget_later(entry_id, ns, lock=sm.lock, unless=lambda: self._referenced(entry_id))

    def _delete(self, sm: SharedMemory, db: sqlite3.Connection, namespace: tuple[str, ...], key: str) -> None:
        ns = kv_namespace(namespace)
        row = db.execute("SELECT entry_id FROM items WHERE ns=? AND key=?", (ns, key)).fetchone()
        if row is None:
            return
        with db:
            db.execute("DELETE FROM items WHERE ns=? AND key=?", (ns, key))
        if row[0]:
            self._release(sm, row[0], ns)

    def _namespaces(self, db: sqlite3.Connection) -> list[str]:
        return [r[0] for r in db.execute("SELECT DISTINCT ns FROM items WHERE expires IS NULL OR expires > ? "
                                         "ORDER BY ns", (_now(),))]

    def _rows(self, db: sqlite3.Connection, prefix: tuple[str, ...]) -> Iterator[tuple]:
        live = "(expires IS NULL OR expires > ?)"
        if prefix:
            p = kv_namespace(prefix)
            yield from db.execute("SELECT ns, key, entry_id, value, created, updated FROM items "
                                  f"WHERE (ns=? OR substr(ns, 1, ?)=?) AND {live} ORDER BY updated DESC, ns, key",
                                  (p, len(p) + 1, p + ".", _now()))
        else:
            yield from db.execute("SELECT ns, key, entry_id, value, created, updated FROM items "
                                  f"WHERE {live} ORDER BY updated DESC, ns, key", (_now(),))

    def _outside_notes(self, memory: KVMemory, prefix: tuple[str, ...], tabled: set[tuple[str, str]]) -> list[tuple]:
        """The notes of the kvmemory namespaces under `prefix` that no item of this table is: written by
        `KVMemory.add` / `remember` / `note`, the HTTP API or MCP. Each as a row (ns, key, entry_id,
        value, created, updated): key = the entry id, value = {"text", "kind", "entry_id"}. Entries this
        store wrote (meta "langgraph") and no longer holds are being forgotten: never listed."""
        p = kv_namespace(prefix) if prefix else None
        out = []
        for ns in memory.namespaces():
            if p is not None and ns != p and not ns.startswith(p + "."):
                continue
            if any(not part for part in ns.split(".")):
                continue  # not a LangGraph namespace (an empty label)
            for e in memory.store.list_entries(ns):
                if (ns, e.id) in tabled or not is_note(e) or "langgraph" in (e.meta or {}):
                    continue
                out.append((ns, e.id, e.id, {"text": e.problem, "kind": "note", "entry_id": e.id},
                            float(e.created), float(e.updated)))
        return out

    def _gates(self, memory: KVMemory) -> tuple[float, float]:
        """(note gate, solution gate) of a ranked search: the store's threshold for both when one was
        given (None: -1.0, every indexed item ranked), else the calibrated ones (module docstring)."""
        if isinstance(self.threshold, str):
            return memory.note_threshold, float(memory.threshold if memory.threshold is not None
                                                else memory.router.threshold)
        th = -1.0 if self.threshold is None else float(self.threshold)
        return th, th

    def _search(self, memory: KVMemory, db: sqlite3.Connection, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        rows = [r for r in self._rows(db, prefix)]
        # entries an item of the table is (live or expired and not swept yet): never outside notes
        tabled = {(ns, eid) for ns, eid in db.execute("SELECT ns, entry_id FROM items WHERE entry_id IS NOT NULL")}
        outside = self._outside_notes(memory, prefix, tabled)
        where = check_where(op.filter, "filter") if op.filter else None
        items = []
        for ns, key, entry_id, body, created, updated in rows:
            value = json.loads(body)
            if where and not matches(value, where):
                continue
            items.append((ns, key, entry_id, value, created, updated))
        items.extend(it for it in outside if not where or matches(it[3], where))
        items.sort(key=lambda it: (-it[5], it[0], it[1]))
        if not op.query:
            page = items[op.offset: op.offset + op.limit]
            self._refresh(db, op, [(it[0], it[1]) for it in page])
            return [SearchItem(namespace=tuple(ns.split(".")), key=key, value=value, created_at=_ts(c),
                               updated_at=_ts(u)) for ns, key, _, value, c, u in page]
        by_entry: dict[tuple[str, str], list[tuple]] = {}
        for it in items:
            if it[2]:
                by_entry.setdefault((it[0], it[2]), []).append(it)
        scored: list[tuple[float, tuple]] = []
        # Ranked, as LangGraph's stores rank: the indexed items of the prefix scoring at least the gate,
        # best first. The gate (module docstring): the calibrated one of each kind by default (notes from
        # the notes' threshold, solutions from the router's), the store's threshold when one was given.
        note_gate, solution_gate = self._gates(memory)
        spaces = sorted({it[0] for it in items if it[2]})
        for ns in spaces:
            memory.sync_router(ns)  # notes another process wrote
            memory.route_pending(ns)  # items put moments ago: embedded now, with the query
        counts = memory.namespaces()
        for ns in spaces:
            n = sum(1 for it in items if it[0] == ns and it[2]) + counts.get(ns, 0)
            for hit in memory.router.search(op.query, k=max(1, n), namespace=ns, threshold=min(note_gate, solution_gate)):
                for it in by_entry.get((ns, hit.entry_id), []):
                    solution = isinstance(it[3].get("problem"), str) and isinstance(it[3].get("solution"), str)
                    if float(hit.score) >= (solution_gate if solution else note_gate):
                        scored.append((float(hit.score), it))
        scored.sort(key=lambda x: -x[0])
        # Items stored without routing (index=False) have no score: they fill the page after every
        # scored one, as in LangGraph's own stores. Indexed items below the gate are left out.
        unscored = [(None, it) for it in items if not it[2]]
        ranked: list[tuple[float | None, tuple]] = [*scored, *unscored]
        page = ranked[op.offset: op.offset + op.limit]
        self._refresh(db, op, [(it[0], it[1]) for _, it in page])
        return [SearchItem(namespace=tuple(it[0].split(".")), key=it[1], value=it[3], created_at=_ts(it[4]),
                           updated_at=_ts(it[5]), score=s) for s, it in page]

    def _list_namespaces(self, db: sqlite3.Connection, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        found: set[tuple[str, ...]] = set()
        for ns in self._namespaces(db):
            parts = tuple(ns.split("."))
            if all(_namespace_matches(parts, c) for c in op.match_conditions or ()):
                found.add(parts[: op.max_depth] if op.max_depth is not None else parts)
        return sorted(found)[op.offset: op.offset + op.limit]

    def entry_id(self, namespace: tuple[str, ...], key: str) -> str | None:
        """The kvmemory entry an item is (None when it was stored with index=False); its KV may still
        be pending (`flush()` waits for it)."""
        sm = self.shared()
        with closing(self._connect(sm.memory)) as db:
            row = db.execute("SELECT entry_id FROM items WHERE ns=? AND key=?", (kv_namespace(namespace), key)).fetchone()
        return row[0] if row else None


class KVMemoryByteStore(KeyValueStore[str, Any]):
    """LangChain's key-value `BaseStore` over one namespace of a `KVMemoryStore`: each JSON value is
    kept as the item {"value": value} (routed by its text unless `index=False`)."""

    def __init__(self, store: KVMemoryStore | None = None, *, namespace: Sequence[str] = ("kv",), index: bool = True,
                 **store_kwargs: Any):
        self.store = store or KVMemoryStore(**store_kwargs)
        self.namespace = tuple(namespace)
        kv_namespace(self.namespace)
        self.index = index

    def mget(self, keys: Sequence[str]) -> list[Any | None]:
        items = self.store.batch([GetOp(self.namespace, k) for k in keys])
        return [None if it is None else it.value.get("value") for it in items]

    def mset(self, key_value_pairs: Sequence[tuple[str, Any]]) -> None:
        idx = None if self.index else False
        self.store.batch([PutOp(self.namespace, k, {"value": v}, index=idx) for k, v in key_value_pairs])

    def mdelete(self, keys: Sequence[str]) -> None:
        self.store.batch([PutOp(self.namespace, k, None) for k in keys])

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        sm = self.store.shared()
        with closing(self.store._connect(sm.memory)) as db:
            keys = [r[0] for r in db.execute("SELECT key FROM items WHERE ns=? AND (expires IS NULL OR expires > ?) "
                                             "ORDER BY key", (kv_namespace(self.namespace), _now()))]
        yield from (k for k in keys if prefix is None or k.startswith(prefix))

    async def amget(self, keys: Sequence[str]) -> list[Any | None]:
        return await asyncio.to_thread(self.mget, keys)

    async def amset(self, key_value_pairs: Sequence[tuple[str, Any]]) -> None:
        await asyncio.to_thread(self.mset, key_value_pairs)

    async def amdelete(self, keys: Sequence[str]) -> None:
        await asyncio.to_thread(self.mdelete, keys)

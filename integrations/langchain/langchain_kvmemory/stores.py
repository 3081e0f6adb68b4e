"""LangGraph long-term memory backed by kvmemory: `KVMemoryStore` (a `langgraph.store.base.BaseStore`)
and `KVMemoryByteStore` (a `langchain_core.stores.BaseStore` key-value view of one namespace).

Every indexed item is a kvmemory entry in the namespace ".".join(namespace) (LangGraph forbids "." in
labels, so the mapping is one-to-one), with its exact KV computed once and its text routed by the
FAISS router, so `ChatKVGraft(namespace=...)` grafts what the store holds. An item whose value has
"problem" and "solution" strings is remembered as a solution (its verifier runs, and `verified` says
whether it passed); any other JSON value is remembered with the text at its index paths as the
problem and the value's canonical JSON as the solution, unverified.

kvmemory entries are addressed by content, LangGraph items by (namespace, key), so a small SQLite
table beside the catalogue (`<store>/langgraph.sqlite`) maps keys to entries and keeps each value's
JSON exactly as it was put. It is written after the entry is committed and before an entry is
forgotten, so a crash leaves at most an orphan entry, never a key that points nowhere.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from langchain_core.stores import BaseStore as KeyValueStore
from langgraph.store.base import (
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
    get_text_at_path,
    tokenize_path,
)

from kvmemory import DEFAULT_MODEL, KVMemory, SharedMemory, UnknownEntry, borrow_memory, env_store

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


def kv_namespace(namespace: Sequence[str]) -> str:
    """The kvmemory namespace of a LangGraph namespace tuple."""
    if not namespace or any(not isinstance(p, str) or not p or "." in p or "\0" in p for p in namespace):
        raise InvalidNamespace(f"invalid namespace {tuple(namespace)!r}: non-empty labels without '.' or NUL")
    return ".".join(namespace)


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, tz=timezone.utc)


def _matches(value: Any, wanted: Any) -> bool:
    """LangGraph's filter semantics: equality, nested objects, and $eq/$ne/$gt/$gte/$lt/$lte."""
    if isinstance(wanted, dict):
        if any(k.startswith("$") for k in wanted):
            return all(_operator(value, op, arg) for op, arg in wanted.items())
        return isinstance(value, dict) and all(_matches(value.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, (list, tuple)):
        return isinstance(value, (list, tuple)) and len(value) == len(wanted) and all(
            _matches(a, b) for a, b in zip(value, wanted))
    return value == wanted


def _operator(value: Any, op: str, arg: Any) -> bool:
    if op == "$eq":
        return value == arg
    if op == "$ne":
        return value != arg
    if value is None:
        return False
    if op == "$gt":
        return float(value) > float(arg)
    if op == "$gte":
        return float(value) >= float(arg)
    if op == "$lt":
        return float(value) < float(arg)
    if op == "$lte":
        return float(value) <= float(arg)
    raise ValueError(f"unsupported filter operator {op!r}")


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

    supports_ttl = False

    def __init__(self, *, store: str | None = None, model: str = DEFAULT_MODEL, memory: KVMemory | None = None,
                 index_fields: Sequence[str] | None = None, verifier: str | None = None,
                 require_verified: bool = False):
        self._memory = memory
        self._model = model
        self._store = store or env_store()
        self.index_fields = list(index_fields) if index_fields else ["$"]
        self.verifier = verifier
        self.require_verified = require_verified
        self._db_path: Path | None = None

    # ------------------------------------------------------------------ plumbing
    def shared(self) -> SharedMemory:
        return borrow_memory(self._memory, self._model, self._store)

    def _connect(self, memory: KVMemory) -> sqlite3.Connection:
        if self._db_path is None:
            self._db_path = Path(memory.store.path) / "langgraph.sqlite"
        db = sqlite3.connect(self._db_path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        return db

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        sm = self.shared()
        with sm.lock, closing(self._connect(sm.memory)) as db:
            return [self._apply(sm.memory, db, op) for op in ops]

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        # The work is model compute and disk I/O: run it off the event loop.
        return await asyncio.to_thread(self.batch, list(ops))

    def _apply(self, memory: KVMemory, db: sqlite3.Connection, op: Op) -> Result:
        if isinstance(op, GetOp):
            return self._get(db, op)
        if isinstance(op, PutOp):
            if op.value is None:
                self._delete(memory, db, op.namespace, op.key)
            else:
                self._put(memory, db, op)
            return None
        if isinstance(op, SearchOp):
            return self._search(memory, db, op)
        if isinstance(op, ListNamespacesOp):
            return self._list_namespaces(db, op)
        raise ValueError(f"unknown store operation {type(op).__name__}")

    # ------------------------------------------------------------------ operations
    def _get(self, db: sqlite3.Connection, op: GetOp) -> Item | None:
        ns = kv_namespace(op.namespace)
        row = db.execute("SELECT value, created, updated FROM items WHERE ns=? AND key=?", (ns, op.key)).fetchone()
        if row is None:
            return None
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

    def _put(self, memory: KVMemory, db: sqlite3.Connection, op: PutOp) -> None:
        ns = kv_namespace(op.namespace)
        value = dict(op.value)
        body = json.dumps(value, ensure_ascii=False, sort_keys=True)  # refuses what is not JSON
        entry_id = None
        if op.index is not False:
            meta = {"langgraph": {"namespace": list(op.namespace), "key": op.key}}
            if isinstance(value.get("problem"), str) and isinstance(value.get("solution"), str):
                answer = value.get("answer")
                entry = memory.remember(value["problem"], value["solution"], None if answer is None else str(answer),
                                        verifier=self.verifier, namespace=ns, meta=meta,
                                        allow_unverified=not self.require_verified)
                entry_id = entry.id
            else:
                text = self._route_text(value, op.index)
                if text.strip():
                    entry = memory.remember(text, body, None, verifier="none", namespace=ns, meta=meta,
                                            allow_unverified=True)
                    entry_id = entry.id
        now = time.time()
        old = db.execute("SELECT entry_id, created FROM items WHERE ns=? AND key=?", (ns, op.key)).fetchone()
        with db:
            db.execute("INSERT OR REPLACE INTO items(ns, key, entry_id, value, created, updated) VALUES(?,?,?,?,?,?)",
                       (ns, op.key, entry_id, body, old[1] if old else now, now))
        if old and old[0] and old[0] != entry_id:
            self._release(memory, db, old[0], ns)

    def _release(self, memory: KVMemory, db: sqlite3.Connection, entry_id: str, ns: str) -> None:
        """Forget an entry once no key refers to it any more."""
        if db.execute("SELECT 1 FROM items WHERE entry_id=? LIMIT 1", (entry_id,)).fetchone() is None:
            try:
                memory.forget(entry_id, ns)
            except UnknownEntry:
                pass

    def _delete(self, memory: KVMemory, db: sqlite3.Connection, namespace: tuple[str, ...], key: str) -> None:
        ns = kv_namespace(namespace)
        row = db.execute("SELECT entry_id FROM items WHERE ns=? AND key=?", (ns, key)).fetchone()
        if row is None:
            return
        with db:
            db.execute("DELETE FROM items WHERE ns=? AND key=?", (ns, key))
        if row[0]:
            self._release(memory, db, row[0], ns)

    def _namespaces(self, db: sqlite3.Connection) -> list[str]:
        return [r[0] for r in db.execute("SELECT DISTINCT ns FROM items ORDER BY ns")]

    def _rows(self, db: sqlite3.Connection, prefix: tuple[str, ...]) -> Iterator[tuple]:
        if prefix:
            p = kv_namespace(prefix)
            yield from db.execute("SELECT ns, key, entry_id, value, created, updated FROM items "
                                  "WHERE ns=? OR substr(ns, 1, ?)=? ORDER BY updated DESC, ns, key",
                                  (p, len(p) + 1, p + "."))
        else:
            yield from db.execute("SELECT ns, key, entry_id, value, created, updated FROM items "
                                  "ORDER BY updated DESC, ns, key")

    def _search(self, memory: KVMemory, db: sqlite3.Connection, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        rows = [r for r in self._rows(db, prefix)]
        items = []
        for ns, key, entry_id, body, created, updated in rows:
            value = json.loads(body)
            if op.filter and not all(_matches(value.get(k), v) for k, v in op.filter.items()):
                continue
            items.append((ns, key, entry_id, value, created, updated))
        if not op.query:
            return [SearchItem(namespace=tuple(ns.split(".")), key=key, value=value, created_at=_ts(c),
                               updated_at=_ts(u)) for ns, key, _, value, c, u in items[op.offset: op.offset + op.limit]]
        by_entry: dict[tuple[str, str], list[tuple]] = {}
        for it in items:
            if it[2]:
                by_entry.setdefault((it[0], it[2]), []).append(it)
        scored: list[tuple[float, tuple]] = []
        for ns in sorted({it[0] for it in items if it[2]}):
            n = sum(1 for it in items if it[0] == ns and it[2])
            # threshold -1.0: LangGraph's search ranks every indexed item; it does not drop far ones.
            for hit in memory.router.search(op.query, k=max(1, n), namespace=ns, threshold=-1.0):
                for it in by_entry.get((ns, hit.entry_id), []):
                    scored.append((float(hit.score), it))
        scored.sort(key=lambda x: -x[0])
        seen = {(it[0], it[1]) for _, it in scored}
        # Items stored without routing (index=False) come after every scored one, as in LangGraph's stores.
        ranked: list[tuple[float | None, tuple]] = [*scored, *[(None, it) for it in items if (it[0], it[1]) not in seen]]
        return [SearchItem(namespace=tuple(it[0].split(".")), key=it[1], value=it[3], created_at=_ts(it[4]),
                           updated_at=_ts(it[5]), score=s) for s, it in ranked[op.offset: op.offset + op.limit]]

    def _list_namespaces(self, db: sqlite3.Connection, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        found: set[tuple[str, ...]] = set()
        for ns in self._namespaces(db):
            parts = tuple(ns.split("."))
            if all(_namespace_matches(parts, c) for c in op.match_conditions or ()):
                found.add(parts[: op.max_depth] if op.max_depth is not None else parts)
        return sorted(found)[op.offset: op.offset + op.limit]

    def entry_id(self, namespace: tuple[str, ...], key: str) -> str | None:
        """The kvmemory entry an item is (None when it was stored with index=False)."""
        sm = self.shared()
        with sm.lock, closing(self._connect(sm.memory)) as db:
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
        with sm.lock, closing(self.store._connect(sm.memory)) as db:
            keys = [r[0] for r in db.execute("SELECT key FROM items WHERE ns=? ORDER BY key",
                                             (kv_namespace(self.namespace),))]
        yield from (k for k in keys if prefix is None or k.startswith(prefix))

    async def amget(self, keys: Sequence[str]) -> list[Any | None]:
        return await asyncio.to_thread(self.mget, keys)

    async def amset(self, key_value_pairs: Sequence[tuple[str, Any]]) -> None:
        await asyncio.to_thread(self.mset, key_value_pairs)

    async def amdelete(self, keys: Sequence[str]) -> None:
        await asyncio.to_thread(self.mdelete, keys)

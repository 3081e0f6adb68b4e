"""The memory operations the HTTP memory API, the MCP tools and the CLI's get / update / history share
(one API everywhere: the same `KVMemory` calls, the same fields, the same JSON), each confined to one
namespace (the CLI may pass None: any namespace, as `KVMemory.get` looks).

Every function runs on the compute worker (it reads or writes the model or the store) and takes the
namespace the caller's key was checked for (auth.py); nothing here reads outside it: an entry id
from another namespace raises `UnknownEntry` (404), and lists, stats and verify see the namespace's
entries only. `private` (a tenant key) makes that 404 the very one an id that exists nowhere gets,
naming nothing of other namespaces (tenancy.py); without it (an admin key, or a server without keys)
the message says where the id is. Results are plain JSON-ready dicts.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmemory.engine.runner import Sampling
from kvmemory.errors import InvalidInput, KVMemoryError, UnknownEntry
from kvmemory.memory.facade import KEEP, KVMemory
from kvmemory.memory.filters import check_where, matches
from kvmemory.memory.listing import user_meta, version_of, versions
from kvmemory.memory.verifiers import kind_of
from kvmemory.server.auth import scope_of_namespace
from kvmemory.server.tenancy import entry_in_scope
from kvmemory.store.local import EntryRecord

MAX_VERIFY = 32  # entries one verify call recomputes (each is a full recompute from scratch)


def entry_json(e: EntryRecord, *, full: bool = True) -> dict:
    meta = user_meta(e)
    aliases = list(e.meta.get("aliases") or ())
    att = e.attestation or {}
    out = {
        "id": e.id, "namespace": e.namespace, "scope": scope_of_namespace(e.namespace),
        "problem": e.problem, "answer": e.answer, "verified": e.verified, "kind": kind_of(e), "metadata": meta,
        "attestation_id": att.get("attestation_id"), "version": version_of(e), "created": e.created,
        "updated": e.updated,
    }
    if full:
        out.update(solution=e.solution, aliases=aliases, verifier=e.verifier, n_tokens=len(e.token_ids),
                   blocks=len(e.chain), profile_id=e.profile_id,
                   attestation={k: att.get(k) for k in ("attestation_id", "bit_identical", "graft_point",
                                                        "logits_sha256", "kl_max", "argmax_agreement")})
    return out


def remember(mem: KVMemory, namespace: str, *, problem: str, solution: str | None, answer: str | None = None,
             verifier: str | None = None, allow_unverified: bool = False, metadata: dict | None = None,
             aliases: Sequence[str] = ()) -> dict:
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidInput("metadata must be an object")
    if metadata and "aliases" in metadata:
        raise InvalidInput("metadata may not use the key 'aliases' (give aliases on their own)")
    e = mem.remember(problem, solution, answer, verifier=verifier, namespace=namespace,
                     allow_unverified=allow_unverified, meta=metadata, aliases=list(aliases))
    return {**entry_json(e), "bit_identical": bool(e.attestation.get("bit_identical"))}


MAX_BATCH = 256  # items one batch remember takes (each is a full KV computation and proof)
ITEM_FIELDS = ("problem", "solution", "answer", "verifier", "allow_unverified", "metadata", "aliases")


def remember_many(mem: KVMemory, namespace: str, items: Sequence[dict]) -> dict:
    """`remember` of several items in one batch (KVMemory.remember_many: embeddings in one call, the KV
    computed back to back, one commit), all in `namespace`. Each item is a dict of `remember`'s fields
    (problem, solution, answer, verifier, allow_unverified, metadata, aliases). Every item's fate, in
    order: {"index", "status": "remembered", ...the entry as `remember` returns it} or {"index", "status":
    "refused", "error": {"message", "type", "code"}, "http_status"} (what the item alone would have got)."""
    from kvmemory.server.errors import from_kvmemory

    if len(items) > MAX_BATCH:
        raise InvalidInput(f"{len(items)} items; one call remembers at most {MAX_BATCH}")
    results: list[dict | None] = [None] * len(items)
    todo, where = [], []
    for i, it in enumerate(items):
        try:
            if not isinstance(it, dict):
                raise InvalidInput(f"an item is an object with {', '.join(ITEM_FIELDS)}")
            unknown = sorted(set(it) - set(ITEM_FIELDS))
            if unknown:
                raise InvalidInput(f"unknown field(s) {', '.join(map(repr, unknown))}; an item takes "
                                   f"{', '.join(ITEM_FIELDS)}")
            metadata = it.get("metadata")
            if metadata is not None and not isinstance(metadata, dict):
                raise InvalidInput("metadata must be an object")
            if metadata and "aliases" in metadata:
                raise InvalidInput("metadata may not use the key 'aliases' (give aliases on their own)")
        except InvalidInput as exc:
            results[i] = _refused(i, from_kvmemory(exc))
            continue
        answer = it.get("answer")
        todo.append({"problem": it.get("problem"), "solution": it.get("solution"),
                     "answer": None if answer is None else str(answer), "verifier": it.get("verifier"),
                     "allow_unverified": it.get("allow_unverified", False), "meta": metadata,
                     "aliases": it.get("aliases") or []})
        where.append(i)
    fates = mem.remember_many(todo, namespace=namespace) if todo else []
    for i, fate in zip(where, fates):
        if fate.ok:
            e = fate.entry
            results[i] = {"index": i, "status": "remembered", **entry_json(e),
                          "bit_identical": bool(e.attestation.get("bit_identical"))}
        else:
            results[i] = _refused(i, from_kvmemory(fate.error))
    done = sum(r["status"] == "remembered" for r in results)
    return {"namespace": namespace, "results": results,
            "counts": {"items": len(items), "remembered": done, "refused": len(items) - done}}


def _refused(i: int, err) -> dict:
    return {"index": i, "status": "refused", "http_status": err.status, **err.body()}


def recall(mem: KVMemory, namespace: str, *, query: str, k: int = 5, threshold: float | None = None,
           where: dict | None = None) -> dict:
    hits = mem.recall(query, k, namespace=namespace, threshold=threshold, where=where)
    return {"namespace": namespace, "query": query,
            "results": [{**entry_json(h.entry), "score": round(h.score, 4), "matched_text": h.matched_text}
                        for h in hits]}


def answer(mem: KVMemory, namespace: str, *, query: str, k: int = 1, max_tokens: int = 64,
           answer_prefix: str | None = None, choices: str | list[str] | None = None, memory: bool = True,
           sampling: Sampling | None = None, threshold: float | None = None,
           where: dict | None = None, prior: float | None = None) -> tuple[dict, Any]:
    kw = {"sampling": sampling} if sampling is not None else {}
    if prior is not None:
        kw["prior"] = prior
    ans = mem.answer(query, k=k, namespace=namespace, threshold=threshold, max_new_tokens=max_tokens,
                     answer_prefix=answer_prefix, choices=choices, use_memory=memory, where=where, **kw)
    return {"namespace": namespace, **ans.to_json()}, ans


def _lookup(mem: KVMemory, namespace: str | None, entry_id: str, private: bool) -> EntryRecord:
    """The entry in `namespace` (the server's calls: always one); None (the CLI without --namespace):
    in any namespace, as `KVMemory.get` looks."""
    if namespace is None:
        return mem.get(entry_id, None)
    return entry_in_scope(mem, namespace, entry_id, private=private)


def get(mem: KVMemory, namespace: str | None, entry_id: str, *, private: bool = False) -> dict:
    return entry_json(_lookup(mem, namespace, entry_id, private))


# What an update may change (KVMemory.update's arguments; `metadata` is its `meta`).
UPDATE_FIELDS = ("problem", "solution", "answer", "metadata", "aliases", "verifier", "allow_unverified")


def update(mem: KVMemory, namespace: str | None, entry_id: str, *, private: bool = False, **changes: Any) -> dict:
    """`KVMemory.update` of an entry of the namespace: `changes` are the fields given (UPDATE_FIELDS;
    `answer=None` removes the answer, a metadata key set to None is removed). The entry as `get`
    shows it, in its new version."""
    unknown = sorted(set(changes) - set(UPDATE_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown field(s) {', '.join(map(repr, unknown))}; an update takes "
                           f"{', '.join(UPDATE_FIELDS)}")
    if not {"problem", "solution", "answer", "metadata", "aliases"} & set(changes):
        raise InvalidInput("nothing to update: give problem, solution, answer, metadata or aliases")
    meta = changes.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise InvalidInput("metadata must be an object (a key set to null is removed)")
    cur = _lookup(mem, namespace, entry_id, private)
    answer = changes["answer"] if "answer" in changes else KEEP
    if answer is not None and answer is not KEEP:
        answer = str(answer)
    new = mem.update(cur.id, problem=changes.get("problem"), solution=changes.get("solution"), answer=answer,
                     meta=meta, aliases=changes.get("aliases"), verifier=changes.get("verifier"),
                     allow_unverified=changes.get("allow_unverified"), namespace=cur.namespace)
    return entry_json(new)


def history(mem: KVMemory, namespace: str | None, entry_id: str, *, private: bool = False) -> dict:
    """Every version of an entry, oldest first (`KVMemory.history`: EntryVersion.to_json each)."""
    cur = _lookup(mem, namespace, entry_id, private)
    return {"id": cur.id, "namespace": cur.namespace, "versions": [v.to_json() for v in versions(cur)]}


def list_entries(mem: KVMemory, namespace: str, *, limit: int, offset: int = 0, verified: bool | None = None,
                 metadata: dict | None = None) -> dict:
    """A page of the namespace's entries, oldest first; `metadata`: a filter on their metadata, as
    `where` (memory/filters.py: equality, or operators such as {"n": {"$gte": 3}})."""
    where = check_where(metadata, "metadata")
    entries = sorted(mem.store.list_entries(namespace), key=lambda e: (e.created, e.id))
    if verified is not None:
        entries = [e for e in entries if e.verified == verified]
    if where:
        entries = [e for e in entries if matches(user_meta(e), where)]
    page = entries[offset: offset + limit]
    nxt = offset + limit if offset + limit < len(entries) else None
    return {"namespace": namespace, "total": len(entries), "offset": offset, "next_offset": nxt,
            "data": [entry_json(e, full=False) for e in page]}


def forget(mem: KVMemory, namespace: str, *, entry_ids: Sequence[str] = (), all_entries: bool = False,
           private: bool = False) -> dict:
    if all_entries == bool(entry_ids):
        raise InvalidInput("give entry_ids, or all: true to forget every entry of the scope (not both)")
    if all_entries:
        n = len(mem.store.entry_ids(namespace))
        return {"namespace": namespace, "forgotten": n, "blocks_removed": mem.forget_namespace(namespace)}
    for eid in entry_ids:  # every id checked in the namespace before anything is removed
        entry_in_scope(mem, namespace, eid, private=private)
    removed = sum(mem.forget(eid, namespace) for eid in dict.fromkeys(entry_ids))
    return {"namespace": namespace, "forgotten": len(set(entry_ids)), "blocks_removed": removed}


def verify(mem: KVMemory, namespace: str, *, entry_ids: Sequence[str] | None = None, private: bool = False) -> dict:
    ids = list(dict.fromkeys(entry_ids)) if entry_ids else mem.store.entry_ids(namespace)
    if len(ids) > MAX_VERIFY:
        raise InvalidInput(f"verify recomputes every entry from scratch: at most {MAX_VERIFY} per call "
                           f"({len(ids)} asked); pass entry_ids in pages")
    for eid in ids:
        entry_in_scope(mem, namespace, eid, private=private)
    summary = mem.verify(ids, namespace=namespace, single_pass=False).to_json()
    return {"namespace": namespace, **summary}


def stats(mem: KVMemory, namespace: str, *, store_wide: bool) -> dict:
    entries = mem.store.list_entries(namespace)
    out = {"namespace": namespace, "entries": len(entries), "verified_entries": sum(e.verified for e in entries),
           "tokens_referenced": sum(len(e.token_ids) for e in entries),
           "blocks_referenced": len({h for e in entries for h in e.chain}),
           "profile_id": mem.engine.profile_id, "chunk": mem.engine.chunk}
    if store_wide:
        out["store"] = mem.stats()
    return out


# ---------------------------------------------------------------------- bundles (store/bundle.py)
def scratch_dir(mem: KVMemory) -> Path:
    """Where the server writes bundles in transit: a folder inside the store (no route writes outside it)."""
    d = Path(mem.store.path) / "serve-tmp"
    d.mkdir(parents=True, exist_ok=True)
    return d


def scratch_file(mem: KVMemory, suffix: str) -> Path:
    return scratch_dir(mem) / f"{uuid.uuid4().hex}{suffix}"


def export(mem: KVMemory, namespace: str, *, entry_ids: Sequence[str] | None = None,
           private: bool = False) -> tuple[Path, dict]:
    """A bundle of the namespace's entries (or of these ids, each checked in the namespace), written to
    a scratch file the caller streams back and removes."""
    if entry_ids:
        for eid in entry_ids:
            entry_in_scope(mem, namespace, eid, private=private)
    elif not mem.store.entry_ids(namespace):
        raise UnknownEntry(f"nothing to export: namespace {namespace!r} holds no entries")
    out = scratch_file(mem, ".kvmb")
    try:
        report = mem.export_bundle(out, entry_ids=list(entry_ids) if entry_ids else None,
                                   namespace=None if entry_ids else namespace)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out, report.to_json() if hasattr(report, "to_json") else {}


class ForeignNamespace(InvalidInput):
    """A bundle holding entries of another namespace than the caller's scope (HTTP 403)."""

    http_status = 403


def import_(mem: KVMemory, namespace: str, path: Path, *, verify_all: bool = False) -> dict:
    """Import an uploaded bundle into the caller's namespace: every entry in it must belong to that
    namespace (a bundle cannot plant entries in another scope), then `KVMemory.import_bundle` checks
    every hash, refuses another profile and proves entries bit-identical before it commits."""
    from kvmemory.store.bundle import read_bundle

    try:
        bundle = read_bundle(path)
        foreign = sorted({e.namespace for e in bundle.entries} - {namespace})
        if foreign:
            raise ForeignNamespace(f"the bundle holds entries of namespace(s) {foreign}; this call imports into "
                                   f"{namespace!r} only (export them from that scope, import them into it)")
        report = mem.import_bundle(bundle, verify_all=verify_all)
        return {"namespace": namespace, **report.to_json()}
    except KVMemoryError as exc:  # a tenant is told what is wrong with its bundle, never where the store is
        msg = str(exc).replace(str(path), "the uploaded bundle").replace(str(mem.store.path), "the store")
        if msg == str(exc):
            raise
        try:
            hidden = type(exc)(msg)
        except Exception:  # noqa: BLE001 - an error class with another constructor
            hidden = InvalidInput(msg)
        raise hidden from None
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass

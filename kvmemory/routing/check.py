"""Checking a router folder against the entries it routes to, without loading an embedder.

    problems = check_router(store.path / "router", store.list_entries())   # [(key, detail), ...]
    run_fsck(store, router_check=router_checker(store), router_rebuild=router_rebuilder(store))

The router is an index of the catalogue (routing/router.py): every routed row must name an entry of
its own namespace by one of that entry's own texts (its problem, or an alias), and every entry must be
routed by its problem. A row whose entry id was changed (rows swapped, an id edited) routes a question
to another entry than the one whose text matched: `answer` refuses such a route when it meets it
(memory/entry_check.py), and `fsck` finds it here; `fsck --repair` rebuilds the router from the
entries. Vectors are not re-embedded here (that needs the embedder): a vector that no longer matches
its text is caught when a question routes through it, by re-scoring the entry's own text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

_MANIFEST = "manifest.json"


def check_router(folder: Path, entries: Iterable, set_aside: Iterable = ()) -> list[tuple[str, str]]:
    """(key, detail) for each way the router folder disagrees with `entries` (EntryRecords). `set_aside`:
    RouteRows of entries fsck set aside, routed by their problem so that answers name them (allowed, not
    required)."""
    folder = Path(folder)
    aside = {(r.entry_id, r.namespace, r.text) for r in set_aside}
    own: dict[str, tuple[str, set[str]]] = {}
    for e in entries:
        aliases = e.meta.get("aliases", []) if isinstance(e.meta, dict) else []
        own[e.id] = (e.namespace, {e.problem, *(a for a in aliases if isinstance(a, str))})
    if not (folder / _MANIFEST).exists():
        return [("router", f"no router index: {len(own)} entries are not routed")] if own else []
    try:
        manifest = json.loads((folder / _MANIFEST).read_text(encoding="utf-8"))
        spaces = manifest["spaces"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [("router", f"the router manifest is unreadable ({exc})")]
    problems: list[tuple[str, str]] = []
    routed: dict[str, set[str]] = {}
    for ns, files in sorted(spaces.items()):
        try:
            data = json.loads((folder / files["rows"]).read_text(encoding="utf-8"))
            rows = data["rows"]
            dead = set(data.get("dead", []))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append((str(ns), f"the router rows of namespace {ns!r} are unreadable ({exc})"))
            continue
        n_vectors = _index_size(folder / files.get("index", ""))
        if n_vectors is None:
            problems.append((str(ns), f"the index file of namespace {ns!r} is unreadable"))
        elif n_vectors != len(rows) + len(dead):
            problems.append((str(ns), f"the index of namespace {ns!r} holds {n_vectors} vectors but its rows name "
                                      f"{len(rows) + len(dead)}"))
        for row in rows:
            try:
                vid, eid, kind, text = row
            except (TypeError, ValueError):
                problems.append((str(ns), f"a router row of namespace {ns!r} is malformed: {row!r}"[:200]))
                continue
            mine = own.get(eid)
            if mine is None and (eid, ns, text) in aside:
                continue
            if mine is None:
                problems.append((str(eid), f"a router row names entry {eid!r}, which the store does not hold"))
            elif mine[0] != ns:
                problems.append((str(eid), f"entry {eid} is routed in namespace {ns!r}, but it is in {mine[0]!r}"))
            elif text not in mine[1]:
                problems.append((str(eid), f"a router row names entry {eid} by a text that is not its own "
                                           f"({str(text)[:60]!r}): a question would be routed to the wrong entry"))
            else:
                routed.setdefault(eid, set()).add(text)
    for eid, (ns, _) in sorted(own.items()):
        if eid not in routed:
            problems.append((eid, f"entry {eid} (namespace {ns!r}) is not routed"))
    return problems


VECTOR_TOLERANCE = 0.01  # the cosine gap an answer's route check tolerates (memory/entry_check.SCORE_TOLERANCE)


def check_vectors(folder: Path, embedder=None, *, batch: int = 256) -> list[tuple[str, str]]:
    """(key, detail) for each router vector that is not its own row's text embedded again (vectors swapped
    between rows, a damaged index), and each index whose dimension is not the manifest's embedder's. What
    an answer checks per route, for every row: it loads the embedder (`embedder`, else the one the
    manifest names) and embeds every routed text once."""
    import faiss
    import numpy as np

    folder = Path(folder)
    try:
        manifest = json.loads((folder / _MANIFEST).read_text(encoding="utf-8"))
        spaces = manifest["spaces"]
        dim = (manifest.get("embedder") or {}).get("dim")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return []  # unreadable: check_router names it
    if embedder is None:
        from kvmemory.routing.router import recorded_embedder

        embedder = recorded_embedder(folder)
    problems: list[tuple[str, str]] = []
    for ns, files in sorted(spaces.items()):
        try:
            rows = json.loads((folder / files["rows"]).read_text(encoding="utf-8"))["rows"]
            index = faiss.read_index(str(folder / files["index"]))
        except Exception:  # noqa: BLE001 - unreadable: check_router names it
            continue
        if dim != index.d or dim != embedder.identity.get("dim"):
            problems.append((str(ns), f"the index of namespace {ns!r} has {index.d} dimensions, its manifest "
                                      f"says {dim} and its embedder makes {embedder.identity.get('dim')}"))
            continue
        good = [r for r in rows if isinstance(r, list) and len(r) == 4 and isinstance(r[3], str) and r[3].strip()]
        for i in range(0, len(good), batch):
            part = good[i:i + batch]
            fresh = embedder.embed([r[3] for r in part])
            for r, v in zip(part, fresh):
                try:
                    stored = np.asarray(index.reconstruct(int(r[0])), dtype=np.float32)
                except Exception:  # noqa: BLE001 - an id the index does not hold
                    problems.append((str(r[1]), f"router row {r[0]} of namespace {ns!r} has no vector"))
                    continue
                cos = float(np.dot(stored, v))
                if abs(1.0 - cos) > VECTOR_TOLERANCE:
                    problems.append((str(r[1]), f"the router vector of entry {r[1]}'s text {r[3][:60]!r} is not "
                                                f"that text embedded (cosine {cos:.3f}): the index is damaged and "
                                                "would route questions to the wrong entry"))
    return problems


def _index_size(path: Path) -> int | None:
    try:
        import faiss

        return int(faiss.read_index(str(path)).ntotal)
    except Exception:  # noqa: BLE001 - faiss raises RuntimeError and others for a damaged file
        return None


def router_checker(store, *, vectors: bool = False, embedder=None) -> Callable[[], list[tuple[str, str]]]:
    """A `router_check` callback for `run_fsck`: `check_router` on `<store.path>/router` and the entries
    the store serves; with `vectors`, `check_vectors` too (loads the embedder)."""

    def check() -> list[tuple[str, str]]:
        from kvmemory.routing.router import set_aside_rows

        found = check_router(store.path / "router", store.list_entries(), set_aside_rows(store))
        if vectors and not found:
            found = check_vectors(store.path / "router", embedder)
        return found

    return check


__all__ = ["check_router", "check_vectors", "router_checker"]

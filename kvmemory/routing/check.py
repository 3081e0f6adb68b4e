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


def _index_size(path: Path) -> int | None:
    try:
        import faiss

        return int(faiss.read_index(str(path)).ntotal)
    except Exception:  # noqa: BLE001 - faiss raises RuntimeError and others for a damaged file
        return None


def router_checker(store) -> Callable[[], list[tuple[str, str]]]:
    """A `router_check` callback for `run_fsck`: `check_router` on `<store.path>/router` and the entries
    the store serves."""

    def check() -> list[tuple[str, str]]:
        from kvmemory.routing.router import set_aside_rows

        return check_router(store.path / "router", store.list_entries(), set_aside_rows(store))

    return check


__all__ = ["check_router", "router_checker"]

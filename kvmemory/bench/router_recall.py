"""Recall cost against the store's size: `KVMemory.recall` at 10 entries and at 100,000, side by side.

A recall must cost the same whatever the store holds: it reads the change feed's head (store/feed.py),
embeds the question once and searches the namespace's index, and reads only the entries it routes to
(memory/router_feed.py); it never lists the namespace. This bench builds two local stores in temporary
folders, one per size, holding the same `real` routed problems (bench/problems.py) and, in the larger,
synthetic entries up to the size. The synthetic entries' router vectors are random unit vectors (the
real embedder would take many minutes to embed 100,000 texts on a small CPU, and random vectors are
routed by no question, like unrelated entries); their catalogue rows are real rows. Both memories use
the real embedder for the questions, the router's own index choice for each size (flat at 10, HNSW at
100,000) and a stand-in engine: recall routes and checks routes, it runs no model (an entry's check
against the language model's tokenizer is cached per entry and is the same at any size).

Then each question is recalled once by each memory, the order alternating, so the two sizes are timed
side by side under the same machine load: questions that route (a rewording of a real problem) and
questions that route nowhere (unrelated ones). Reported: p50 / p99 per size and kind of question, the
ratio of the p50s (large / small), the first recall of each memory (the namespace's full resync: the
one listing a process makes), a recall right after another process committed an entry (one record
of the feed applied), and, for comparison, questions routing nowhere when the namespace is listed
against the router before each (what `sync_router` did per question before the feed).

Run as `python -m kvmemory.bench.router recall [--sizes 10,100000] [--queries 200] [--threads 1]`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["run_recall_scaling"]

_PROFILE = "bench-synthetic-profile"


class _RoutingEngine:
    """What `KVMemory` needs of an engine for recall alone: its store, a profile id (the synthetic entries'
    is another, so the tokenizer check is not run on them) and a chunk size."""

    def __init__(self, store):
        self.store = store
        self.profile_id = "bench-routing-only"
        self.chunk = 16
        self.tokenizer = None


def _entries(n: int, real, seed: int):
    """`real` routed problems, then synthetic entries up to `n` (EntryRecords, problem texts)."""
    from kvmemory.store.entries import EntryRecord

    out = []
    for i in range(n):
        problem = real[i].text if i < len(real) else f"synthetic entry {i} of the recall bench"
        out.append(EntryRecord(
            id=f"b{seed:04d}{i:011d}", namespace="default", problem=problem, solution=f"solution {i}",
            answer=str(i), verifier={"name": "bench", "ok": True}, verified=True, token_ids=(1, 2, 3),
            profile_id=_PROFILE, chain=(), attestation={"attestation_id": f"{i:064x}"}, meta={"aliases": []},
            created=1_700_000_000.0 + i, updated=1_700_000_000.0 + i))
    return out


def _filler_embedder(real_embedder, n_real: int, seed: int):
    """The real embedder, but synthetic problems get random unit vectors (same identity: the router
    built with it opens with the real one)."""
    import copy

    emb = copy.copy(real_embedder)
    rng = np.random.default_rng(seed)

    def embed(texts, *, progress: bool = False):
        texts = list(texts)
        real_idx = [i for i, t in enumerate(texts) if not t.startswith("synthetic entry ")]
        out = rng.standard_normal((len(texts), real_embedder.dim)).astype(np.float32)
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        if real_idx:
            out[real_idx] = real_embedder.embed([texts[i] for i in real_idx])
        return out

    emb.embed = embed
    return emb


def _memory(folder: Path, n: int, real, embedder, seed: int, progress: bool):
    from kvmemory.memory.facade import KVMemory
    from kvmemory.routing.router import Router, route_rows
    from kvmemory.store.local import LocalStore

    store = LocalStore(folder / "store")
    entries = _entries(n, real, seed)
    t0 = time.perf_counter()
    with store._tx() as db:
        for e in entries:
            LocalStore.insert_entry_rows(db, e)
    t1 = time.perf_counter()
    Router(folder / "store" / "router", _filler_embedder(embedder, len(real), seed)).rebuild(route_rows(entries))
    t2 = time.perf_counter()
    if progress:
        print(f"[bench_recall] n={n}: catalogue {t1 - t0:.1f} s, router {t2 - t1:.1f} s", file=sys.stderr, flush=True)
    mem = KVMemory(_RoutingEngine(store), router=Router(folder / "store" / "router", embedder))
    return mem, {"catalogue_s": t1 - t0, "router_build_s": t2 - t1}


def _p(samples: list[float]) -> dict[str, float]:
    ms = np.asarray(samples) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms)}


def run_recall_scaling(sizes=(10, 100_000), queries: int = 200, seed: int = 0, threads: int | None = 1,
                       progress: bool = True) -> dict[str, Any]:
    """The measurement of the module docstring; a JSON-able dict. Torch's thread count is `threads` while
    it runs and what it was after (a caller's engine profile pins the count it was opened with)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(int(threads))
    try:
        return _run_recall_scaling(sizes, queries, seed, progress)
    finally:
        torch.set_num_threads(before)


def _run_recall_scaling(sizes, queries: int, seed: int, progress: bool) -> dict[str, Any]:
    import torch

    from kvmemory.bench.problems import generate_problems, unrelated_questions
    from kvmemory.routing.embedders import Embedder

    small, large = (int(n) for n in sizes)
    n_real = min(10, small)
    real = generate_problems(n_real, seed, rewordings=1)
    embedder = Embedder.default()
    routed_q = [real[i % n_real].rewordings[0] for i in range(queries // 2)]
    nowhere_q = unrelated_questions(queries - len(routed_q), seed + 1)
    out: dict[str, Any] = {"config": {"sizes": [small, large], "queries": queries, "seed": seed,
                                      "torch_threads": torch.get_num_threads(), "real_entries": n_real}}
    with tempfile.TemporaryDirectory(prefix="kvmemory-bench-recall-") as tmp:
        mems, builds = {}, {}
        for n in (small, large):
            mems[n], builds[n] = _memory(Path(tmp) / f"n{n}", n, real, embedder, seed, progress)
        first = {}
        for n, mem in mems.items():  # the namespace's full resync: the one listing a process makes
            t0 = time.perf_counter()
            mem.recall(routed_q[0], k=1)
            first[n] = time.perf_counter() - t0
        for q in routed_q[:4] + nowhere_q[:4]:  # warm up both
            for mem in mems.values():
                mem.recall(q, k=1)
        times: dict[tuple[int, str], list[float]] = {(n, kind): [] for n in mems for kind in ("routed", "nowhere")}
        hits = {n: 0 for n in mems}
        for i, (kind, qs) in enumerate([("routed", routed_q), ("nowhere", nowhere_q)]):
            for j, q in enumerate(qs):
                order = (small, large) if (i + j) % 2 == 0 else (large, small)
                for n in order:
                    t0 = time.perf_counter()
                    got = mems[n].recall(q, k=1)
                    times[(n, kind)].append(time.perf_counter() - t0)
                    hits[n] += kind == "routed" and bool(got)
        # another process commits one entry: the next recall applies one record of the feed
        from kvmemory.store.local import LocalStore

        after_change = {}
        for n, mem in mems.items():
            other = LocalStore(mem.store.path)
            e = _entries(n + 1, real, seed + 1)[-1]
            with other._tx() as db:
                LocalStore.insert_entry_rows(db, e)
            t0 = time.perf_counter()
            mem.recall(nowhere_q[0], k=1)
            after_change[n] = time.perf_counter() - t0
            assert e.id in mem.router, "the change was not applied"
        # what a recall cost before the feed: the namespace listed against the router per question
        listing = {n: [] for n in mems}
        for j, q in enumerate(nowhere_q[:max(4, queries // 10)]):
            for n in ((small, large) if j % 2 == 0 else (large, small)):
                mem = mems[n]
                t0 = time.perf_counter()
                mem.resync_router("default")
                mem.recall(q, k=1)
                listing[n].append(time.perf_counter() - t0)
        for n, mem in mems.items():
            out[str(n)] = {"nowhere_listing_per_question": _p(listing[n]), "entries": n, **builds[n], "index": mem.router.stats()["namespaces"]["default"]["index"],
                           "first_recall_s": first[n], "recall_after_one_change_s": after_change[n],
                           "routed": _p(times[(n, "routed")]), "nowhere": _p(times[(n, "nowhere")]),
                           "routed_found": hits[n]}
    out["ratio_p50"] = {kind: out[str(large)][kind]["p50_ms"] / out[str(small)][kind]["p50_ms"]
                        for kind in ("routed", "nowhere", "nowhere_listing_per_question")}
    return out

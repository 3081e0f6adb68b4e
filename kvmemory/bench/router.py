"""Router benchmarks: recall latency and memory at scale, the flat/HNSW crossover, threshold calibration.

`run_router_bench` measures, at each size (10k, 100k, 1M routed vectors by default), the exact flat index
and the index type the router chooses for that size (`router.index_kind_for`): build time, index bytes,
process RSS growth, p50/p99 latency of one query at a time, and the chosen index's recall@k against the
exact answer. The index-only part uses synthetic L2-normalised Gaussian vectors (a worst case for
approximate search: real sentence embeddings cluster, so real recall is higher). The end-to-end part,
at the largest size, adds embedding the question with the real embedder. `measure_crossover` times flat
against HNSW at growing sizes; it is where `router.HNSW_THRESHOLD` comes from. `calibrate_threshold`
is where `router.DEFAULT_THRESHOLD` comes from.

Run as `python -m kvmemory.bench.router [bench|tiny|crossover|calibrate [--embedder NAME]|recall]`; each prints
JSON. `recall` (bench/router_recall.py) times `KVMemory.recall` itself at 10 and 100,000 entries side by
side: what the change feed makes constant (no listing of the namespace per question).

Measured with `run_router_bench()` (defaults: 1000 queries, k=10, seed 0) on the shared 2-core
development machine (no GPU, other jobs running: p99 figures include their interference), faiss-cpu,
builds on 2 OpenMP threads, queries one at a time on 1 thread; total 381 s:

    vectors  index   build     index bytes   RSS growth   p50 / p99 ms    recall@10*  near top-1**
    10k      flat    0.08 s       15.4 MB      17.7 MB    0.35 / 0.50       1.000       1.000   (chosen)
    100k     flat    1.2 s       154 MB       161 MB      8.3 / 12.7        1.000       1.000
    100k     HNSW    60 s        182 MB       189 MB      1.6 / 5.8         0.237       0.976   (chosen)
    1M       flat    11.7 s      1.54 GB      1.59 GB    63.0 / 105.6       1.000       1.000   (200 queries)
    1M       IVF     28 s        1.55 GB      1.85 GB     5.1 / 10.2        0.202       0.984   (chosen; 1024 lists, nprobe 64)

    *  random queries against random data: the worst case for approximate search, nothing to route to.
    ** queries made by moving a stored vector to cosine ~0.85 (what a rewording of a stored problem is):
       share whose top hit is that vector. This is the number that matters for routing.

Crossover (flat vs HNSW p50 ms): 4k 0.11/0.21, 8k 0.24/0.39, 12k 0.39/0.52, 16k 0.96/0.76,
24k 1.74/1.12, 32k 2.44/1.18, 48k 4.09/1.36, hence router.HNSW_THRESHOLD = 16k. HNSW insertion slows
as the graph grows (100k took 60 s, ~1,700 vectors/s; the 48k build ran at ~2,000/s), so 1M as HNSW
would take 10+ minutes on this machine; IVF builds 1M in 28 s, hence router.IVF_THRESHOLD.

End to end at 1M (IVF), 200 real questions embedded with all-MiniLM-L6-v2 then searched:
torch default (2 threads) embed p50 526 ms / p99 548 ms, total p50 537 / p99 570 ms;
torch 1 thread            embed p50 22 ms / p99 36 ms,   total p50 28 / p99 42 ms.
On a busy 2-core machine a 2-thread team for one short sentence is ~20x slower than one thread.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import faiss
import numpy as np
import psutil

from kvmemory.routing import router as R

__all__ = ["run_router_bench", "measure_crossover", "calibrate_threshold"]

_K = 10


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[bench_router] {msg}", file=sys.stderr, flush=True)


def _unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "queries": int(len(ms))}


@contextlib.contextmanager
def _omp_threads(n: int | None) -> Iterator[None]:
    old = faiss.omp_get_max_threads()
    if n:
        faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(old)


def _time_queries(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[dict[str, float], np.ndarray]:
    """Latency of one query at a time, on one OpenMP thread.

    One thread because that is how a router serves a question, and because an OpenMP team around a
    single small query only adds fork/join cost: on this shared 2-core machine, with 2 threads every
    query below ~10k vectors took a flat ~8 ms (scheduler wake-ups), flat or HNSW alike.
    """
    ids = np.empty((len(queries), k), dtype=np.int64)
    with _omp_threads(1):
        index.search(queries[:1], k)  # warm caches / lazily built structures out of the timing
        times = []
        for i in range(len(queries)):
            t0 = time.perf_counter()
            _, I = index.search(queries[i:i + 1], k)
            times.append(time.perf_counter() - t0)
            ids[i] = I[0]
    return _percentiles(times), ids


def _index_bytes(index: faiss.Index) -> int:
    # The size of what the router would write: serialise to a temp file (no second in-memory copy).
    fd, path = tempfile.mkstemp(suffix=".faiss")
    os.close(fd)
    try:
        faiss.write_index(index, path)
        return os.path.getsize(path)
    finally:
        os.unlink(path)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _build(kind: str, n: int, dim: int, seed: int, chunk: int = 100_000,
           keep: np.ndarray | None = None) -> tuple[faiss.Index, float, np.ndarray | None]:
    """Build an index of `kind` over n synthetic vectors, regenerated chunk by chunk from `seed` so every
    index type sees identical data without a full extra copy in memory. Returns (index, seconds, the
    vectors whose ids are in `keep`, in that order)."""
    t0 = time.perf_counter()
    train, nlist = None, None
    if kind == "ivf":
        # Same recipe as Router._build: train on a sample of ~50 vectors per list.
        nlist = R.ivf_nlist_for(n)
        train = _unit_vectors(np.random.default_rng([seed, 7]), min(n, 50 * nlist), dim)
    index = R.new_index(kind, dim, train, nlist=nlist)  # type: ignore[arg-type]
    del train
    rng = np.random.default_rng(seed)
    kept = np.zeros((0 if keep is None else len(keep), dim), dtype=np.float32)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = _unit_vectors(rng, m, dim)
        if keep is not None:
            sel = (keep >= start) & (keep < start + m)
            kept[sel] = x[keep[sel] - start]
        index.add_with_ids(x, np.arange(start, start + m, dtype=np.int64))
    return index, time.perf_counter() - t0, (kept if keep is not None else None)


def _near_queries(seed: int, n: int, dim: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids of `count` stored vectors and the noise that turns each into a query at cosine ~0.85 to it.

    This is the router's real workload: a rewording lands close to one stored problem (calibration
    measured the right entry at cosine >= 0.81), far from the rest.
    """
    rng = np.random.default_rng([seed, 3])
    targets = np.sort(rng.choice(n, size=min(count, n), replace=False)).astype(np.int64)
    noise = rng.standard_normal((len(targets), dim), dtype=np.float32) * np.float32(0.62 / np.sqrt(dim))
    return targets, noise


def _recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = sum(len(set(f.tolist()) & set(t.tolist())) for f, t in zip(found, truth))
    return hits / truth.size


def _set_eval_width(index: faiss.Index, k: int) -> None:
    # What Router.search does for a k-hit query (it over-fetches 4k or k+16).
    R._set_search_width(index, max(4 * k, k + 16))


def _measure_one(kind: str, n: int, dim: int, seed: int, queries: int, timed: int, out_dir: str,
                 end_to_end: int, threads: int | None) -> dict[str, Any]:
    """Run in a fresh process: build one index, measure it, write its result ids to out_dir."""
    if threads:
        faiss.omp_set_num_threads(threads)
    q = _unit_vectors(np.random.default_rng([seed, 1]), queries, dim)
    targets, noise = _near_queries(seed, n, dim, queries)
    rss0 = _rss()
    index, build_s, kept = _build(kind, n, dim, seed, keep=targets)
    rss1 = _rss()
    near = kept + noise
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    res: dict[str, Any] = {"kind": kind, "build_s": build_s, "index_bytes": _index_bytes(index),
                           "rss_delta_bytes": rss1 - rss0}
    if kind == "ivf":
        ivf = faiss.downcast_index(index)
        res["nlist"] = int(ivf.nlist)
    _set_eval_width(index, _K)
    lat, found = _time_queries(index, q[:timed], _K)
    res.update(lat)
    if timed < queries:  # the rest only for recall, batched
        _, rest = index.search(q[timed:], _K)
        found = np.concatenate([found, rest])
    np.save(os.path.join(out_dir, f"{kind}-{n}.npy"), found, allow_pickle=False)
    near_lat, near_ids = _time_queries(index, near[:timed], _K)
    res["near"] = {**near_lat, "top1_is_source": float(np.mean(near_ids[:, 0] == targets[:timed]))}
    if kind == "ivf":
        res["nprobe"] = int(faiss.downcast_index(index).nprobe)
    if end_to_end:
        res["end_to_end"] = _end_to_end(index, n, end_to_end, seed)
    return res


def _run_child(args: dict[str, Any], progress: bool) -> dict[str, Any]:
    """`_measure_one` in a fresh interpreter, so its RSS growth is the index's and nothing else's.
    Arguments and result travel as JSON (no pickle, hence no multiprocessing)."""
    proc = subprocess.run([sys.executable, "-m", "kvmemory.bench.router", "_one", json.dumps(args)],
                          stdout=subprocess.PIPE, stderr=None if progress else subprocess.DEVNULL, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed ({proc.returncode}) for {args}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_crossover(sizes: Sequence[int] = (4_000, 8_000, 12_000, 16_000, 24_000, 32_000, 48_000),
                      dim: int = 384, queries: int = 200, seed: int = 0, progress: bool = False) -> list[dict[str, Any]]:
    """p50 latency of one query, flat vs HNSW (as the router builds them), at each size."""
    out = []
    q = _unit_vectors(np.random.default_rng([seed, 1]), queries, dim)
    for n in sizes:
        flat, _, _ = _build("flat", n, dim, seed)
        hnsw, build_s, _ = _build("hnsw", n, dim, seed)
        _set_eval_width(hnsw, _K)
        f_lat, truth = _time_queries(flat, q, _K)
        h_lat, found = _time_queries(hnsw, q, _K)
        row = {"n": n, "flat_p50_ms": f_lat["p50_ms"], "hnsw_p50_ms": h_lat["p50_ms"],
               "flat_p99_ms": f_lat["p99_ms"], "hnsw_p99_ms": h_lat["p99_ms"],
               "hnsw_build_s": build_s, "hnsw_recall_at_10": _recall(found, truth)}
        _log(progress, f"crossover n={n}: flat {row['flat_p50_ms']:.3f} ms, hnsw {row['hnsw_p50_ms']:.3f} ms")
        out.append(row)
        del flat, hnsw
    return out


def run_router_bench(sizes: Sequence[int] = (10_000, 100_000, 1_000_000), dim: int = 384, queries: int = 1000,
                     seed: int = 0, progress: bool = True, *, tiny: bool = False,
                     hnsw_threshold: int | None = None, ivf_threshold: int | None = None,
                     threads: int | None = 2, flat_query_cap: int = 200, end_to_end: bool = True,
                     crossover: bool = True) -> dict[str, Any]:
    """Latency / memory of routing at `sizes` vectors; JSON-able result (see the module docstring).

    Per size: the exact flat index and the type the router picks (`chosen_kind`), each built and measured
    in a fresh process. `recall_at_10` is against the flat answer for random queries (worst case);
    `near.top1_is_source` is for queries made by moving a stored vector to cosine ~0.85 (the routing
    case). Flat search at large sizes is slow (a full scan per query), so at 200k vectors and more only
    `flat_query_cap` flat queries are timed (all of them still feed the recall ground truth).
    `tiny=True` is the test mode: sizes (1000, 5000), few queries, thresholds lowered so that all three
    index types are exercised.
    """
    t_start = time.perf_counter()
    if tiny:
        sizes = (1_000, 5_000) if tuple(sizes) == (10_000, 100_000, 1_000_000) else sizes
        queries = min(queries, 50)
        hnsw_threshold = 1_000 if hnsw_threshold is None else hnsw_threshold
        ivf_threshold = 5_000 if ivf_threshold is None else ivf_threshold
    hnsw_threshold = R.HNSW_THRESHOLD if hnsw_threshold is None else hnsw_threshold
    ivf_threshold = R.IVF_THRESHOLD if ivf_threshold is None else ivf_threshold
    sizes = tuple(int(n) for n in sizes)
    result: dict[str, Any] = {
        "config": {
            "dim": dim, "queries": queries, "k": _K, "seed": seed, "omp_threads_build": threads,
            "omp_threads_query": 1, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "faiss": faiss.__version__, "hnsw_threshold": hnsw_threshold, "ivf_threshold": ivf_threshold,
            "hnsw": {"M": R.HNSW_M, "efConstruction": R.HNSW_EF_CONSTRUCTION, "efSearch": R.HNSW_EF_SEARCH},
            "ivf": {"nprobe": R.IVF_NPROBE}, "data": "synthetic L2-normalised Gaussian vectors",
            "flat_query_cap": flat_query_cap, "tiny": tiny,
        },
        "sizes": [],
    }
    if crossover:
        cs = (500, 1_000, 2_000) if tiny else (4_000, 8_000, 12_000, 16_000, 24_000, 32_000, 48_000)
        with _omp_threads(threads):
            result["crossover"] = measure_crossover(cs, dim, 30 if tiny else 200, seed, progress)
    with tempfile.TemporaryDirectory() as out_dir:
        for n in sizes:
            kind = R.index_kind_for(n, hnsw_threshold=hnsw_threshold, ivf_threshold=ivf_threshold)
            last = n == sizes[-1]
            e2e = (min(queries, 10 if tiny else 200) if end_to_end and last else 0)
            base = {"n": n, "dim": dim, "seed": seed, "queries": queries, "out_dir": out_dir, "threads": threads}
            _log(progress, f"n={n}: flat")
            flat = _run_child({**base, "kind": "flat", "timed": queries if n < 200_000 else min(queries, flat_query_cap),
                               "end_to_end": e2e if kind == "flat" else 0}, progress)
            truth = np.load(os.path.join(out_dir, f"flat-{n}.npy"), allow_pickle=False)
            entry: dict[str, Any] = {"n": n, "chosen_kind": kind, "flat": flat}
            if kind == "flat":
                entry["chosen"] = {"same_as_flat": True, "recall_at_10": 1.0}
            else:
                _log(progress, f"n={n}: {kind}")
                chosen = _run_child({**base, "kind": kind, "timed": queries, "end_to_end": e2e}, progress)
                found = np.load(os.path.join(out_dir, f"{kind}-{n}.npy"), allow_pickle=False)
                chosen["recall_at_10"] = _recall(found, truth)
                entry["chosen"] = chosen
            src = flat if kind == "flat" else entry["chosen"]
            if "end_to_end" in src:
                result["end_to_end"] = src.pop("end_to_end")
            _log(progress, f"n={n}: {json.dumps(entry)}")
            result["sizes"].append(entry)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _end_to_end(index: faiss.Index, n: int, queries: int, seed: int) -> dict[str, Any]:
    """Embed a real question with the default embedder, then search the index (what a recall costs).

    Measured twice: with torch's default intra-op thread count, and with one thread. On a busy shared
    CPU the difference is large (one short sentence is too little work for a thread team, and spinning
    threads fight the other processes for the cores); the library leaves torch's setting alone because
    the execution profile of the language model includes the thread count.
    """
    import torch

    from kvmemory.bench.problems import generate_problems, unrelated_questions

    emb = R.Embedder.default()
    if emb.dim != index.d:
        return {"skipped": f"index has {index.d} dims, the embedder {emb.dim}"}
    texts = [p.rewordings[0] for p in generate_problems(queries // 2, seed, rewordings=1)]
    texts += unrelated_questions(queries - len(texts), seed)
    emb.embed(texts[:2])  # load and warm up outside the timing
    _set_eval_width(index, _K)

    def measure() -> dict[str, Any]:
        t_embed, t_total = [], []
        for t in texts:
            t0 = time.perf_counter()
            v = emb.embed([t])
            t1 = time.perf_counter()
            with _omp_threads(1):
                index.search(v, _K)
            t2 = time.perf_counter()
            t_embed.append(t1 - t0)
            t_total.append(t2 - t0)
        e, tot = _percentiles(t_embed), _percentiles(t_total)
        return {"torch_threads": int(torch.get_num_threads()), "embed_p50_ms": e["p50_ms"],
                "embed_p99_ms": e["p99_ms"], "total_p50_ms": tot["p50_ms"], "total_p99_ms": tot["p99_ms"]}

    default = measure()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = measure()
    finally:
        torch.set_num_threads(old)
    return {"n": n, "kind": R.kind_of(index), "queries": len(texts), **default, "one_thread": one}


def calibrate_threshold(n_problems: int = 200, n_unrelated: int = 600, seed: int = 0,
                        embedder: R.Embedder | str | None = None, rewordings: int = 3,
                        threshold: float | None = None) -> dict[str, Any]:
    """Score rewordings against their originals and unrelated questions against the library.

    The library is `generate_problems(n_problems, seed)` routed by problem text only (no aliases, the
    hard case); related queries are their rewordings; unrelated ones are `unrelated_questions`. Returns
    the separation (min score of the right entry for a rewording, max best score of an unrelated
    question), the threshold that best separates them, and recall@1 / reject rate at that threshold and
    at `threshold` (default: the embedder's calibrated threshold, `router.threshold_for`; MiniLM's 0.83
    for an uncalibrated model). `embedder`: an Embedder or a name/folder (`router.resolve_embedder`).
    This is how a new embedder gets its threshold: `python -m kvmemory.bench.router calibrate
    --embedder NAME_OR_FOLDER`, then pass the "best" threshold as `KVMemory(..., threshold=...)`.
    """
    from kvmemory.bench.problems import generate_problems, unrelated_questions

    emb = R.resolve_embedder(embedder)
    cur = R.threshold_for(emb, warn=False) if threshold is None else threshold
    probs = generate_problems(n_problems, seed, rewordings=rewordings)
    unrelated = unrelated_questions(n_unrelated, seed + 1)
    with tempfile.TemporaryDirectory() as d:
        router = R.Router(os.path.join(d, "router"), emb, threshold=cur)
        router.add_many([(p.id, "calib", [p.text]) for p in probs], progress=False)
        related = [(p.id, r) for p in probs for r in p.rewordings]
        rel_vecs = emb.embed([r for _, r in related])
        unr_vecs = emb.embed(unrelated)
        rel_top: list[tuple[bool, float, float]] = []  # (top-1 is right, top-1 score, right entry's score)
        for (pid, _), v in zip(related, rel_vecs):
            hits = router.search_vector(v, n_problems, "calib", -2.0)
            right = next(h.score for h in hits if h.entry_id == pid)
            rel_top.append((hits[0].entry_id == pid, hits[0].score, right))
        unr_best = [router.search_vector(v, 1, "calib", -2.0)[0].score for v in unr_vecs]
        worst_unrelated = sorted(zip(unr_best, unrelated), reverse=True)[:5]

    def at(thr: float) -> dict[str, float]:
        recall = sum(ok and s >= thr for ok, s, _ in rel_top) / len(rel_top)
        reject = sum(s < thr for s in unr_best) / len(unr_best)
        return {"threshold": thr, "recall_at_1": recall, "unrelated_rejected": reject}

    right_scores = np.array([r for _, _, r in rel_top])
    # Pick the threshold maximising the worse of the two rates, on a 0.005 grid; ties go to the midpoint.
    grid = np.round(np.arange(0.30, 0.99, 0.005), 3)
    scored = [(min(at(t)["recall_at_1"], at(t)["unrelated_rejected"]), float(t)) for t in grid]
    best = max(s for s, _ in scored)
    ties = [t for s, t in scored if s == best]
    chosen = ties[len(ties) // 2]
    return {
        "embedder": emb.identity["name"], "embedder_spec": emb.spec,
        "weights_sha256": emb.identity["weights_sha256"], "calibrated": emb.identity["weights_sha256"] in R.CALIBRATED_THRESHOLDS,
        "seed": seed, "problems": n_problems, "related_queries": len(rel_top),
        "unrelated_queries": len(unr_best),
        "min_related_score": float(right_scores.min()),
        "related_score_p01": float(np.percentile(right_scores, 1)),
        "related_score_p05": float(np.percentile(right_scores, 5)),
        "max_unrelated_score": float(max(unr_best)),
        "unrelated_score_p99": float(np.percentile(unr_best, 99)),
        "unrelated_score_p95": float(np.percentile(unr_best, 95)),
        "top1_accuracy_no_threshold": sum(ok for ok, _, _ in rel_top) / len(rel_top),
        "best": at(chosen),
        "at_threshold": at(cur),
        "closest_unrelated": [{"score": s, "question": q} for s, q in worst_unrelated],
    }


def _calibrate_args(args: list[str]) -> dict[str, Any]:
    """`calibrate [--embedder NAME_OR_FOLDER] [--problems N] [--unrelated N] [--seed S] [--threshold T]`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.router calibrate",
                                description="score rewordings and unrelated questions; print the best threshold")
    p.add_argument("--embedder", help="built-in name (minilm, multilingual), sentence-transformers folder or "
                   "cached hub id (default: minilm)")
    p.add_argument("--problems", type=int, default=200, help="library size (generated problems)")
    p.add_argument("--unrelated", type=int, default=600, help="unrelated questions")
    p.add_argument("--seed", type=int, default=0, help="generator seed (1 for the held-out check)")
    p.add_argument("--threshold", type=float, help="also report rates at this threshold")
    a = p.parse_args(args)
    return {"embedder": a.embedder, "n_problems": a.problems, "n_unrelated": a.unrelated, "seed": a.seed,
            "threshold": a.threshold}


def _recall_args(args: list[str]) -> dict[str, Any]:
    """Options of `recall` (bench/router_recall.py)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.router recall",
                                description="KVMemory.recall at two store sizes, side by side")
    p.add_argument("--sizes", default="10,100000", help="the two sizes, comma separated (default: %(default)s)")
    p.add_argument("--queries", type=int, default=200, help="questions per size (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the embedder (default: %(default)s)")
    a = p.parse_args(args)
    return {"sizes": tuple(int(x) for x in a.sizes.split(",")), "queries": a.queries, "seed": a.seed,
            "threads": a.threads}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    what = args[0] if args else "bench"
    if what == "bench":
        out: Any = run_router_bench()
    elif what == "tiny":
        out = run_router_bench(tiny=True)
    elif what == "crossover":
        faiss.omp_set_num_threads(2)
        out = measure_crossover(progress=True)
    elif what == "calibrate":
        out = calibrate_threshold(**_calibrate_args(args[1:]))
    elif what == "recall":  # KVMemory.recall at 10 and 100,000 entries, side by side (bench/router_recall.py)
        from kvmemory.bench.router_recall import run_recall_scaling

        out = run_recall_scaling(**_recall_args(args[1:]))
    elif what == "_one":  # internal: one measurement in a fresh process (see _run_child)
        a = json.loads(args[1])
        out = _measure_one(a["kind"], a["n"], a["dim"], a["seed"], a["queries"], a["timed"], a["out_dir"],
                           a["end_to_end"], a["threads"])
        print(json.dumps(out))
        return 0
    else:
        print("usage: python -m kvmemory.bench.router [bench|tiny|crossover|calibrate|recall]", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Load run on the embedded model: concurrent `answer` / `recall` calls from several threads for a bounded
time, on the local store and on Redis. Reports throughput, latency and error count; every concurrent
answer must be token-for-token the answer the same call gave alone (exactness under load)."""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import pytest
from redis_server import RedisServer

from kvmemory.engine.engine import Engine
from kvmemory.store.local import LocalStore

SECONDS = 8.0
THREADS = 4
MAX_NEW = 4
PROBLEMS = [
    ("Tom has 3 boxes of 12 eggs and breaks 5. How many eggs are left?",
     "3 * 12 = 36 eggs. 36 - 5 = 31. The answer is 31.", "31"),
    ("A train travels 60 km per hour for 4 hours. How far does it go?",
     "60 * 4 = 240 km. The answer is 240.", "240"),
]
QUERIES = [
    PROBLEMS[0][0],
    "What distance does a train cover at 60 km per hour in 4 hours?",  # a rewording
    "What is the capital of France?",  # routes nowhere: the model answers on its own
]


def _store(kind, tmp_path, srv):
    if kind == "local":
        return LocalStore(tmp_path / "store")
    from kvmemory.store.redis_store import RedisStore

    return RedisStore(srv.url, store=f"load{uuid.uuid4().hex[:6]}", path=tmp_path / "tier", signer="0a" * 32)


@pytest.mark.parametrize("kind", ["local", "redis"])
def test_concurrent_answer_and_recall(kind, smollm, tmp_path):
    from kvmemory.memory.facade import KVMemory

    srv = RedisServer().start() if kind == "redis" else None
    try:
        mem = KVMemory(Engine(smollm, _store(kind, tmp_path, srv)))
        for p, s, a in PROBLEMS:
            mem.remember(p, s, answer=a)
        # What each call gives alone: the reference every concurrent call is compared with.
        ref_answer = {q: mem.answer(q, max_new_tokens=MAX_NEW).token_ids for q in QUERIES}
        ref_recall = {q: [h.entry.id for h in mem.recall(q, k=2)] for q in QUERIES}
        assert any(ref_recall.values()) and not ref_recall[QUERIES[-1]]

        lock = threading.Lock()
        stats = {"answer": 0, "recall": 0, "errors": 0, "mismatches": 0, "grafted": 0}
        latencies: list[float] = []
        errors: list[str] = []
        end = time.monotonic() + SECONDS

        def worker(n: int) -> None:
            i = n
            while time.monotonic() < end:
                q = QUERIES[(i // 2) % len(QUERIES)]
                op = "answer" if i % 2 == 0 else "recall"
                t0 = time.perf_counter()
                try:
                    if op == "answer":
                        ans = mem.answer(q, max_new_tokens=MAX_NEW)
                        ok = ans.token_ids == ref_answer[q]
                        grafted = ans.report.tokens_grafted
                    else:
                        ok = [h.entry.id for h in mem.recall(q, k=2)] == ref_recall[q]
                        grafted = 0
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    with lock:
                        stats["errors"] += 1
                        errors.append(f"{op}: {type(exc).__name__}: {exc}")
                else:
                    with lock:
                        stats[op] += 1
                        stats["mismatches"] += not ok
                        stats["grafted"] += grafted
                        latencies.append(time.perf_counter() - t0)
                i += 1

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        ops = stats["answer"] + stats["recall"]
        lat = sorted(latencies) or [0.0]
        print(f"\n[load {kind}] {THREADS} threads, {wall:.1f}s: {ops} calls ({stats['answer']} answer, "
              f"{stats['recall']} recall) = {ops / wall:.2f} calls/s; latency p50 {statistics.median(lat):.3f}s "
              f"p95 {lat[int(0.95 * (len(lat) - 1))]:.3f}s; tokens grafted {stats['grafted']}; errors "
              f"{stats['errors']}; answers differing from the single-call reference {stats['mismatches']}")
        assert stats["errors"] == 0, errors[:5]
        assert stats["mismatches"] == 0
        assert stats["answer"] > 0 and stats["recall"] > 0 and stats["grafted"] > 0
    finally:
        if srv is not None:
            srv.close()

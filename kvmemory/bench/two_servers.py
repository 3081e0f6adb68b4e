"""Two `kvmemory serve` processes on one Redis store (`kvmemory bench serve --two-servers`, issue 49):
how soon what one remembers is routed by the other, and what one forgets is dropped by the other.

A `redis-server` (from PATH: `apt-get install redis-server`) is started on a free loopback port in a
temporary folder, and two kvmemory servers on `redis://...?store=bench`, each with its own local tier
and a signing key made for the run (KVMEMORY_SIGNING_KEY). For each of `entries` word problems:
server A remembers it (`POST /v1/memory/remember`, timed from its answer), then server B is asked to
recall a rewording (`POST /v1/memory/recall`, k = 1) every `poll_s` until its first hit is that entry:
`visible_s`. Then A forgets it (`DELETE /v1/memory/entries/{id}`) and B is polled until the entry is no
longer among its hits: `dropped_s`. B's recall latency is each poll's round trip (both servers warmed by
one recall first). Issue 49 asks both within 1 s. Everything is stopped and removed at the end, failed or not.
"""

from __future__ import annotations

import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvmemory.errors import KVMemoryError

TIMEOUT_S = 10.0  # a change not seen within this is reported as not seen


def _redis(folder: Path, port: int) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise KVMemoryError("kvmemory bench serve --two-servers needs redis-server on PATH "
                            "(apt-get install redis-server)")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
                             "--appendonly", "no", "--daemonize", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5).ping():
                return proc
        except redis.exceptions.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise KVMemoryError(f"redis-server did not answer on port {port} within 10 s")


def _until(done, poll_s: float) -> float | None:
    """Seconds until `done()` is true, polled every `poll_s`; None past TIMEOUT_S."""
    t0 = time.perf_counter()
    while not done():
        if time.perf_counter() - t0 > TIMEOUT_S:
            return None
        time.sleep(poll_s)
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "max": max(xs), "min": min(xs), "n": len(xs)} if xs else None


def run_two_servers(entries: int = 10, threads: int = 2, poll_s: float = 0.02, say=lambda _m: None) -> dict:
    """The measurement (module docstring): {visible_s, dropped_s, recall_s, not_seen, not_dropped, ...}."""
    import httpx

    from kvmemory.bench.problems import generate_problems
    from kvmemory.bench.serve import Server, free_port

    tmp = Path(tempfile.mkdtemp(prefix="kvmemory-bench-two-servers-"))
    port = free_port()
    redis_proc = _redis(tmp, port)
    saved_key = os.environ.get("KVMEMORY_SIGNING_KEY")
    os.environ["KVMEMORY_SIGNING_KEY"] = secrets.token_hex(32)  # the servers inherit it (Server.start)
    servers = []
    try:
        for name in ("a", "b"):
            url = f"redis://127.0.0.1:{port}/0?store=bench&tier={tmp / f'tier-{name}'}"
            cmd = [sys.executable, "-m", "kvmemory.cli", "serve", "--store", url, "--port", str(free_port()),
                   "--threads", str(threads), "--log-level", "warning", "--no-mcp"]
            servers.append(Server(f"kvmemory-{name}", cmd, int(cmd[cmd.index("--port") + 1]), tmp / f"{name}.log",
                                  "/healthz"))
        for s in servers:
            say(f"two servers: starting {s.name}")
            s.start()
        a, b = (httpx.Client(base_url=s.url, timeout=120) for s in servers)
        visible, dropped, recall, not_seen, not_dropped = [], [], [], 0, 0

        def hits(query: str) -> list[str]:
            t = time.perf_counter()
            r = b.post("/v1/memory/recall", json={"query": query, "k": 1})
            recall.append(time.perf_counter() - t)
            r.raise_for_status()
            return [h["id"] for h in r.json()["results"]]

        for c in (a, b):  # warm: the first request of a fresh server (each loaded its embedder when it started)
            c.post("/v1/memory/recall", json={"query": "warm up", "k": 1}).raise_for_status()
        for p in generate_problems(entries, seed=49, rewordings=1):
            r = a.post("/v1/memory/remember", json={"problem": p.text, "solution": p.solution, "answer": str(p.answer),
                                                     "verifier": "arithmetic"})
            r.raise_for_status()
            entry = r.json()["id"]
            seen = _until(lambda: entry in hits(p.rewordings[0]), poll_s)
            not_seen += seen is None
            visible += [seen] if seen is not None else []
            a.delete(f"/v1/memory/entries/{entry}").raise_for_status()
            gone = _until(lambda: entry not in hits(p.rewordings[0]), poll_s)
            not_dropped += gone is None
            dropped += [gone] if gone is not None else []
        a.close()
        b.close()
        return {"ran": True, "entries": entries, "poll_s": poll_s, "visible_each_s": visible, "dropped_each_s": dropped,
                "visible_s": _stats(visible),
                "dropped_s": _stats(dropped), "recall_s": _stats(recall), "not_seen": not_seen,
                "not_dropped": not_dropped, "within_1s": bool(visible and dropped and not not_seen and not not_dropped
                                                              and max(visible) <= 1.0 and max(dropped) <= 1.0)}
    finally:
        for s in servers:
            s.stop()
        redis_proc.kill()
        redis_proc.wait(10)
        if saved_key is None:
            os.environ.pop("KVMEMORY_SIGNING_KEY", None)
        else:
            os.environ["KVMEMORY_SIGNING_KEY"] = saved_key
        shutil.rmtree(tmp, ignore_errors=True)


def format_line(r: dict) -> str:
    if not r.get("ran"):
        return f"two servers: not run ({r.get('reason')})"
    v, d, q = r["visible_s"], r["dropped_s"], r["recall_s"]
    fmt = lambda s: f"median {s['median'] * 1e3:.0f} ms, max {s['max'] * 1e3:.0f} ms" if s else "none"  # noqa: E731
    return (f"two servers on one Redis store, {r['entries']} entries: remembered on A, routed by B after {fmt(v)}; "
            f"forgotten on A, dropped by B after {fmt(d)}; B's recall {fmt(q)}; not seen {r['not_seen']}, "
            f"not dropped {r['not_dropped']}; within 1 s: {r['within_1s']}")

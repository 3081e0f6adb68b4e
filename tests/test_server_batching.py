"""Continuous batching in `kvmemory serve --batch-slots N` (engine/scheduler.py), against a real server
process with the embedded model: concurrent requests share steps (the metrics say so) and every answer
is byte-equal to the same request sent alone (its logits' hash included); chats batch too; a stream
whose client goes away leaves the batch and the server keeps answering.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_process import start_server

pytestmark = pytest.mark.slow

ADMIN = "sk-admin-batch-0000"
PROMPTS = ["The capital of France is", "Once upon a time, a small robot", "def fibonacci(n):",
           "The three primary colors are", "In 1969, the first humans", "A haiku about winter:",
           "Water boils at a temperature of", "The quick brown fox"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("batch"), "--batch-slots", "8", "--queue-depth", "16",
                       keys={"admin": ADMIN})
    yield srv
    srv.stop()


def _complete(server, prompt: str, max_tokens: int = 12) -> dict:
    with server.client(ADMIN) as c:
        r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _concurrently(fn, args: list) -> list:
    out: list = [None] * len(args)

    def run(i):
        out[i] = fn(*args[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _metric(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def test_concurrent_completions_share_steps_and_equal_each_alone(server):
    alone = [_complete(server, p, 10 + i) for i, p in enumerate(PROMPTS)]
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(_metric(server, "kvmemory_batch_rows"))

    w = threading.Thread(target=watch)
    w.start()
    together = _concurrently(lambda p, n: _complete(server, p, n), [(p, 10 + i) for i, p in enumerate(PROMPTS)])
    stop.set()
    w.join()
    for a, b in zip(alone, together):
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["kvmemory"]["logits_sha256"] == a["kvmemory"]["logits_sha256"]
    assert _metric(server, "kvmemory_batch_slots") == 8
    assert max(seen) > 1, seen  # several sequences in one step
    health = httpx.get(f"{server.url}/healthz").json()
    assert health["batch"]["slots"] == 8


def test_concurrent_chats_equal_each_alone(server):
    def chat(q):
        with server.client(ADMIN) as c:
            r = c.post("/v1/chat/completions", json={"model": "kvmemory", "max_tokens": 12, "temperature": 0,
                                                     "messages": [{"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    qs = ["What is 2 + 2?", "Name a fruit.", "Say hello.", "What color is the sky?"]
    alone = [chat(q) for q in qs]
    assert _concurrently(chat, [(q,) for q in qs]) == alone


def test_a_stream_that_goes_away_leaves_the_batch(server):
    with server.client(ADMIN) as c:
        with c.stream("POST", "/v1/completions", json={"model": "kvmemory", "prompt": "Count: 1, 2, 3,",
                                                       "max_tokens": 400, "stream": True, "temperature": 0}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # the client leaves after the first event
    # the server answers the next request (the cancelled sequence freed its row)
    assert _complete(server, PROMPTS[0], 4)["choices"][0]["text"]


def test_a_full_batch_and_queue_give_429_and_a_cancelled_stream_makes_room(tmp_path):
    """`--batch-slots 2 --queue-depth 1`: two streams decoding in the batch and one request waiting fill
    it; the next gets a JSON 429 at once. When the streams' clients go away their rows free at once and
    the waiting request is answered."""
    srv = start_server(tmp_path, "--batch-slots", "2", "--queue-depth", "1", keys={"admin": ADMIN})
    body = {"model": "kvmemory", "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": 400, "stream": True, "kvmemory": {"memory": False, "cache": False}}
    try:
        with srv.client(ADMIN) as c1, srv.client(ADMIN) as c2, \
                c1.stream("POST", "/v1/chat/completions", json=body) as s1, \
                c2.stream("POST", "/v1/chat/completions", json=body) as s2:
            lines = [s.iter_lines() for s in (s1, s2)]  # kept: a dropped line iterator closes its response
            for s, it in zip((s1, s2), lines):
                assert s.status_code == 200
                assert next(line for line in it if '"content": "' in line and '"content": ""' not in line)
            waited: list = []
            waiter = threading.Thread(target=lambda: waited.append(_complete(srv, PROMPTS[1], 3)))
            waiter.start()
            with srv.client(ADMIN) as c:
                deadline = time.monotonic() + 60
                while _metric(srv, "kvmemory_queue_waiting") < 1:
                    assert time.monotonic() < deadline, "the third request never waited"
                r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full"
        # both streams closed: their sequences leave the batch, the waiting request runs
        waiter.join(120)
        assert waited and waited[0]["choices"][0]["text"]
    finally:
        srv.stop()

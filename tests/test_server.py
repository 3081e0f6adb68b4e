"""`kvmemory serve` end to end, against a real server process (uvicorn, the embedded model, a throw-away
store) driven over HTTP: the OpenAI routes and what they report (cached tokens = tokens grafted, a
conversation's turn 2 grafting turn 1), the memory API, a served answer's logits equal to a recompute
here, tenants kept apart on every route (MCP included), limits and the full queue as 4xx, metrics
that parse, JSON logs, and a graceful shutdown that keeps an accepted entry.

One server for the module (the model loads once); the last test shuts it down.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from server_process import start_server

pytestmark = pytest.mark.slow

ADMIN = "sk-admin-test-0000"
ALICE = "sk-alice-test-1111"
BOB = "sk-bob-test-22222"
KEYS_FILE = {"keys": [{"name": "alice", "key": ALICE, "user_ids": ["alice"]},
                      {"name": "bob", "key_sha256": hashlib.sha256(BOB.encode()).hexdigest(), "user_ids": ["bob"]}]}
QUEUE_DEPTH = 2
MAX_BODY = 65536
MAX_PROMPT = 1024
MAX_TOKENS = 512

EGGS = ("Tom has 3 boxes of 12 eggs and breaks 5. How many are left?", "3 * 12 = 36. 36 - 5 = 31. The answer is 31.", "31")
EGGS_Q = "Tom owns 3 boxes with 12 eggs each; 5 break. How many eggs remain?"
APPLES = ("A farmer has 7 crates of 9 apples and sells 20. How many apples remain?",
          "7 * 9 = 63. 63 - 20 = 43. The answer is 43.", "43")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one request at a time (--batch-slots 1): the queue tests below count on a single running request
    srv = start_server(tmp_path_factory.mktemp("serve"), "--batch-slots", "1", "--queue-depth", str(QUEUE_DEPTH),
                       "--max-body-bytes", str(MAX_BODY), "--max-prompt-tokens", str(MAX_PROMPT),
                       "--max-tokens-limit", str(MAX_TOKENS), keys={"admin": ADMIN}, keys_file=KEYS_FILE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def entries(server):
    """Alice's eggs entry and Bob's apples entry, remembered through the API with each one's key."""
    with server.client(ALICE) as a, server.client(BOB) as b:
        ra = a.post("/v1/memory/remember", json=dict(zip(("problem", "solution", "answer"), EGGS),
                                                     metadata={"topic": "eggs"}))
        rb = b.post("/v1/memory/remember", json=dict(zip(("problem", "solution", "answer"), APPLES)))
    assert ra.status_code == 200, ra.text
    assert rb.status_code == 200, rb.text
    return ra.json(), rb.json()


def chat(client: httpx.Client, messages, **kw) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "kvmemory", "messages": messages, **kw})


def metric(server, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    raise KeyError(name)


# ---------------------------------------------------------------------- packaging
def test_import_kvmemory_does_not_need_the_server_dependencies():
    code = ("import sys, kvmemory; kvmemory.KVMemory; import kvmemory.cli, kvmemory.server, kvmemory.server.worker, "
            "kvmemory.server.auth, kvmemory.server.metrics; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'mcp') if m in sys.modules]; "
            "assert not bad, bad")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


# ---------------------------------------------------------------------- auth and basics
def test_healthz_is_open_and_every_other_route_needs_a_key(server, entries):
    assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
    eid = entries[0]["id"]
    routes = [("GET", "/metrics", None), ("GET", "/v1/models", None),
              ("POST", "/v1/chat/completions", {"model": "kvmemory", "messages": [{"role": "user", "content": "hi"}]}),
              ("POST", "/v1/completions", {"model": "kvmemory", "prompt": "hi"}),
              ("POST", "/v1/memory/remember", {"problem": "p", "solution": "s"}),
              ("POST", "/v1/memory/recall", {"query": "q"}), ("POST", "/v1/memory/answer", {"query": "q"}),
              ("GET", "/v1/memory/entries", None), ("GET", f"/v1/memory/entries/{eid}", None),
              ("DELETE", f"/v1/memory/entries/{eid}", None), ("POST", "/v1/memory/forget", {"all": True}),
              ("POST", "/v1/memory/verify", {}), ("GET", "/v1/memory/stats", None),
              ("GET", "/v1/memory/export", None), ("POST", "/v1/memory/import", None),
              ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})]
    for key in (None, "sk-wrong-key-000"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path, body in routes:
            r = httpx.request(method, f"{server.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    with server.client(ALICE) as a:  # the entry is still there: nothing ran without a key
        assert a.get(f"/v1/memory/entries/{eid}").status_code == 200


def test_models(server):
    with server.client(ADMIN) as c:
        data = c.get("/v1/models").json()["data"]
    # the served name, then the model the server was started with (`serve` names it): both accepted
    assert [m["id"] for m in data] == ["kvmemory", "embedded:smollm2-135m-instruct"]
    assert len(data[0]["kvmemory"]["profile_id"]) == 64


# ---------------------------------------------------------------------- chat: prefix cache and routing
def test_second_turn_grafts_the_first_turns_prompt_blocks(server):
    user = f"user-{uuid.uuid4().hex[:8]}"  # an empty namespace: nothing to route to
    topic = uuid.uuid4().hex  # a prompt no earlier call stored
    first = {"role": "user", "content": f"Reference {topic}. " + "A train leaves the station at nine in the morning "
             "and travels at sixty kilometres per hour for three hours, then stops for lunch. " * 3
             + "How far has it travelled before lunch?"}
    with server.client(ADMIN) as c:
        r1 = chat(c, [first], max_tokens=12, kvmemory={"user_id": user}).json()
        n1 = r1["usage"]["prompt_tokens"]
        assert n1 >= 128, n1
        # nothing of it stored but the template's preamble (24 tokens, a cut: memory/layout.py), which an
        # earlier call may have stored (blocks are shared by content); then its other blocks and its tail
        # block (the prompt's end is a cut)
        pre = r1["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert pre in (0, 24)
        assert r1["kvmemory"]["blocks_stored"] == (pre == 0) + -(-n1 // 64)
        turn2 = [first, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And how long did it travel?"}]
        r2 = chat(c, turn2, max_tokens=8, kvmemory={"user_id": user}).json()
        u2, k2 = r2["usage"], r2["kvmemory"]
        # turn 2 read every token of turn 1's prompt from the store and computed only the rest
        assert u2["prompt_tokens_details"]["cached_tokens"] == n1
        assert k2["tokens_grafted"] == u2["prompt_tokens_details"]["cached_tokens"]
        assert k2["tokens_computed"] == u2["prompt_tokens"] - k2["tokens_grafted"]
        turn3 = turn2 + [{"role": "assistant", "content": r2["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "Thanks."}]
        r3 = chat(c, turn3, max_tokens=4, kvmemory={"user_id": user}).json()
        assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == u2["prompt_tokens"]
        # with cache off nothing is stored (a fresh prompt then grafts on its second call only the template's
        # preamble that turn 1 stored, as on its first)
        fresh = [{"role": "user", "content": f"Reference {uuid.uuid4().hex}. " + "Count the sheep in the field. " * 12}]
        off = {"user_id": user, "cache": False}
        a = chat(c, fresh, max_tokens=2, kvmemory=off).json()
        b = chat(c, fresh, max_tokens=2, kvmemory=off).json()
        assert a["kvmemory"]["blocks_stored"] == 0
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == a["usage"]["prompt_tokens_details"]["cached_tokens"] == 24


def test_a_short_first_turn_is_cached_whole(server):
    """Issue 41: a first turn shorter than a block (37 tokens: the default system prompt and a short
    question) is stored as two tail blocks (the template's preamble is a cut), and turn 2 grafts all of it."""
    user = f"user-{uuid.uuid4().hex[:8]}"
    first = {"role": "user", "content": f"What is {uuid.uuid4().int % 90 + 10} plus 2?"}
    with server.client(ADMIN) as c:
        r1 = chat(c, [first], max_tokens=6, kvmemory={"user_id": user}).json()
        n1 = r1["usage"]["prompt_tokens"]
        pre = r1["usage"]["prompt_tokens_details"]["cached_tokens"]  # the template's preamble, if stored before
        assert n1 < 64 and pre in (0, 24) and r1["kvmemory"]["blocks_stored"] == 1 + (pre == 0)
        turn2 = [first, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And minus 2?"}]
        r2 = chat(c, turn2, max_tokens=6, kvmemory={"user_id": user}).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n1 > 0


def test_chat_routes_to_the_callers_verified_entry(server, entries):
    alice_entry = entries[0]
    with server.client(ALICE) as a:
        r = chat(a, [{"role": "user", "content": EGGS_Q}], max_tokens=16).json()
        k = r["kvmemory"]
        assert k["namespace"] == "user:alice"
        assert [e["id"] for e in k["entries"]] == [alice_entry["id"]]
        assert k["attestation_ids"] == [alice_entry["attestation_id"]] and k["entries"][0]["verified"]
        # the entry's stored blocks are the prompt's prefix: grafted, not recomputed
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert r["system_fingerprint"].startswith("kvm-")
        off = chat(a, [{"role": "user", "content": EGGS_Q}], max_tokens=4, kvmemory={"memory": False}).json()
        assert off["kvmemory"]["entries"] == []


def test_memory_api_answer_get_list_stats_verify(server, entries):
    alice_entry = entries[0]
    with server.client(ALICE) as a:
        assert alice_entry["namespace"] == "user:alice" and alice_entry["verified"] and alice_entry["bit_identical"]
        ans = a.post("/v1/memory/answer", json={"query": EGGS_Q, "answer_prefix": "The answer is",
                                                "choices": "numbers"}).json()
        assert ans["text"] == "The answer is 31." and ans["entries"] == [alice_entry["id"]]
        assert ans["tokens_grafted"] >= 64
        rec = a.post("/v1/memory/recall", json={"query": EGGS_Q}).json()
        assert [h["id"] for h in rec["results"]] == [alice_entry["id"]] and rec["results"][0]["score"] > 0.8
        got = a.get(f"/v1/memory/entries/{alice_entry['id']}").json()
        assert got["solution"] == EGGS[1] and got["metadata"] == {"topic": "eggs"}
        page = a.get("/v1/memory/entries", params={"metadata": json.dumps({"topic": "eggs"}), "limit": 5}).json()
        assert [e["id"] for e in page["data"]] == [alice_entry["id"]] and page["next_offset"] is None
        assert a.get("/v1/memory/entries", params={"metadata": json.dumps({"topic": "pears"})}).json()["total"] == 0
        st = a.get("/v1/memory/stats").json()
        assert st["entries"] >= 1 and "store" not in st  # a tenant sees its scope's counts, not the store's
        v = a.post("/v1/memory/verify", json={"entry_ids": [alice_entry["id"]]}).json()
        assert v["checked"] == v["bit_identical"] == 1 and v["kl_max"] == 0.0 and v["attestation_match"] == 1
        bad = a.post("/v1/memory/remember", json={"problem": "What is 2 + 2?", "solution": "2 + 2 = 5.", "answer": "4"})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "verification_failed"
    with server.client(ADMIN) as c:
        assert "store" in c.get("/v1/memory/stats", params={"user_id": "alice"}).json()


def test_export_and_import_a_bundle_within_the_scope(server, entries):
    alice_entry = entries[0]
    with server.client(ALICE) as a, server.client(BOB) as b:
        r = a.get("/v1/memory/export")
        assert r.status_code == 200, r.text
        bundle = r.content
        assert int(r.headers["x-kvmemory-entries"]) >= 1 and hashlib.sha256(bundle).hexdigest() == \
            r.headers["x-kvmemory-bundle-sha256"]
        # Bob cannot plant Alice's entries in his scope, nor anywhere else
        r = b.post("/v1/memory/import", content=bundle)
        assert r.status_code == 403 and r.json()["error"]["code"] == "ForeignNamespace"
        assert b.get(f"/v1/memory/entries/{alice_entry['id']}").status_code == 404
        # Alice forgets her entry and gets it back from the bundle, proved on import
        assert a.delete(f"/v1/memory/entries/{alice_entry['id']}").json()["forgotten"] == 1
        assert a.get(f"/v1/memory/entries/{alice_entry['id']}").status_code == 404
        r = a.post("/v1/memory/import", content=bundle)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["ok"] and alice_entry["id"] in out["imported"] and out["verify"]["bit_identical"] >= 1
        assert a.get(f"/v1/memory/entries/{alice_entry['id']}").json()["attestation_id"] == alice_entry["attestation_id"]
        r = a.post("/v1/memory/import", content=b"not a bundle")
        assert r.status_code == 400, r.text
    assert not list((server.store / "serve-tmp").iterdir())  # nothing left behind in transit


def test_a_served_answers_logits_equal_a_recompute_here(server, smollm):
    """The graft a served completion ran, checked byte for byte against this process's own recompute
    from scratch (same profile: same model files, kernels, threads)."""
    from kvmemory.engine.engine import Engine
    from kvmemory.store.local import LocalStore

    stem = f"Note {uuid.uuid4().hex}. " + "The library opens at eight and closes at six; on Sundays it opens at ten. " * 4
    with server.client(ADMIN) as c:
        first = c.post("/v1/completions", json={"model": "kvmemory", "prompt": stem, "max_tokens": 4}).json()
        assert first["kvmemory"]["blocks_stored"] >= 1
        prompt = stem + "On Sundays the library opens at"
        r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": prompt, "max_tokens": 6}).json()
    k = r["kvmemory"]
    assert k["tokens_grafted"] >= 64 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == k["tokens_grafted"]
    from kvmemory.models.loading import files_model_sha256

    # As Engine.open (the server) opens it: kv_dtype resolved, the model named by its files.
    engine = Engine(smollm, LocalStore(server.store), kv_dtype="auto",
                    model_sha256=files_model_sha256(smollm.weights_files))
    assert engine.profile_id == k["profile_id"], "the test process runs another profile: the check would be void"
    ids = engine.encode(prompt)
    assert len(ids) == r["usage"]["prompt_tokens"]
    ref = engine.recompute(ids, max_new_tokens=r["usage"]["completion_tokens"], stop_token_ids=())
    g = k["graft_point"]
    assert g == k["tokens_grafted"]
    import torch

    rows = torch.cat([ref.prefill_logits[g:], ref.decode_logits], 0).contiguous()
    assert hashlib.sha256(rows.numpy().tobytes()).hexdigest() == k["logits_sha256"]
    eos = set(engine.eos_token_ids)
    assert engine.decode([t for t in ref.generated if t not in eos]) == r["choices"][0]["text"]


# ---------------------------------------------------------------------- tenancy
def test_a_tenant_cannot_reach_another_tenants_entries_through_any_route(server, entries):
    alice_entry, bob_entry = entries
    bid = bob_entry["id"]
    msgs = [{"role": "user", "content": APPLES[0]}]
    as_bob = {"user_id": "bob"}
    crossing = [
        ("POST", "/v1/chat/completions", {"model": "kvmemory", "messages": msgs, "max_tokens": 2, "kvmemory": as_bob}, None),
        ("POST", "/v1/chat/completions", {"model": "kvmemory", "messages": msgs, "max_tokens": 2},
         {"X-KVMemory-User-Id": "bob"}),
        ("POST", "/v1/completions", {"model": "kvmemory", "prompt": "hi", "max_tokens": 1, "kvmemory": as_bob}, None),
        ("POST", "/v1/memory/remember", {**as_bob, "problem": "p?", "solution": "s", "verifier": "none"}, None),
        ("POST", "/v1/memory/recall", {**as_bob, "query": APPLES[0]}, None),
        ("POST", "/v1/memory/answer", {**as_bob, "query": APPLES[0]}, None),
        ("GET", "/v1/memory/entries?user_id=bob", None, None),
        ("GET", f"/v1/memory/entries/{bid}?user_id=bob", None, None),
        ("DELETE", f"/v1/memory/entries/{bid}?user_id=bob", None, None),
        ("POST", "/v1/memory/forget", {**as_bob, "entry_ids": [bid]}, None),
        ("POST", "/v1/memory/forget", {**as_bob, "all": True}, None),
        ("POST", "/v1/memory/verify", as_bob, None),
        ("GET", "/v1/memory/stats?user_id=bob", None, None),
        ("GET", "/v1/memory/stats?namespace=default", None, None),
        ("GET", "/v1/memory/export?user_id=bob", None, None),
        ("POST", "/v1/memory/import?user_id=bob", None, None),
        ("POST", "/v1/memory/recall", {"agent_id": "planner", "query": APPLES[0]}, None),  # no user: not alice's
    ]
    with server.client(ALICE) as a:
        for method, path, body, headers in crossing:
            r = a.request(method, path, json=body, headers=headers)
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "scope_forbidden"
        # Bob's entry id within Alice's own scope reads as unknown, like an id that does not exist
        for method, path, body in [("GET", f"/v1/memory/entries/{bid}", None),
                                   ("DELETE", f"/v1/memory/entries/{bid}", None),
                                   ("POST", "/v1/memory/forget", {"entry_ids": [bid]}),
                                   ("POST", "/v1/memory/verify", {"entry_ids": [bid]})]:
            r = a.request(method, path, json=body)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert a.get(f"/v1/memory/entries/e{'0' * 15}").status_code == 404
        # and Bob's problem, asked in Alice's scope, routes to nothing of Bob's
        assert all(h["id"] != bid for h in a.post("/v1/memory/recall", json={"query": APPLES[0]}).json()["results"])
        assert chat(a, msgs, max_tokens=2).json()["kvmemory"]["entries"] == []
        assert bid not in {e["id"] for e in a.get("/v1/memory/entries").json()["data"]}
        assert alice_entry["id"] in {e["id"] for e in a.get("/v1/memory/entries").json()["data"]}
    with server.client(BOB) as b:  # untouched by every attempt
        assert b.get(f"/v1/memory/entries/{bid}").json()["answer"] == "43"
        assert b.get(f"/v1/memory/entries/{alice_entry['id']}").status_code == 404
    with server.client(ADMIN) as c:  # the 404s were about the scope, not the id
        assert c.get(f"/v1/memory/entries/{bid}", params={"user_id": "bob"}).status_code == 200


def test_mcp_tools_over_http_with_keys(server, entries):
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    alice_entry, bob_entry = entries

    async def session(key: str, calls):
        async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as http:
            async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
                names = sorted(t.name for t in (await c.list_tools()).tools)
                return names, [await c.call_tool(name, args) for name, args in calls]

    names, (own, crossed, bobs_id, answered) = asyncio.run(session(ALICE, [
        ("recall", {"query": EGGS_Q}),
        ("recall", {"query": APPLES[0], "user_id": "bob"}),
        ("forget", {"entry_ids": [bob_entry["id"]]}),
        ("answer", {"query": EGGS_Q, "answer_prefix": "The answer is", "choices": "numbers"}),
    ]))
    assert names == ["answer", "forget", "get", "history", "list", "recall", "remember", "update"]
    assert not own.is_error and alice_entry["id"] in own.content[0].text and bob_entry["id"] not in own.content[0].text
    assert crossed.is_error and "Forbidden" in crossed.content[0].text and bob_entry["id"] not in crossed.content[0].text
    assert bobs_id.is_error and "UnknownEntry" in bobs_id.content[0].text
    assert not answered.is_error and json.loads(answered.content[0].text)["text"] == "The answer is 31."
    # remember then forget through MCP, in Bob's scope with Bob's key
    _, (made, gone) = asyncio.run(session(BOB, [
        ("remember", {"problem": "Sam has 4 bags of 6 marbles. How many marbles?", "solution": "4 * 6 = 24. The answer is 24.",
                      "answer": 24}),
        ("forget", {"entry_ids": ["placeholder"]}),
    ]))
    assert not made.is_error and json.loads(made.content[0].text)["namespace"] == "user:bob"
    assert gone.is_error  # an unknown id
    made_id = json.loads(made.content[0].text)["id"]
    _, (gone,) = asyncio.run(session(BOB, [("forget", {"entry_ids": [made_id]})]))
    assert not gone.is_error and json.loads(gone.content[0].text)["forgotten"] == 1
    with server.client(BOB) as b:
        assert b.get(f"/v1/memory/entries/{made_id}").status_code == 404
        assert b.get(f"/v1/memory/entries/{bob_entry['id']}").status_code == 200


def test_mcp_over_stdio_with_the_sdks_client(tmp_path):
    """`kvmemory serve --mcp-stdio` started by the SDK's stdio client, acting as Alice
    ($KVMEMORY_MCP_KEY): her scope works, Bob's is refused; without a key it does not start."""
    import os

    from mcp import Client, StdioServerParameters

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS_FILE))
    cmd = ["-m", "kvmemory.cli", "serve", "--mcp-stdio", "--store", str(tmp_path / "store"), "--keys-file", str(keys)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("KVMEMORY_MCP_KEY", None)
    p = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "KVMEMORY_MCP_KEY" in p.stderr

    async def session():
        params = StdioServerParameters(command=sys.executable, args=cmd, env={**env, "KVMEMORY_MCP_KEY": ALICE})
        async with Client(params, read_timeout_seconds=300) as c:
            names = sorted(t.name for t in (await c.list_tools()).tools)
            made = await c.call_tool("remember", {"problem": EGGS[0], "solution": EGGS[1], "answer": EGGS[2]})
            found = await c.call_tool("recall", {"query": EGGS_Q})
            crossed = await c.call_tool("remember", {"problem": EGGS[0], "solution": EGGS[1], "user_id": "bob"})
            entry = json.loads(made.content[0].text)
            gone = await c.call_tool("forget", {"entry_ids": [entry["id"]]})
            return names, made, found, crossed, gone, entry

    names, made, found, crossed, gone, entry = asyncio.run(session())
    assert names == ["answer", "forget", "get", "history", "list", "recall", "remember", "update"]
    assert not made.is_error and entry["namespace"] == "user:alice" and entry["bit_identical"]
    assert [h["id"] for h in json.loads(found.content[0].text)["results"]] == [entry["id"]]
    assert crossed.is_error and "Forbidden" in crossed.content[0].text
    assert not gone.is_error and json.loads(gone.content[0].text)["forgotten"] == 1


# ---------------------------------------------------------------------- limits
def test_limits_give_clear_4xx(server):
    msgs = [{"role": "user", "content": "hi"}]
    with server.client(ADMIN) as c:
        r = c.post("/v1/chat/completions", content=b'{"model": "kvmemory", "messages": [' + b" " * MAX_BODY + b"]}",
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
        r = chat(c, msgs, max_tokens=MAX_TOKENS + 1)
        assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_exceeded"
        long = [{"role": "user", "content": "word " * (MAX_PROMPT + 100)}]
        for stream in (False, True):  # a stream is refused before it starts, with the same 400
            r = chat(c, long, max_tokens=1, stream=stream)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": "word " * (MAX_PROMPT + 100)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        for extra, param in [({"n": 2}, "n"), ({"response_format": {"type": "xml"}}, "response_format"),
                             ({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty")]:
            r = chat(c, msgs, **extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert chat(c, [{"role": "robot", "content": "x"}]).status_code == 400
        assert c.post("/v1/chat/completions", json={"model": "kvmemory"}).status_code == 400  # no messages
        r = c.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": msgs})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = chat(c, msgs, tools=[{"type": "function", "function": {"name": "add"}}], tool_choice="mul")
        assert r.status_code == 400 and "names no bound tool" in r.json()["error"]["message"]
        r = c.post("/v1/memory/recall", json={"query": "q", "user_id": "a/b"})
        assert r.status_code == 400  # a scope id that could spell another namespace
        assert c.get("/v1/memory/entries", params={"limit": 1000}).status_code in (400, 422)


def test_full_queue_gives_429_and_a_cancelled_stream_frees_the_worker(server):
    body = {"model": "kvmemory", "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
            "max_tokens": MAX_TOKENS, "stream": True, "kvmemory": {"memory": False, "cache": False}}
    results: list[int] = []
    with server.client(ADMIN) as c, c.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if '"content": "' in line and '"content": ""' not in line)  # decoding now

        def queued():
            with server.client(ADMIN) as q:
                results.append(chat(q, [{"role": "user", "content": "Say yes."}], max_tokens=2).status_code)

        waiters = [threading.Thread(target=queued) for _ in range(QUEUE_DEPTH)]
        for t in waiters:
            t.start()
        deadline = time.monotonic() + 60
        while metric(server, "kvmemory_queue_waiting") < QUEUE_DEPTH:
            assert time.monotonic() < deadline, "the queued requests never showed up in the queue"
            time.sleep(0.05)
        rejected_before = metric(server, "kvmemory_queue_rejected_total")
        r = chat(c, [{"role": "user", "content": "Say no."}], max_tokens=2)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"] == "1"
        assert metric(server, "kvmemory_queue_rejected_total") == rejected_before + 1
        t0 = time.monotonic()
    # leaving the `with` closed the stream: its decode stops at the next token and the queued requests run
    for t in waiters:
        t.join(120)
    assert results == [200] * QUEUE_DEPTH
    assert time.monotonic() - t0 < 60


def test_metrics_parse_and_count_grafts(server):
    from prometheus_client.parser import text_string_to_metric_families

    before = metric(server, "kvmemory_tokens_total", {"kind": "grafted"}), metric(server, "kvmemory_graft_hits_total")
    with server.client(ALICE) as a:
        r = chat(a, [{"role": "user", "content": EGGS_Q}], max_tokens=2).json()
    grafted = r["kvmemory"]["tokens_grafted"]
    assert grafted > 0
    assert metric(server, "kvmemory_tokens_total", {"kind": "grafted"}) == before[0] + grafted
    assert metric(server, "kvmemory_graft_hits_total") == before[1] + 1
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kvmemory_requests", "kvmemory_request_seconds", "kvmemory_tokens", "kvmemory_graft_hits",
                 "kvmemory_blocks_quarantined", "kvmemory_store_quarantined_blocks", "kvmemory_queue_waiting"):
        assert name in families, sorted(families)
    ok = [s for s in families["kvmemory_requests"].samples
          if s.labels.get("route") == "/v1/chat/completions" and s.labels.get("status") == "200"]
    assert ok and ok[0].value >= 1
    assert families["kvmemory_request_seconds"].type == "histogram"


def test_logs_are_json_lines(server):
    lines = [json.loads(line) for line in server.log_lines() if line.strip()]  # every line parses
    requests = [r for r in lines if r.get("event") == "request"]
    assert any(r["route"] == "/v1/chat/completions" and r["status"] == 200 and r["key"] == "alice"
               and r["namespace"] == "user:alice" for r in requests)
    assert not any(ALICE in json.dumps(r) for r in lines)  # keys are never logged
    # the library's own warnings (a recall in a namespace with no entries) are JSON lines too
    assert any(r["logger"] == "kvmemory.memory" and r["level"] == "warning" for r in lines)


# ---------------------------------------------------------------------- last: shutdown
def test_sigterm_finishes_an_accepted_remember_and_exits_cleanly(server):
    from kvmemory.store.local import LocalStore

    out: dict = {}

    def remember():
        with server.client(ALICE) as a:
            out["r"] = a.post("/v1/memory/remember", json={
                "problem": "Ann buys 5 packs of 8 pencils. How many pencils?",
                "solution": "5 * 8 = 40. The answer is 40.", "answer": "40"})

    t = threading.Thread(target=remember)
    t.start()
    deadline = time.monotonic() + 60
    while metric(server, "kvmemory_queue_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught (the process ends as signalled)
    assert server.stop() in (0, -signal.SIGTERM)
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    entry_id = out["r"].json()["id"]
    store = LocalStore(server.store)
    assert store.get_entry(entry_id, "user:alice").answer == "40"
    logged = [json.loads(line) for line in server.log_lines() if line.strip()]
    stopped = [r for r in logged if r.get("event") == "stopped"]
    assert stopped and stopped[-1]["worker_finished"] is True
    assert any(r["msg"] == "Application shutdown complete." for r in logged)
    remembered = [r for r in logged if r.get("route") == "/v1/memory/remember"]
    assert remembered[-1]["status"] == 200  # answered before the process went away

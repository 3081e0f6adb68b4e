"""`kvmemory serve` with tenant keys, probed as a curious tenant would (issue 40, item 4), and its
OpenAI routes' request fields (item 7), against a real server process.

Tenancy: for every HTTP route and MCP tool that takes an entry id or a scope, Bob asking for Alice's
entry id (or scope, or a team's namespace) gets exactly what he gets for an id (or scope) that exists
nowhere: the same status and the same body, byte for byte once the id or name he sent is replaced by a
placeholder. No answer names another namespace or counts its entries.

Fields: an unknown field of a chat or completion request is a 400 naming it (as the memory API's strict
bodies are); OpenAI's fields that change nothing here are accepted, and the ones that would change the
result are refused by name (the official clients keep working: tests/test_server_clients.py).
"""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest

from server_process import start_server

pytestmark = pytest.mark.slow

ADMIN = "sk-admin-tenancy-0000"
ALICE = "sk-alice-tenancy-1111"
BOB = "sk-bob-tenancy-22222"
TEAM = "sk-team-a-tenancy-333"
KEYS_FILE = {"keys": [{"name": "alice", "key": ALICE, "user_ids": ["alice"]},
                      {"name": "bob", "key": BOB, "user_ids": ["bob"]},
                      {"name": "team-a", "key": TEAM, "namespaces": ["team-a", "team-a-*"]}]}
EGGS = {"problem": "Tom has 3 boxes of 12 eggs and breaks 5. How many are left?",
        "solution": "3 * 12 = 36. 36 - 5 = 31. The answer is 31.", "answer": "31"}
APPLES = {"problem": "A farmer has 7 crates of 9 apples and sells 20. How many apples remain?",
          "solution": "7 * 9 = 63. 63 - 20 = 43. The answer is 43.", "answer": "43"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("tenancy"), "--max-tokens-limit", "64", keys={"admin": ADMIN},
                       keys_file=KEYS_FILE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ids(server):
    """Alice's entry, Bob's entry and one in namespace team-b (made by the admin), remembered through the API."""
    out = {}
    for key, body, name in ((ALICE, EGGS, "alice"), (BOB, APPLES, "bob"), (ADMIN, {**EGGS, "namespace": "team-b"},
                                                                            "team-b")):
        with server.client(key) as c:
            r = c.post("/v1/memory/remember", json=body)
        assert r.status_code == 200, r.text
        out[name] = r.json()["id"]
    return out


def nobody() -> str:
    """An id of the same shape as a real one, that no entry has."""
    return "e" + secrets.token_hex(8)[:15]


def same_answer(a: httpx.Response, b: httpx.Response, echoed: tuple[str, str]) -> None:
    """Equal status and body, once each response's echo of what its request sent is a placeholder."""
    body_a = a.content.replace(echoed[0].encode(), b"<SENT>")
    body_b = b.content.replace(echoed[1].encode(), b"<SENT>")
    assert (a.status_code, body_a) == (b.status_code, body_b), (a.status_code, a.text, b.status_code, b.text)
    assert a.headers.get("content-type") == b.headers.get("content-type")


ID_ROUTES = [
    ("GET", "/v1/memory/entries/{id}", None, {}),
    ("GET", "/v1/memory/entries/{id}", None, {"user_id": "bob"}),
    ("DELETE", "/v1/memory/entries/{id}", None, {}),
    ("POST", "/v1/memory/forget", {"entry_ids": ["{id}"]}, {}),
    ("POST", "/v1/memory/forget", {"entry_ids": ["{own}", "{id}"]}, {}),
    ("POST", "/v1/memory/verify", {"entry_ids": ["{id}"]}, {}),
    ("POST", "/v1/memory/verify", {"entry_ids": ["{own}", "{id}"]}, {}),
    ("GET", "/v1/memory/export", None, {"entry_ids": "{id}"}),
    ("GET", "/v1/memory/export", None, {"entry_ids": "{own},{id}"}),
]


def _fill(value, eid: str, own: str):
    if isinstance(value, str):
        return value.replace("{id}", eid).replace("{own}", own)
    if isinstance(value, list):
        return [_fill(v, eid, own) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, eid, own) for k, v in value.items()}
    return value


SCOPE_ROUTES = [
    ("POST", "/v1/chat/completions", {"model": "kvmemory", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": EGGS["problem"]}],
                                      "kvmemory": {"{field}": "{name}"}}, {}),
    ("POST", "/v1/completions", {"model": "kvmemory", "prompt": "hi", "max_tokens": 1,
                                 "kvmemory": {"{field}": "{name}"}}, {}),
    ("POST", "/v1/memory/remember", {**APPLES, "{field}": "{name}"}, {}),
    ("POST", "/v1/memory/recall", {"query": EGGS["problem"], "{field}": "{name}"}, {}),
    ("POST", "/v1/memory/answer", {"query": EGGS["problem"], "{field}": "{name}"}, {}),
    ("GET", "/v1/memory/entries", None, {"{field}": "{name}"}),
    ("GET", "/v1/memory/entries/{own}", None, {"{field}": "{name}"}),
    ("DELETE", "/v1/memory/entries/{own}", None, {"{field}": "{name}"}),
    ("POST", "/v1/memory/forget", {"all": True, "{field}": "{name}"}, {}),
    ("POST", "/v1/memory/verify", {"{field}": "{name}"}, {}),
    ("GET", "/v1/memory/stats", None, {"{field}": "{name}"}),
    ("GET", "/v1/memory/export", None, {"{field}": "{name}"}),
    ("POST", "/v1/memory/import", None, {"{field}": "{name}"}),
]


def _scoped(value, field: str, name: str, own: str):
    if isinstance(value, str):
        return value.replace("{field}", field).replace("{name}", name).replace("{own}", own)
    if isinstance(value, dict):
        return {_scoped(k, field, name, own): _scoped(v, field, name, own) for k, v in value.items()}
    if isinstance(value, list):
        return [_scoped(v, field, name, own) for v in value]
    return value


def probe_scopes(server, ids, key: str, field: str, theirs: str, none: str, own_id: str) -> None:
    """Every scoped route asked for another tenant's scope, then for one nobody has: the same 403."""
    with server.client(key) as c:
        for method, path, body, params in SCOPE_ROUTES:
            answers = []
            for name in (theirs, none):
                r = c.request(method, _scoped(path, field, name, own_id), json=_scoped(body, field, name, own_id),
                              params=_scoped(params, field, name, own_id),
                              headers={"content-type": "application/json"})
                assert r.status_code == 403, (method, path, name, r.status_code, r.text)
                answers.append(r)
            same_answer(*answers, (theirs, none))
    with server.client(ADMIN) as c:  # every attempt left the others' entries as they were
        assert c.get(f"/v1/memory/entries/{ids['alice']}", params={"user_id": "alice"}).status_code == 200
        assert c.get(f"/v1/memory/entries/{ids['team-b']}", params={"namespace": "team-b"}).status_code == 200


def test_another_tenants_entry_id_or_scope_reads_as_one_that_does_not_exist_on_every_route(server, ids):
    # Scopes (a user id, a team's namespace): refused with 403 before anything is read, whoever holds them
    probe_scopes(server, ids, BOB, "user_id", "alice", "nobody-x7", ids["bob"])
    probe_scopes(server, ids, TEAM, "namespace", "team-b", "team-q", nobody())
    # Entry ids within the caller's own scope: another tenant's reads as one that exists nowhere
    with server.client(BOB) as b:
        for method, path, body, params in ID_ROUTES:
            answers = []
            for eid in (ids["alice"], nobody()):
                r = b.request(method, _fill(path, eid, ids["bob"]), json=_fill(body, eid, ids["bob"]),
                              params=_fill(params, eid, ids["bob"]))
                assert r.status_code == 404, (method, path, r.status_code, r.text)
                assert "alice" not in r.text and "namespaces with entries" not in r.text, r.text
                answers.append((r, eid))
            (r1, id1), (r2, id2) = answers
            same_answer(r1, r2, (id1, id2))
        assert b.get(f"/v1/memory/entries/{ids['bob']}").status_code == 200  # nothing of Bob's was removed
    with server.client(ALICE) as a:
        assert a.get(f"/v1/memory/entries/{ids['alice']}").status_code == 200  # nor of Alice's
    with server.client(ADMIN) as c:  # an admin is told where an id is, as a single-user server says it
        r = c.get(f"/v1/memory/entries/{ids['alice']}", params={"user_id": "bob"})
        assert r.status_code == 404 and "is in namespace 'user:alice'" in r.json()["error"]["message"]


def test_mcp_tools_answer_another_tenants_id_and_scope_as_missing_ones(server, ids):
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async def session(calls):
        async with create_mcp_http_client(headers={"Authorization": f"Bearer {BOB}"}) as http:
            async with Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as c:
                return [await c.call_tool(name, args) for name, args in calls]

    missing = nobody()
    results = asyncio.run(session([
        ("forget", {"entry_ids": [ids["alice"]]}), ("forget", {"entry_ids": [missing]}),
        ("forget", {"entry_ids": [ids["bob"], ids["alice"]]}), ("forget", {"entry_ids": [ids["bob"], missing]}),
        ("recall", {"query": EGGS["problem"], "user_id": "alice"}),
        ("recall", {"query": EGGS["problem"], "user_id": "nobody-x7"}),
        ("answer", {"query": EGGS["problem"], "user_id": "alice"}),
        ("answer", {"query": EGGS["problem"], "user_id": "nobody-x7"}),
        ("remember", {**APPLES, "user_id": "alice"}), ("remember", {**APPLES, "user_id": "nobody-x7"}),
        ("forget", {"all": True, "user_id": "alice"}), ("forget", {"all": True, "user_id": "nobody-x7"}),
    ]))
    sent = [(ids["alice"], missing)] * 2 + [("alice", "nobody-x7")] * 4
    for i, ((theirs, none), (a, b)) in enumerate(zip(sent, zip(results[::2], results[1::2]))):
        assert a.is_error and b.is_error
        text_a, text_b = a.content[0].text, b.content[0].text
        assert text_a.replace(theirs, "<SENT>") == text_b.replace(none, "<SENT>"), (text_a, text_b)
        assert "namespaces with entries" not in text_a
        if i < 2:  # an id: nothing of the namespace that holds it (a scope's refusal echoes the name sent)
            assert "alice" not in text_a, text_a
    with server.client(BOB) as b:
        assert b.get(f"/v1/memory/entries/{ids['bob']}").status_code == 200


def test_metrics_need_an_admin_key_on_a_server_with_tenants(server):
    with server.client(BOB) as b:
        r = b.get("/metrics")
        assert r.status_code == 403 and "kvmemory_store_entries" not in r.text
    with server.client(ADMIN) as c:
        assert "kvmemory_store_entries" in c.get("/metrics").text


# ---------------------------------------------------------------------- OpenAI request fields
def _chat(c: httpx.Client, **extra) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"model": "kvmemory", "max_tokens": 2, "kvmemory": {"memory": False},
                                                "messages": [{"role": "user", "content": "Say hi."}], **extra})


def test_unknown_request_fields_are_a_400_naming_them(server):
    with server.client(ADMIN) as c:
        for route, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}]}),
                            ("/v1/completions", {"prompt": "Say hi."})):
            r = c.post(route, json={"model": "kvmemory", "max_tokens": 2, **base, "max_token": 5, "temprature": 0.2})
            assert r.status_code == 400, (route, r.text)
            err = r.json()["error"]
            assert "'max_token'" in err["message"] and "'temprature'" in err["message"], err
            assert err["code"] == "unknown_field" and err["param"] == "max_token"
        # a chat-only field of OpenAI's is unknown to /v1/completions
        r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": "Say hi.", "max_tokens": 1,
                                            "reasoning_effort": "none"})
        assert r.status_code == 400 and "'reasoning_effort'" in r.json()["error"]["message"]


def test_openai_fields_that_change_nothing_are_accepted_and_the_others_refused_by_name(server):
    with server.client(ADMIN) as c:
        harmless = dict(user="u-1", metadata={"run": "7"}, store=False, service_tier="auto", n=1, seed=3,
                        stream_options=None, parallel_tool_calls=False, prompt_cache_key="k", safety_identifier="s",
                        reasoning_effort="none", modalities=["text"], logit_bias={}, frequency_penalty=0,
                        presence_penalty=0.0, logprobs=False, verbosity=None)
        r = _chat(c, **harmless)
        assert r.status_code == 200, r.text
        for name, value in (("reasoning_effort", "high"), ("verbosity", "low"), ("modalities", ["text", "audio"]),
                            ("audio", {"voice": "alloy", "format": "wav"}), ("web_search_options", {}),
                            ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto")):
            r = _chat(c, **{name: value})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name and name in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "kvmemory", "prompt": "Say hi.", "max_tokens": 1, "user": "u-1"})
        assert r.status_code == 200, r.text


def test_memory_api_query_parameters_it_does_not_take_are_a_400_naming_them(server, ids):
    """A mistyped scope in a query, or a scope in the query of a POST (whose scope is in its body), ran
    the call in the key's default scope."""
    with server.client(ADMIN) as c:
        for method, path, params, body in (("GET", "/v1/memory/entries", {"usr_id": "alice"}, None),
                                           ("GET", f"/v1/memory/entries/{ids['alice']}", {"users_id": "alice"}, None),
                                           ("GET", "/v1/memory/stats", {"namespce": "team-b"}, None),
                                           ("POST", "/v1/memory/recall", {"user_id": "alice"},
                                            {"query": EGGS["problem"]}),
                                           ("POST", "/v1/memory/forget", {"user_id": "alice"}, {"all": True})):
            r = c.request(method, path, params=params, json=body)
            assert r.status_code == 400, (method, path, r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "unknown_field" and err["param"] == next(iter(params)), err
        assert c.get("/v1/memory/entries", params={"user_id": "alice", "limit": 5}).status_code == 200
        assert c.get(f"/v1/memory/entries/{ids['alice']}", params={"user_id": "alice"}).status_code == 200
